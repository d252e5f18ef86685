"""`kvcal export vllm`: calibrated FP8 KV-cache scales written as a compressed-tensors model folder for vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers.tiny_bundles import profile_tiny_model
from kvcal.cli import app
from kvcal.export.fp8 import Fp8KvScales, fp8_fake_quantize
from kvcal.export.vllm import EXPORT_MARKER, read_export
from kvcal.version import transformers_from

STRATEGIES = ("tensor", "attn_head")


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def export(profile: Path, model: Path, out: Path, strategy: str = "tensor"):
    return run("export", "vllm", "--profile", profile, "--model", model, "--strategy", strategy, "--out", out)


def refused(result, message: str) -> None:
    """Exit 2 with one error line naming the problem (the last line of stderr; anything before it is a
    plain progress line such as "export vllm: loading model ..."), never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert all(line.startswith("export vllm: ") for line in lines[:-1]), result.stderr


def leftovers(folder: Path) -> list[str]:
    """Temp folders an interrupted or refused export could leave beside --out."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old")))


@pytest.fixture(scope="module")
def exports(tiny_profile, tmp_path_factory):
    """{strategy: (folder, the CLI's standard output)} of the tiny Llama's profile."""
    model, profile = tiny_profile
    folder = tmp_path_factory.mktemp("vllm-exports")
    made = {}
    for strategy in STRATEGIES:
        result = export(profile, model, folder / strategy, strategy)
        assert result.exit_code == 0, result.output
        made[strategy] = (folder / strategy, result.stdout)
    return made


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def fingerprint(profile: Path) -> dict:
    from kvcal.artifacts import read_header

    return read_header(profile)[1]["model"]["fingerprint"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_config_parses_with_compressed_tensors(exports, strategy):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.utils.quantization_config import CompressedTensorsConfig

    folder, _ = exports[strategy]
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization_config"]
    parsed = QuantizationConfig.model_validate(quantization)
    scheme = parsed.kv_cache_scheme
    assert parsed.quant_method == "compressed-tensors"
    assert (scheme.num_bits, scheme.type, scheme.strategy, scheme.dynamic, scheme.symmetric) == (8, "float", strategy, False, True)
    assert parsed.config_groups == {}  # weights stay as they are: only the KV cache is quantized
    # vLLM's CompressedTensorsConfig.from_config indexes config["config_groups"] and reads "kv_cache_scheme"
    # (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py)
    assert "config_groups" in quantization and quantization["kv_cache_scheme"]["strategy"] in ("tensor", "attn_head")
    # transformers parses it through the same compressed-tensors class when loading the folder
    assert CompressedTensorsConfig.from_dict(config).quantization_config.kv_cache_scheme == scheme


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vllms_own_config_class_reads_the_folder(exports, strategy):
    """Where vLLM imports (its wheel with --no-deps and the pure-Python imports it needs; VLLM_TARGET_DEVICE=cpu): its
    CompressedTensorsConfig takes the folder's quantization config, its KV-cache method accepts the scheme, and its
    loader maps every scale the folder holds onto an attention layer's. Skipped where vLLM does not import."""
    pytest.importorskip("vllm.model_executor.model_loader.weight_utils", reason="vLLM is not importable here")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig, CompressedTensorsKVCacheMethod)
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    folder, _ = exports[strategy]
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = CompressedTensorsConfig.from_config(quantization).kv_cache_scheme
    CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(scheme)
    assert scheme["strategy"] == strategy
    scales = [name for name in safetensors_of(folder) if name.endswith("_scale")]
    attention = {name.replace("self_attn.", "self_attn.attn.") for name in scales}
    assert {maybe_remap_kv_scale_name(name, dict.fromkeys(attention)) for name in scales} == attention


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensor_names_and_shapes_are_what_vllm_loads(exports, tiny_profile, strategy):
    """The scale tensors vLLM expects, and nothing else beside the model's own weights.

    Sources read: vLLM vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py
    (CompressedTensorsKVCacheMethod.create_weights: k_scale / v_scale of num_kv_heads elements for
    "attn_head", the loader flattening the "[num_heads, 1, 1]" LLM-Compressor stores, and 1 element for
    "tensor"), vllm/model_executor/model_loader/weight_utils.py (maybe_remap_kv_scale_name maps
    "...self_attn.k_scale" to the attention layer's "...self_attn.attn.k_scale"), and compressed-tensors
    0.20.0 compressed_tensors/quantization/lifecycle/initialize.py (initialize_qparams: scale shape (1,)
    for tensor, (num_kv_heads, 1, 1) for attn_head, registered as k_scale / v_scale on the attention module).
    """
    model_dir, profile = tiny_profile
    folder, _ = exports[strategy]
    f = fingerprint(profile)
    shape = (1,) if strategy == "tensor" else (f["num_kv_heads"], 1, 1)
    expected = {f"model.layers.{i}.self_attn.{name}": shape for i in range(f["num_layers"]) for name in ("k_scale", "v_scale")}
    tensors = safetensors_of(folder)
    scales = {name: tuple(t.shape) for name, t in tensors.items() if name.endswith("_scale")}
    assert scales == expected
    assert all(tensors[name].dtype == torch.float32 for name in expected)
    assert all(bool((tensors[name] > 0).all()) and bool(torch.isfinite(tensors[name]).all()) for name in expected)
    weights = {name: t for name, t in tensors.items() if name not in expected}
    original = safetensors_of(model_dir)
    assert weights.keys() == original.keys()
    assert all(torch.equal(weights[name], original[name]) for name in original)
    assert (folder / "tokenizer.json").is_file() and (folder / EXPORT_MARKER).is_file()


def test_folder_has_normal_permissions(exports):
    import os

    mask = os.umask(0)
    os.umask(mask)
    folder, _ = exports["tensor"]
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
    assert all(path.stat().st_mode & 0o777 == 0o666 & ~mask for path in folder.iterdir())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_transformers_with_compressed_tensors_loads_the_scales(exports, strategy):
    """compressed-tensors registers k_scale / v_scale on each attention module from the config, and the
    folder's tensors must fill exactly those: no missing, unexpected or mismatched keys. From transformers 5.24 on,
    compressed-tensors (0.20.1, its newest) registers none: it finds attention modules by their forward's
    `past_key_values` argument, which 5.24 renamed `cache`; there every other tensor must load and the scales alone be
    left over (once a compressed-tensors release finds the modules again, this fails, and the exception must go)."""
    from transformers import AutoModelForCausalLM

    folder, _ = exports[strategy]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    tensors = safetensors_of(folder)
    if transformers_from(5, 24):
        scales = {name for name in tensors if name.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
        assert len(scales) == 4 and info["unexpected_keys"] == scales, info
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        pytest.xfail("compressed-tensors finds no attention module in transformers 5.24 and later")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for i, layer in enumerate(model.model.layers):
        for name in ("k_scale", "v_scale"):
            loaded = getattr(layer.self_attn, name)
            assert torch.equal(loaded.float(), tensors[f"model.layers.{i}.self_attn.{name}"])


def reference_errors(profile: Path, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> float:
    """Attention-output MSE of one layer on the stored windows with K (post-RoPE) and V fake-quantized,
    computed independently of kvcal.export.scales' objective (sdpa, explicit GQA)."""
    from kvcal.artifacts import read_artifact
    from kvcal.rope import rotate_keys

    tensors, config = read_artifact(profile, "profile")
    f = config["model"]["fingerprint"]
    heads, kv_heads, head_dim = f["num_heads"], f["num_kv_heads"], f["head_dim"]
    total = 0.0
    for w, positions in enumerate(tensors["windows.positions"].long()):
        def split(x, n):
            return x.view(x.shape[0], n, head_dim).transpose(0, 1)

        q = rotate_keys(tensors[f"layers.{layer}.windows.q"][w].float(), positions, heads, tensors["rope.inv_freq"])
        k = rotate_keys(tensors[f"layers.{layer}.windows.k"][w].float(), positions, kv_heads, tensors["rope.inv_freq"])
        v = tensors[f"layers.{layer}.windows.v"][w].float()

        def attend(keys, values):
            keys = split(keys, kv_heads).repeat_interleave(heads // kv_heads, 0)
            values = split(values, kv_heads).repeat_interleave(heads // kv_heads, 0)
            return torch.nn.functional.scaled_dot_product_attention(split(q, heads), keys, values, is_causal=True)

        total += float((attend(fp8_fake_quantize(k, k_scale), fp8_fake_quantize(v, v_scale)) - attend(k, v)).square().mean())
    return total


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_calibrated_scales_beat_absmax_on_the_stored_windows(exports, tiny_profile, strategy):
    _, profile = tiny_profile
    folder, _ = exports[strategy]
    fit = read_export(folder)
    calibrated = [reference_errors(profile, i, layer.k, layer.v) for i, layer in enumerate(fit.layers)]
    absmax = [reference_errors(profile, i, layer.k_absmax, layer.v_absmax) for i, layer in enumerate(fit.layers)]
    for cal, base in zip(calibrated, absmax):
        assert cal <= base * (1 + 1e-5)
    assert sum(calibrated) < sum(absmax)
    # the recorded errors are the same quantity (mean over heads instead of heads summed by sdpa's mean)
    for i, layer in enumerate(fit.layers):
        assert layer.error_calibrated == pytest.approx(calibrated[i], rel=1e-3)
        assert layer.error_absmax == pytest.approx(absmax[i], rel=1e-3)



def test_two_exports_are_byte_identical(exports, tiny_profile, tmp_path):
    model, profile = tiny_profile
    first, _ = exports["attn_head"]
    again = tmp_path / "again"
    assert export(profile, model, again, "attn_head").exit_code == 0
    names = sorted(p.name for p in first.glob("*.safetensors"))
    assert names == sorted(p.name for p in again.glob("*.safetensors"))
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes()
    assert (first / "config.json").read_bytes() == (again / "config.json").read_bytes()


def test_cli_prints_scales_and_error_reduction(exports, tiny_profile):
    _, output = exports["tensor"]
    num_layers = fingerprint(tiny_profile[1])["num_layers"]
    assert "K absmax/448" in output and "error calibrated" in output
    assert "lower" in output and "stored windows" in output
    rows = [line for line in output.splitlines() if line.startswith("│")]
    assert len(rows) == num_layers



@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inspect_prints_a_folders_scales_as_the_export_printed_them(exports, strategy):
    folder, printed = exports[strategy]
    result = run("inspect", folder)
    assert result.exit_code == 0, result.output
    assert result.stdout == printed


def test_inspect_refuses_a_folder_that_is_no_export_and_plot_or_device_on_one(exports, tmp_path):
    folder, _ = exports["tensor"]
    refused(run("inspect", tmp_path), "is a directory, not a kvcal artifact nor a vllm export (no kvcal_export.json)")
    refused(run("inspect", folder, "--device", "cpu"), "is a folder: --plot and --device take a profile or a bundle")
    refused(run("inspect", folder, "--plot", tmp_path / "x.png"), "is a folder: --plot and --device take a profile or a bundle")
    assert not (tmp_path / "x.png").exists()


def test_fp8_kv_scales_read_back(exports):
    folder, _ = exports["attn_head"]
    fit = read_export(folder)
    scales = Fp8KvScales.of_fit(fit)
    x = torch.randn(8, fit.layers[0].k.numel() * 16)
    assert torch.equal(scales.keys(0, x), fp8_fake_quantize(x, fit.layers[0].k))
    assert torch.equal(scales.values(1, x), fp8_fake_quantize(x, fit.layers[1].v))


def test_a_per_head_export_says_that_sglang_takes_per_layer_scales_only(exports):
    """SGLang serves the per-layer folder and ignores per-KV-head scales (scale 1.0): the export says so."""
    hint = "SGLang reads per-layer scales only"
    assert hint in exports["attn_head"][1] and hint not in exports["tensor"][1]

def test_profile_without_windows_falls_back_to_absmax(tiny_profile, tiny_corpus, tmp_path):
    from kvcal.artifacts import read_artifact

    model, _ = tiny_profile
    profile = tmp_path / "no-windows.safetensors"
    made = run("profile-gradients", "--model", model, "--dataset", tiny_corpus, "--nsamples", "2", "--seqlen", "64",
               "--max-tokens-per-layer", "100", "--store-windows", "0", "--out", profile)
    assert made.exit_code == 0, made.output
    result = export(profile, model, tmp_path / "out", "attn_head")
    assert result.exit_code == 0, result.output
    assert "no stored windows" in result.output
    shown = run("inspect", tmp_path / "out")  # what it holds, as the export printed it: absmax / 448, not calibrated
    assert "scales for vLLM (absmax / 448, attn_head)" in shown.stdout and shown.stdout in result.output
    fit = read_export(tmp_path / "out")
    assert fit.source == "statistics"
    tensors, _ = read_artifact(profile, "profile")
    for i, layer in enumerate(fit.layers):
        expected_k = tensors[f"layers.{i}.k_post.absmax"].view(2, -1).amax(1) / 448
        assert torch.allclose(layer.k, expected_k) and torch.equal(layer.k, layer.k_absmax)
        assert layer.error_calibrated is None


@pytest.fixture(scope="module")
def absmax_exports(tiny_profile, tmp_path_factory):
    """{strategy: folder} of `--scales absmax` exports of the tiny Llama's profile."""
    model, profile = tiny_profile
    folder = tmp_path_factory.mktemp("vllm-absmax")
    for strategy in STRATEGIES:
        result = run("export", "vllm", "--profile", profile, "--model", model, "--strategy", strategy, "--scales", "absmax",
                     "--out", folder / strategy)
        assert result.exit_code == 0, result.output
        assert "not searched" in result.output
    return {strategy: folder / strategy for strategy in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_absmax_export_writes_the_scales_the_search_starts_from(absmax_exports, exports, strategy):
    absmax, calibrated = read_export(absmax_exports[strategy]), read_export(exports[strategy][0])
    assert (absmax.scales, absmax.strategy, calibrated.scales) == ("absmax", strategy, "calibrated")
    assert absmax.fingerprint == calibrated.fingerprint
    for plain, searched in zip(absmax.layers, calibrated.layers):
        assert torch.equal(plain.k, plain.k_absmax) and torch.equal(plain.v, plain.v_absmax)
        assert torch.equal(plain.k, searched.k_absmax) and torch.equal(plain.v, searched.v_absmax)
        assert plain.error_absmax == pytest.approx(searched.error_absmax) and plain.error_calibrated is None
    assert any(not torch.equal(plain.k, searched.k) for plain, searched in zip(absmax.layers, calibrated.layers))


def ppl_rows(result, json_path: Path) -> dict[str, dict]:
    assert result.exit_code == 0, result.output
    return {row["method"]: row for row in json.loads(json_path.read_text())["results"]}


def test_eval_ppl_takes_the_fp8_baseline_and_export_folders(exports, absmax_exports, tiny_profile, tiny_corpus, tmp_path):
    """Scale 1.0, absmax and calibrated scales, per tensor and per head, on the same windows: 8 bits stored per
    element (the scales are per-layer constants), the fp8 quantizer of each folder's own scales."""
    model, _ = tiny_profile
    folders = [absmax_exports["tensor"], absmax_exports["attn_head"], exports["tensor"][0], exports["attn_head"][0]]
    args = [arg for folder in folders for arg in ("--quant", folder)]
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2, *args,
                 "--baseline", "fp8", "--json", tmp_path / "ppl.json")
    rows = ppl_rows(result, tmp_path / "ppl.json")
    names = ["fp8 absmax tensor", "fp8 absmax attn_head", "fp8 calibrated tensor", "fp8 calibrated attn_head", "fp8 scale 1.0"]
    assert list(rows) == ["fp", *names]
    for name in names:
        assert (rows[name]["effective_bits"], rows[name]["key_bits"], rows[name]["value_bits"], rows[name]["outlier_fraction"]) == (8, 8, 8, 0)
        assert rows[name]["ppl"] != rows["fp"]["ppl"]
    assert "fp8 scale 1.0" in result.stdout


@pytest.mark.parametrize("model_type", ["gemma3", "mistral3"])
def test_a_decoder_beside_a_vision_tower_exports_under_the_checkpoints_names(model_type, tiny_model_dir, tiny_corpus, tmp_path):
    """Gemma 3 4B-27B's and Mistral 3's decoder is model.language_model.layers.N in the module tree, which
    save_pretrained writes as the checkpoint's language_model.model.layers.N (what vLLM loads): the scales are
    written there, and the marker names them there, so that eval ppl reads the folder back."""
    model = tiny_model_dir(model_type)
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export").exit_code == 0
    scales = sorted(name for name in safetensors_of(tmp_path / "export") if name.endswith("_scale"))
    assert scales == [f"language_model.model.layers.{i}.self_attn.{kind}_scale" for i in range(2) for kind in "kv"]
    assert [layer.k.numel() for layer in read_export(tmp_path / "export").layers] == [1, 1]
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 1, "--quant",
                 tmp_path / "export", "--json", tmp_path / "ppl.json")
    assert ppl_rows(result, tmp_path / "ppl.json")["fp8 calibrated tensor"]["effective_bits"] == 8


def test_a_llama4_checkpoint_exports_its_text_decoder_which_vllm_serves_as_text(tiny_model_dir, tiny_corpus, tmp_path):
    """kvcal loads a Llama 4 checkpoint (the decoder beside a vision tower) as its text decoder, Llama4ForCausalLM, a
    model vLLM serves for text: the folder is that model, its scales under its names, and eval ppl reads it back."""
    model = tiny_model_dir("llama4")
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export").exit_code == 0
    scales = sorted(name for name in safetensors_of(tmp_path / "export") if name.endswith("_scale"))
    assert scales == [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(2) for kind in "kv"]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 1, "--quant",
                 tmp_path / "export", "--json", tmp_path / "ppl.json")
    assert ppl_rows(result, tmp_path / "ppl.json")["fp8 calibrated tensor"]["effective_bits"] == 8


def test_a_hybrid_model_exports_the_scales_of_its_attention_layers_under_their_own_indices(tiny_model_dir, tiny_corpus,
                                                                                             tmp_path):
    """Qwen3.5's gated DeltaNet layers (decoder layers 0 and 2 here) hold no KV cache: the scales are those of decoder
    layers 1 and 3, and eval ppl reads them back, its cache keeping the DeltaNet layers' states beside them."""
    model = tiny_model_dir("qwen3_5_text")
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export").exit_code == 0
    scales = sorted(name for name in safetensors_of(tmp_path / "export") if name.endswith("_scale"))
    assert scales == [f"model.layers.{i}.self_attn.{kind}_scale" for i in (1, 3) for kind in "kv"]
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 1, "--quant",
                 tmp_path / "export", "--json", tmp_path / "ppl.json")
    assert ppl_rows(result, tmp_path / "ppl.json")["fp8 calibrated tensor"]["effective_bits"] == 8


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_moe_model_exports_its_experts_under_the_checkpoints_own_names(model_type, tiny_model_dir, tiny_corpus, tmp_path):
    """transformers loads experts fused (one experts.gate_up_proj a layer); vLLM's MoE loaders read the checkpoint's
    names, one tensor per expert and projection: save_pretrained writes them back so, each tensor as it was. (transformers
    5.25 itself does not load such a folder back: its MoE loader dequantizes the experts with the config group that
    quantizes them, and a KV-cache-only config has none, an IndexError in get_experts_scheme.)"""
    model = tiny_model_dir(model_type)
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export").exit_code == 0
    tensors = safetensors_of(tmp_path / "export")
    weights = {name: t for name, t in tensors.items() if not name.endswith(("k_scale", "v_scale"))}
    original = safetensors_of(model)
    assert any(".experts.0." in name for name in original)
    assert weights.keys() == original.keys()
    assert all(torch.equal(weights[name], original[name]) for name in original)
    assert len(tensors) - len(weights) == 4


def test_scale_one_saturates_what_absmax_keeps(tiny_model_dir, tiny_corpus, tmp_path):
    """A model whose K and V are scaled up 10^4 (q and o scaled down: the same function) has K/V far beyond
    448: vLLM's default scale 1.0 saturates them and the perplexity moves; absmax / 448 holds them."""
    from safetensors.torch import load_file, save_file

    model = tiny_model_dir("llama")
    weights = load_file(str(model / "model.safetensors"))
    for name in list(weights):
        factor = {"k_proj": 1e4, "v_proj": 1e4, "q_proj": 1e-4, "o_proj": 1e-4}.get(name.split(".")[-2], 1.0)
        weights[name] = weights[name] * factor
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    profile = tmp_path / "profile.safetensors"
    made = run("profile-gradients", "--model", model, "--dataset", tiny_corpus, "--nsamples", 2, "--seqlen", 64,
               "--max-tokens-per-layer", 100, "--out", profile)
    assert made.exit_code == 0, made.output
    assert run("export", "vllm", "--profile", profile, "--model", model, "--scales", "absmax", "--out", tmp_path / "absmax").exit_code == 0
    assert all(float(layer.v) > 1 for layer in read_export(tmp_path / "absmax").layers)  # |V| > 448
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2,
                 "--quant", tmp_path / "absmax", "--baseline", "fp8", "--json", tmp_path / "ppl.json")
    rows = ppl_rows(result, tmp_path / "ppl.json")
    unit, absmax = abs(rows["fp8 scale 1.0"]["delta_pct"]), abs(rows["fp8 absmax tensor"]["delta_pct"])
    assert unit > 10 * absmax, rows


def test_kvcal_methods_lists_fp8():
    result = run("methods")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("│ fp8 "))
    assert "fp8 (vLLM's default scale 1.0)" in row and "kvcal export vllm" in row


