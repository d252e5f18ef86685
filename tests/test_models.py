import pytest

from kvcal.errors import KvcalError
from kvcal.models import default_model_gguf, resolve_model


def test_default_model_is_the_packaged_smollm2_gguf():
    source = resolve_model(None)
    assert source.gguf_file == default_model_gguf().name and source.gguf_file.endswith(".gguf")
    assert source.name == "SmolLM2-135M-Instruct"


def test_local_paths_hub_ids_and_missing_paths(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m")).path == str(tmp_path / "m")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M").path == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(KvcalError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(KvcalError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(KvcalError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
