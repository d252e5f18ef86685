"""benchmarks.common: the recipes' bundles the benchmarks share."""

from benchmarks.common import ensure_bundles
from kvcal.bundle import load_bundle


def test_missing_bundles_are_fit_from_the_profile_and_present_ones_kept(tiny_profile, tmp_path):
    folder = tmp_path / "bundles"
    folder.mkdir()
    (folder / "kivi.safetensors").write_bytes(b"kept as it is")
    paths = ensure_bundles(folder, ["kivi", "kvmix"], tiny_profile[1])
    assert paths == {"kivi": folder / "kivi.safetensors", "kvmix": folder / "kvmix.safetensors"}
    assert paths["kivi"].read_bytes() == b"kept as it is"
    assert load_bundle(paths["kvmix"]).recipe_name == "kvmix"
    assert not (folder / "profile.safetensors").exists()  # the given profile is fit from, not copied