def test_eval_ppl_refuses_a_folder_that_is_no_export(tiny_profile, tmp_path):
    model, _ = tiny_profile
    refused(run("eval", "ppl", "--model", model, "--quant", model), "a directory that no kvcal method wrote")
    refused(run("eval", "ppl", "--model", model, "--baseline", "fp8-e5m2"), "fp8 (vLLM's default scale 1.0)")


def test_eval_ppl_refuses_an_export_of_another_model(exports, tiny_model_dir):
    refused(run("eval", "ppl", "--model", tiny_model_dir("qwen2"), "--quant", exports["tensor"][0]), "was made for")


def tampered(folder: Path, tmp_path: Path, scale=None, marker=None, config=None) -> Path:
    """A copy of an export with layer 0's k_scale replaced and/or its marker or config.json edited."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "tampered"
    shutil.copytree(folder, copy)
    if scale is not None:
        weights = load_file(str(copy / "model.safetensors"))
        weights["model.layers.0.self_attn.k_scale"] = scale
        save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    for edit, path in ((marker, copy / EXPORT_MARKER), (config, copy / "config.json")):
        if edit is not None:
            path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return copy


def with_scheme(**fields):
    def edit(config):
        quantization = config["quantization_config"]
        return {**config, "quantization_config": {**quantization, "kv_cache_scheme": {**quantization["kv_cache_scheme"], **fields}}}
    return edit


def without(key: str):
    return lambda marker: {k: v for k, v in marker.items() if k != key}


def with_entry(**fields):
    """A marker edit: layer 0's entry with `fields` set."""
    return lambda marker: {**marker, "layers": [{**marker["layers"][0], **fields}, *marker["layers"][1:]]}


