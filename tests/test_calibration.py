"""kvcal.calibrate (kvcal.calibration): the main job as a Python call, and bundles built from a profile."""

import pytest

import kvcal
from kvcal import registry
from kvcal.calibration import build_bundle, export_fitted, fit_bundle
from kvcal.errors import KvcalError
from kvcal.methods.kivi import KiviSettings
from kvcal.methods.skvq import SkvqSettings


class Recorder:
    def __init__(self):
        self.stages, self.steps = [], 0

    def stage(self, label, total):
        self.stages.append((label, total))

    def advance(self):
        self.steps += 1


@pytest.mark.parametrize("recipe, bits, settings", [("kivi", 3, KiviSettings(bits=3)), ("skvq", None, SkvqSettings())])
def test_calibrate_returns_a_bundle_with_its_settings_and_reports_progress(tiny_model_dir, tiny_corpus, tmp_path, recipe, bits, settings):
    out = tmp_path / recipe / "bundle.safetensors"
    recorder = Recorder()
    path = kvcal.calibrate(str(tiny_model_dir("llama", head_dim=64)), dataset=str(tiny_corpus), recipe=recipe, bits=bits, nsamples=2, seqlen=48,
                           out=out, progress=recorder)
    assert path == out
    bundle = kvcal.load_bundle(path)
    assert bundle.recipe_name == recipe and bundle.settings == settings
    labels = [label for label, _ in recorder.stages]
    assert labels[0].startswith("1/3 profile") and labels[-1] == "3/3 export bundle"
    assert ("2/3 fit skvq", 2) in recorder.stages if recipe == "skvq" else all("2/3" not in label for label in labels)
    assert recorder.steps == 2 + (2 if recipe == "skvq" else 0)  # one per window, one per fitted layer


def test_calibrate_twice_gives_the_same_bytes(tiny_model_dir, tiny_corpus, tmp_path):
    model = str(tiny_model_dir("qwen2"))
    paths = [kvcal.calibrate(model, dataset=str(tiny_corpus), nsamples=2, seqlen=48, out=tmp_path / name / "bundle.safetensors")
             for name in ("a", "b")]
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_a_second_bundle_is_exported_from_the_first_ones_fit_without_fitting_again(tiny_profile, tmp_path, monkeypatch):
    """export_fitted reads the fitted artifact fit_bundle wrote into the folder: the same bundle, byte for byte, and
    the recipe's fit is not run again."""
    first = fit_bundle(tiny_profile[1], "kvquant", tmp_path / "bundle.safetensors")

    def refit(*args, **kwargs):
        raise AssertionError("fitted again")

    monkeypatch.setattr(registry.recipe("kvquant"), "fit", refit)
    second = export_fitted(tiny_profile[1], "kvquant", tmp_path / "bundle-again.safetensors")
    assert second.read_bytes() == first.read_bytes()


@pytest.mark.parametrize("recipe, bits, message", [("kivi", 5, "KIVI bits 5"), ("mixed", 1.5, "--bits 1.5 does not fit recipe mixed"),
                                                   ("kvmix", 2, "--bits does not apply to recipe kvmix"), ("kvquant", 0, "not a code width in 1-8"),
                                                   ("gptq", None, "unknown recipe 'gptq'")])
def test_settings_are_refused_before_any_model_is_loaded(tmp_path, recipe, bits, message):
    with pytest.raises(KvcalError, match=message):
        kvcal.calibrate("/no/such/model", recipe=recipe, bits=bits, out=tmp_path / "bundle.safetensors")
    assert not any(tmp_path.iterdir())


def test_a_fit_refused_after_profiling_keeps_the_profile_and_names_the_command_to_go_on(tiny_model_dir, tiny_corpus,
                                                                                      tmp_path):
    """calibrate's skvq recipe groups 64 channels, wider than the tiny Llama's KV width (32), which only its profile
    tells: the refusal keeps the profile and names the command that takes another group; no bundle is written."""
    out = tmp_path / "bundle.safetensors"
    with pytest.raises(KvcalError, match=r"wider than the KV width 32 .* \(the profile is kept: .*profile\.safetensors; "
                                         r"fit it with kvcal fit-skvq and that option, then kvcal export bundle\)"):
        kvcal.calibrate(str(tiny_model_dir("llama")), dataset=str(tiny_corpus), recipe="skvq", nsamples=2, seqlen=48,
                        out=out)
    assert not out.exists() and (tmp_path / "profile.safetensors").exists()


def test_a_fit_refused_over_an_earlier_run_leaves_its_artifacts_as_they_were(tiny_model_dir, tiny_corpus, tmp_path):
    """A second calibrate into the folder of a first, whose skvq fit is refused after profiling (its group is wider than
    the KV width): the first run's profile, fitted artifact and bundle keep their bytes; the new profile waits beside
    them as profile.new.safetensors. Once a fit succeeds there, it replaces the profile and nothing else is left."""
    model = str(tiny_model_dir("llama", head_dim=64))
    out = tmp_path / "bundle.safetensors"
    kvcal.calibrate(model, dataset=str(tiny_corpus), recipe="skvq", nsamples=2, seqlen=48, out=out)
    earlier = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(earlier) == ["bundle.safetensors", "profile.safetensors", "skvq.safetensors"]
    with pytest.raises(KvcalError, match=r"\(the profile is kept: .*profile\.new\.safetensors; the earlier artifacts beside "
                                         r"it are as they were; fit it with kvcal fit-skvq"):
        kvcal.calibrate(str(tiny_model_dir("llama")), dataset=str(tiny_corpus), recipe="skvq", nsamples=2, seqlen=48, out=out)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.name in earlier} == earlier
    assert (tmp_path / "profile.new.safetensors").exists()
    kvcal.calibrate(model, dataset=str(tiny_corpus), recipe="skvq", nsamples=3, seqlen=48, out=out)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(earlier)
    assert (tmp_path / "profile.safetensors").read_bytes() != earlier["profile.safetensors"]


def test_a_fitted_artifact_of_another_profile_of_the_same_model_is_refused(tiny_profile, fitted, tiny_corpus, tmp_path):
    """Codebooks fitted from one profile, bundled with another's importance and provenance, would be a bundle of
    neither: the two profiles' calibration records differ (here its seed), and the refusal names where."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    model, _ = tiny_profile
    other = tmp_path / "other.safetensors"
    made = CliRunner().invoke(app, ["profile-gradients", "--model", str(model), "--dataset", str(tiny_corpus), "--nsamples",
                                    "4", "--seqlen", "64", "--max-tokens-per-layer", "200", "--seed", "1", "--out", str(other)])
    assert made.exit_code == 0, made.output
    with pytest.raises(KvcalError, match=r"was fitted from another profile than .*other\.safetensors' \(calibration seed 0, "
                                         r"not 1\); fit it from this profile"):
        build_bundle(str(other), "kvquant", str(fitted["nuq"]))


def test_a_recipe_needs_its_artifact_of_the_right_kind(tiny_profile, fitted):
    _, profile = tiny_profile
    with pytest.raises(KvcalError, match=r"recipe kvquant needs --nuq \(from kvcal fit-nuq\)"):
        build_bundle(str(profile), "kvquant")
    with pytest.raises(KvcalError, match="without per-layer widths"):
        build_bundle(str(profile), "kvquant", str(fitted["nuq-kvmix"]))
    with pytest.raises(KvcalError, match="is a kvcal nuq, expected a skvq"):
        build_bundle(str(profile), "skvq", str(fitted["nuq"]))
