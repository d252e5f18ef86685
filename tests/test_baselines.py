import pytest

from kvcal.baselines import baseline_method, kivi_layer, per_token_layer
from kvcal.errors import KvcalError


def test_specs_and_defaults():
    method = baseline_method("int4", 3)
    assert method.name == "int4-g64" and method.layers[0] == per_token_layer(4, 64) and len(method.layers) == 3
    kivi = baseline_method("kivi2", 2)
    assert kivi.name == "kivi2-g32-r128" and kivi.layers[0] == kivi_layer(2, 32) and kivi.policy.residual == 128
    assert baseline_method("kivi3-g64-r64", 1).policy.residual == 64


@pytest.mark.parametrize("spec, message", [("int5", "unknown baseline"), ("fp8", "unknown baseline"),
                                           ("kivi2-g32-r100", "multiple of the group"), ("int2-g64-r128", "no residual")])
def test_bad_specs(spec, message):
    with pytest.raises(KvcalError, match=message):
        baseline_method(spec, 2)