@pytest.mark.parametrize("strategy, scale, marker, message", [
    ("tensor", torch.tensor([0.0]), None, "layer 0 k_scale is not finite and positive"),
    ("tensor", torch.tensor([float("nan")]), None, "layer 0 k_scale is not finite and positive"),
    ("tensor", torch.tensor([0.5, 0.5]), None, "layer 0 k_scale has 2 elements, strategy tensor takes 1"),
    ("attn_head", torch.ones(1, 1, 1), None, "layer 0 k_scale has 1 elements, strategy attn_head takes 2"),
    ("tensor", None, without("fingerprint"), "malformed"),
    ("tensor", None, without("scales"), "malformed"),
    ("tensor", None, lambda m: {**m, "layers": m["layers"][:1]}, "1 layers for a model of 2"),
    ("tensor", None, lambda m: {**m, "strategy": "channel"}, "strategy 'channel'"),
    ("tensor", None, lambda m: [m], "malformed kvcal_export.json (TypeError"),
    ("tensor", None, lambda m: {**m, "fingerprint": without("num_kv_heads")(m["fingerprint"])}, "(KeyError('num_kv_heads')"),
    ("tensor", None, lambda m: {**m, "layers": [m["layers"][0]] * 2}, "its layers do not name one attention module each"),
    ("tensor", None, with_entry(k_absmax_scale=None), "malformed scale entry"),
    ("tensor", None, with_entry(error_calibrated=None), ", None] and kept_absmax 0, not numbers"),
    ("tensor", None, with_entry(error_absmax="abc"), "records errors ['abc'"),
    ("tensor", None, with_entry(kept_absmax="x"), "kept_absmax 'x', not numbers"),
])
def test_eval_ppl_and_inspect_refuse_a_tampered_export(exports, tiny_profile, tmp_path, strategy, scale, marker, message):
    model, _ = tiny_profile
    folder = tampered(exports[strategy][0], tmp_path, scale, marker)
    for result in (run("eval", "ppl", "--model", model, "--quant", folder), run("inspect", folder)):
        refused(result, message)
        assert "re-export it" in result.stderr


