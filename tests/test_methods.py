import pytest

from kvcal.errors import KvcalError
from kvcal.methods import artifact_method


def test_a_profile_is_not_an_evaluable_method(tiny_profile):
    with pytest.raises(KvcalError, match="is a kvcal profile; --quant takes a nuq or skvq or bundle artifact"):
        artifact_method(str(tiny_profile[1]))
