import pytest

from kvcal.errors import KvcalError
from kvcal.nuq import NuqSettings, fit_nuq, write_nuq
from kvcal.skvq import SkvqSettings, fit_skvq, write_skvq
from kvcal.summary import plot_profile, summarize


def test_every_artifact_kind_has_a_per_layer_summary(tiny_profile, tmp_path):
    _, profile = tiny_profile
    nuq = write_nuq(tmp_path / "n.safetensors", *fit_nuq(str(profile), NuqSettings(bits=2)))
    skvq = write_skvq(tmp_path / "s.safetensors", *fit_skvq(str(profile), SkvqSettings(group_size=16, window=8, sink=2)))
    for path, kind, column in ((profile, "profile", "s_k"), (nuq, "nuq", "K codebook"), (skvq, "skvq", "K group sizes")):
        summary = summarize(path)
        assert summary.kind == kind and column in summary.columns and len(summary.rows) == 2
        assert dict(summary.provenance)["model"]
    with pytest.raises(KvcalError, match="is a kvcal nuq, expected a profile"):
        plot_profile(nuq, tmp_path / "x.png")