@pytest.mark.parametrize("damage", [lambda data: data[:5000], lambda data: b"garbage"])
def test_eval_ppl_and_inspect_refuse_an_export_whose_weights_file_is_damaged(exports, tiny_profile, tmp_path, damage):
    model, _ = tiny_profile
    folder = tampered(exports["tensor"][0], tmp_path)
    (folder / "model.safetensors").write_bytes(damage((folder / "model.safetensors").read_bytes()))
    for result in (run("eval", "ppl", "--model", model, "--quant", folder), run("inspect", folder)):
        refused(result, "model.safetensors' is truncated or not a safetensors file")


def test_inspect_says_an_unreadable_marker_is_malformed_not_missing(exports, tmp_path):
    folder = tampered(exports["tensor"][0], tmp_path)
    (folder / EXPORT_MARKER).write_text((folder / EXPORT_MARKER).read_text()[:300])
    refused(run("inspect", folder), "has a malformed kvcal_export.json (JSONDecodeError")


@pytest.mark.parametrize("strategy, config, message", [
    ("tensor", with_scheme(strategy="attn_head"), "'strategy': 'attn_head', 'symmetric': True, 'type': 'float'} is not the tensor"),
    ("attn_head", with_scheme(num_bits=4), "is not the attn_head scheme"),
    ("tensor", lambda config: {k: v for k, v in config.items() if k != "quantization_config"}, "no config.json with a kv_cache_scheme"),
])
def test_eval_ppl_refuses_an_export_whose_config_says_other_scales_than_it_holds(exports, tiny_profile, tmp_path, strategy,
                                                                                 config, message):
    """What vLLM and SGLang read is config.json's scheme: one edited after the export is refused, not evaluated as
    the scales the marker records."""
    model, _ = tiny_profile
    folder = tampered(exports[strategy][0], tmp_path, config=config)
    result = run("eval", "ppl", "--model", model, "--quant", folder)
    refused(result, message)
    assert "re-export it" in result.stderr


def test_refuses_unknown_scales(tiny_profile, tmp_path):
    model, profile = tiny_profile
    refused(run("export", "vllm", "--profile", profile, "--model", model, "--scales", "mse", "--out", tmp_path / "out"), "--scales")
    assert not (tmp_path / "out").exists()


def test_refuses_an_out_that_is_a_file(tiny_profile, tmp_path):
    model, profile = tiny_profile
    out = tmp_path / "model"
    out.write_text("keep me")
    result = export(profile, model, out)
    refused(result, "exists and is not a directory")
    assert len(result.stderr.strip().splitlines()) == 1  # refused before the model is loaded
    assert out.read_text() == "keep me" and not leftovers(tmp_path)


def test_refuses_a_non_empty_folder_that_is_not_an_export(tiny_profile, tmp_path):
    model, profile = tiny_profile
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = export(profile, model, out)
    refused(result, "not a kvcal vllm export")
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and not leftovers(tmp_path)
    # an export's marker alone does not make a folder of other files an export to replace
    (out / EXPORT_MARKER).write_text(json.dumps({"kind": "vllm-fp8-kv-scales"}))
    refused(export(profile, model, out), "not a kvcal vllm export")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "notes.txt"] and not leftovers(tmp_path)


def test_refuses_the_model_folder_and_a_folder_holding_the_profile(tiny_profile, tmp_path):
    model, profile = tiny_profile
    before = sorted(p.name for p in model.iterdir())
    refused(export(profile, model, model), "is or contains the input")
    assert sorted(p.name for p in model.iterdir()) == before
    refused(export(profile, model, profile.parent), "is or contains the input")


def test_refuses_a_profile_of_another_model(tiny_profile, tiny_model_dir, tmp_path):
    _, profile = tiny_profile
    other = tiny_model_dir("qwen2")
    refused(export(profile, other, tmp_path / "out"), "was made for")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_refuses_bad_strategy_and_non_profile(tiny_profile, tmp_path):
    from kvcal.artifacts import write_artifact

    model, profile = tiny_profile
    refused(export(profile, model, tmp_path / "out", "channel"), "--strategy")
    other = write_artifact(tmp_path / "nuq.safetensors", {"x": torch.zeros(1)}, "nuq", {})
    refused(export(other, model, tmp_path / "out"), "expected a profile")
    assert not (tmp_path / "out").exists()


def test_replaces_an_empty_folder_and_a_previous_export(tiny_profile, tmp_path):
    model, profile = tiny_profile
    out = tmp_path / "model"
    out.mkdir()
    assert export(profile, model, out, "tensor").exit_code == 0
    assert read_export(out).strategy == "tensor"
    assert export(profile, model, out, "attn_head").exit_code == 0
    assert read_export(out).strategy == "attn_head" and not leftovers(tmp_path)


def test_values_narrower_than_keys_and_a_value_scale_attribute_export(tiny_model_dir, tiny_corpus, tmp_path):
    """MiMo-V2-Flash: its values are 16 channels a KV head beside keys of 32, and its attention holds its value scale
    as a plain attribute named v_scale, the name vLLM's FP8 scale takes in the checkpoint: the scales are fitted over
    values at their width and written under that name (the attribute set aside while saving), and eval ppl reads the
    folder back."""
    model = tiny_model_dir("mimo_v2_flash")
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export").exit_code == 0
    scales = sorted(name for name in safetensors_of(tmp_path / "export") if name.endswith("_scale"))
    assert scales == [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(2) for kind in "kv"]
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 1, "--quant",
                 tmp_path / "export", "--json", tmp_path / "ppl.json")
    assert ppl_rows(result, tmp_path / "ppl.json")["fp8 calibrated tensor"]["effective_bits"] == 8


def test_layers_of_their_own_query_heads_export_per_head_scales(tiny_model_dir, tiny_corpus, tmp_path):
    """Laguna: twice the query heads on its sliding layer as on its full one, over 2 KV heads each: per KV head
    scales are fitted on each layer's own query heads, written one per KV head, and eval ppl reads the folder back."""
    model = tiny_model_dir("laguna")
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    assert export(profile, model, tmp_path / "export", "attn_head").exit_code == 0
    tensors = safetensors_of(tmp_path / "export")
    assert [tuple(tensors[f"model.layers.{i}.self_attn.k_scale"].shape) for i in range(2)] == [(2, 1, 1)] * 2
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 1, "--quant",
                 tmp_path / "export", "--json", tmp_path / "ppl.json")
    assert ppl_rows(result, tmp_path / "ppl.json")["fp8 calibrated attn_head"]["effective_bits"] == 8
