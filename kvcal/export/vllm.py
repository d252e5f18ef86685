"""`kvcal export vllm`: calibrated FP8 (e4m3) KV-cache scales for vLLM, written as a compressed-tensors model folder,
and read back.

vLLM reads calibrated KV-cache quantization only as FP8 scales, one per layer for K and one for V
(`strategy: tensor`) or one per KV head (`strategy: attn_head`); without them it uses scale 1.0. It stores
each token's key and value once, as `fp8_e4m3(x / scale)` saturated at +-448, and reads `fp8 * scale`.
The key it stores is the POST-RoPE key, so scales are searched on post-RoPE keys.

Scales come from a kvcal profile, searched on its stored windows (kvcal.export.scales); `--scales absmax` writes
the absmax / 448 starting scales, the baseline the calibrated ones are measured against (`kvcal eval ppl --quant
<folder>` evaluates either).

The output folder is what vLLM and compressed-tensors load: the model's own weights (save_pretrained),
the tokenizer, `config.json` with a compressed-tensors `quantization_config` whose `kv_cache_scheme` is
`{num_bits: 8, type: float, strategy, dynamic: false, symmetric: true}`, and in `model.safetensors` the
tensors `model.layers.{i}.self_attn.k_scale` / `v_scale`, float32, shape [1] (tensor) or
[num_kv_heads, 1, 1] (attn_head). Names, shapes and required fields were read from:
- vLLM `vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py`:
  `CompressedTensorsConfig.from_config` indexes `config["config_groups"]` (so it must be present, may be
  empty) and takes `kv_cache_scheme`; `CompressedTensorsKVCacheMethod.validate_kv_cache_scheme` accepts
  type float / 8 bits, strategy "tensor" or "attn_head", symmetric; `create_weights` makes `k_scale` /
  `v_scale` of `num_kv_heads` elements for attn_head (its loader flattens "[num_heads, 1, 1]" as
  LLM-Compressor stores them) and of 1 element otherwise;
- vLLM `vllm/model_executor/model_loader/weight_utils.py` `maybe_remap_kv_scale_name`: a checkpoint
  `...self_attn.k_scale` loads into the attention layer's `...self_attn.attn.k_scale` (as called from
  `vllm/model_executor/models/llama.py` `load_weights` for names containing "scale");
- compressed-tensors 0.20.0 `compressed_tensors/quantization/quant_config.py` (`QuantizationConfig`:
  `config_groups` required, `kv_cache_scheme`, `format`, `quantization_status`, `ignore`),
  `quantization/quant_args.py` (`QuantizationArgs`, extra fields forbidden; strategies "tensor",
  "attn_head") and `quantization/lifecycle/initialize.py` (`initialize_qparams`: scale shape (1,) for
  tensor, (num_kv_heads, 1, 1) for attn_head, registered as `k_scale` / `v_scale` on the attention module).

SGLang (0.5.23, read in its source, not run here) serves the same folder with per-layer scales:
`sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py` reads `config_groups` with a default
(none: linear layers stay unquantized) and gives RadixAttention a KV-cache method only where `is_supported_scheme`
holds (float, 8 bits, strategy "tensor", static, symmetric); it then turns the cache to fp8 e4m3 also under
`--kv-cache-dtype auto`; `model_loader/weight_utils.py` `maybe_remap_kv_scale_name` maps `self_attn.k_scale` to
`self_attn.attn.k_scale` as vLLM's does; `layers/quantization/kv_cache.py` takes one scale per layer. Per-KV-head
scales fail that check: SGLang logs that it ignores the scheme and keeps scale 1.0.

kvcal.export.fp8 is the same quantize-dequantize, for simulation.
Not modelled: the query quantization some vLLM attention backends add with an fp8 cache (no `q_scale` is
written, so vLLM keeps its default 1.0), ROCm's e4m3fnuz format, and rounding of the keys to the serving
dtype before they are quantized.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from kvcal.adapters import adapt, kv_shapes
from kvcal.artifacts import check_same_model, read_header, verify_artifact
from kvcal.errors import KvcalError
from kvcal.export.compressed_tensors import SCALE_NAMES, kv_cache_scheme, quantization_config, scale_tensors
from kvcal.export.folder import check_out_folder, write_folder_atomically
from kvcal.export.scales import SCALE_CHOICES, STRATEGIES, LayerScales, ScaleFit, calibrate_scales, check_scales, check_strategy
from kvcal.models import load_model, reading_files, resolve_model
from kvcal.version import __version__

EXPORT_MARKER = "kvcal_export.json"
EXPORT_KIND = "vllm-fp8-kv-scales"


def _marker(fit: ScaleFit, profile: Path, model_spec: str, names: list[str]) -> dict:
    return {
        "kind": EXPORT_KIND,
        "kvcal_version": __version__,
        "model": model_spec,
        "profile": str(profile),
        "strategy": fit.strategy,
        "source": fit.source,
        "scales": fit.scales,
        "fingerprint": fit.fingerprint,
        "note": fit.note,
        "layers": [
            {"attention": name, "k_scale": layer.k.tolist(), "v_scale": layer.v.tolist(),
             "k_absmax_scale": layer.k_absmax.tolist(), "v_absmax_scale": layer.v_absmax.tolist(),
             "error_absmax": layer.error_absmax, "error_calibrated": layer.error_calibrated, "kept_absmax": layer.kept_absmax}
            for name, layer in zip(names, fit.layers)
        ],
    }


def holds_export_marker(folder: Path) -> bool:
    """Whether `folder` holds an export's marker file, readable or not (read_export says which)."""
    return (folder / EXPORT_MARKER).is_file()


def is_previous_export(folder: Path) -> bool:
    """Whether `folder` is an export that a new one may replace: its marker of this kind beside the config.json and
    safetensors weights an export writes (a marker alone, copied into a folder of other files, is not one)."""
    marker = folder / EXPORT_MARKER
    try:
        return (holds_export_marker(folder) and json.loads(marker.read_text()).get("kind") == EXPORT_KIND
                and (folder / "config.json").is_file() and any(folder.glob("*.safetensors")))
    except (OSError, ValueError, AttributeError):
        return False


def _checkpoint_dtype(spec: str | None) -> str:
    """The dtype the model's own checkpoint declares (a saved folder or hub config), so that its weights
    are written back as they were; float32 for GGUF files (dequantized) or when none is declared."""
    source = resolve_model(spec)
    if source.gguf_file:
        return "float32"
    config_path = Path(source.path) / "config.json"
    declared = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
            declared = config.get("dtype") or config.get("torch_dtype")
        except (OSError, ValueError):
            declared = None
    else:
        try:
            with reading_files(source):
                declared = str(getattr(AutoConfig.from_pretrained(source.path), "dtype", "") or "").removeprefix("torch.")
        except (OSError, ValueError):
            declared = None
    return declared if declared in ("float32", "float16", "bfloat16") else "float32"


@contextmanager
def _saveable(model: torch.nn.Module):
    """Save the weights as they are loaded. A GGUF file loads dequantized into ordinary tensors, but
    transformers still marks the model as GGUF-quantized (and refuses save_pretrained, and would write the
    gguf quantization_config): the mark is detached while saving. Any other quantized model is refused."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        yield
        return
    method = getattr(quantizer.quantization_config, "quant_method", "?")
    method = str(getattr(method, "value", method))
    packed = [type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()]
    if method != "gguf" or getattr(quantizer, "packed_modules", None) or packed:
        raise KvcalError(f"--model is loaded quantized ({method}); kvcal export vllm writes the model's own weights and "
                         "needs them as plain tensors: pass a Hugging Face model folder, a hub id or a .gguf file")
    config = model.config
    previous = config.__dict__.get("quantization_config")
    model.hf_quantizer = None
    config.__dict__.pop("quantization_config", None)
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if previous is not None:
            config.quantization_config = previous


def _attention_names(model: torch.nn.Module, adapter) -> list[str]:
    by_module = {id(module): name for name, module in model.named_modules()}
    return [by_module[id(handles.attention)] for handles in adapter.layers]


def _checkpoint_names(folder: Path, names: list[str]) -> list[str]:
    """Each attention module's name in the checkpoint save_pretrained wrote to `folder`: its own, or for a decoder
    beside a vision tower, whose weights transformers writes under the checkpoint's names (Mistral 3's
    model.language_model.layers.N is language_model.model.layers.N there), the one written scale's name that ends as
    the module's does from its layer list on."""
    written = [key.removesuffix(".k_scale") for key in _scale_tensors(folder) if key.endswith(".k_scale")]
    found = []
    for name in names:
        parts = name.split(".")
        tails = (".".join(parts[i:]) for i in range(len(parts)))
        matches = next((hits for tail in tails if len(hits := [key for key in written if f".{key}".endswith(f".{tail}")]) == 1), None)
        if matches is None:
            raise KvcalError(f"save_pretrained wrote no single scale for attention '{name}' (wrote {len(written)}); "
                             "this model's checkpoint names are not ones kvcal can export to")
        found.append(matches[0])
    return found


def _scale_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every k_scale / v_scale tensor in the safetensors files of `folder`, by name; a file that is not one (truncated,
    overwritten) refused in one line."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    if key.endswith((".k_scale", ".v_scale")):
                        found[key] = handle.get_tensor(key)
        except (OSError, SafetensorError) as exc:
            raise KvcalError(f"'{path}' is truncated or not a safetensors file ({exc}); re-export the folder") from exc
    return found


def _save_folder(folder: Path, model, tokenizer, adapter, names: list[str], fit: ScaleFit, marker: dict) -> None:
    """save_pretrained with the scales registered as buffers on the attention modules (so they are written
    under the modules' own names), the tokenizer, quantization_config in config.json, the marker."""
    tensors = scale_tensors(fit, names)
    registered, shadowed = [], []  # shadowed: plain attributes of a scale's name (MiMo-V2-Flash's v_scale), set aside
    try:
        for handles, name in zip(adapter.layers, names):
            for suffix in SCALE_NAMES:
                if suffix in vars(handles.attention):
                    shadowed.append((handles.attention, suffix, vars(handles.attention).pop(suffix)))
                handles.attention.register_buffer(suffix, tensors[f"{name}.{suffix}"].clone(), persistent=True)
                registered.append((handles.attention, suffix))
        with _saveable(model):
            model.save_pretrained(folder)
    finally:
        for module, suffix in registered:
            del module._buffers[suffix]
        for module, suffix, value in shadowed:
            setattr(module, suffix, value)
    for entry, name in zip(marker["layers"], _checkpoint_names(folder, names)):
        entry["attention"] = name  # where vLLM and read_export find its scales
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(fit.strategy)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def export_vllm(profile: str | Path, model: str | None, strategy: str, out: str | Path,
                on_stage: Callable[[str, int | None], None] | None = None,
                on_layer: Callable[[int], None] | None = None, scales: str = "calibrated") -> tuple[Path, ScaleFit, dict]:
    """Check everything, load the model, check it is the profile's, fit the scales (or take absmax / 448 with
    scales="absmax"), write the folder. Returns (folder, fit, marker). on_stage(description, total) marks each
    stage (total: layers or None)."""
    stage = on_stage or (lambda description, total: None)
    check_strategy(strategy)
    check_scales(scales)
    profile = Path(profile)
    kind, profile_config = read_header(profile)
    if kind != "profile":
        raise KvcalError(f"'{profile}' is a kvcal {kind}, expected a profile from kvcal profile-gradients")
    verify_artifact(profile)  # (a corrupt profile refused before the model loads)
    source = resolve_model(model)
    inputs = [profile] + ([Path(source.path)] if Path(source.path).exists() else [])
    out = check_out_folder(out, inputs, is_previous_export, "kvcal vllm export")
    stage("loading model", None)
    loaded, tokenizer, source = load_model(model, dtype=_checkpoint_dtype(model))
    adapter = adapt(loaded)
    adapter.refuse_latent("kvcal export vllm")
    with _saveable(loaded):  # refuse a model whose weights cannot be written back before the long search
        pass
    check_same_model(profile_config["model"]["fingerprint"], adapter.fingerprint(), f"profile '{profile}'",
                     f"--model {source.spec}", "profile this model or pass the matching --model")
    stage("fitting scales" if scales == "calibrated" else "absmax scales", len(adapter.layers))
    fit, _ = calibrate_scales(profile, strategy, on_layer, scales)
    names = _attention_names(loaded, adapter)
    marker = _marker(fit, profile, source.spec, names)
    stage("writing model folder", None)
    path = write_folder_atomically(out, lambda folder: _save_folder(folder, loaded, tokenizer, adapter, names, fit, marker))
    return path, fit, marker


def read_export(folder: str | Path) -> ScaleFit:
    """The scales of an exported folder, read back from its safetensors files and checked against the marker:
    one entry per layer of the model it records, each K and V scale finite and positive, of 1 element
    (tensor) or one per KV head (attn_head)."""
    folder = Path(folder)
    if not holds_export_marker(folder):
        raise KvcalError(f"'{folder}' is not a kvcal vllm export (no {EXPORT_MARKER}); pass a folder written by kvcal export vllm")
    try:
        marker = json.loads((folder / EXPORT_MARKER).read_text())
        if marker["kind"] != EXPORT_KIND:
            raise ValueError(f"kind {marker['kind']!r}, not {EXPORT_KIND!r}")
        strategy, source, scales, entries = marker["strategy"], marker["source"], marker["scales"], list(marker["layers"])
        fingerprint = marker["fingerprint"]
        num_layers, shapes = fingerprint["num_layers"], kv_shapes(fingerprint)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvcalError(f"'{folder}' has a malformed {EXPORT_MARKER} ({exc!r}); re-export it") from exc
    if strategy not in STRATEGIES or scales not in SCALE_CHOICES or len(entries) != num_layers:
        raise KvcalError(f"'{folder}' has a malformed {EXPORT_MARKER} (strategy {strategy!r}, scales {scales!r}, {len(entries)} "
                         f"layers for a model of {num_layers!r}); re-export it")
    if not all(isinstance(entry, dict) and isinstance(entry.get("attention"), str) for entry in entries) or (
            len({entry["attention"] for entry in entries}) != num_layers):
        raise KvcalError(f"'{folder}' has a malformed {EXPORT_MARKER} (its layers do not name one attention module each); "
                         "re-export it")
    try:  # what vLLM and SGLang read: the scheme the marker's strategy writes, or the folder was edited
        scheme = json.loads((folder / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvcalError(f"'{folder}' has no config.json with a kv_cache_scheme ({exc!r}); re-export it") from exc
    if scheme != kv_cache_scheme(strategy):
        raise KvcalError(f"'{folder}': config.json's kv_cache_scheme {scheme} is not the {strategy} scheme of its "
                         f"{EXPORT_MARKER} (the folder was edited); re-export it")
    found = _scale_tensors(folder)
    fit = ScaleFit(strategy, source, scales, fingerprint)
    for i, entry in enumerate(entries):
        try:
            k, v = (found[f"{entry['attention']}.{suffix}"].float().flatten() for suffix in SCALE_NAMES)
            k_absmax, v_absmax = (torch.tensor(entry[name], dtype=torch.float32).flatten()
                                  for name in ("k_absmax_scale", "v_absmax_scale"))
            errors = [entry["error_absmax"], entry["error_calibrated"]]
            kept = entry["kept_absmax"]
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise KvcalError(f"'{folder}' lacks or has a malformed scale entry {exc!r}; re-export it") from exc
        recorded = [isinstance(error, (int, float)) and not isinstance(error, bool) for error in errors]
        if not all(done or error is None for done, error in zip(recorded, errors)) or (fit.searched and not all(recorded)) or (
                isinstance(kept, bool) or not isinstance(kept, int)):
            raise KvcalError(f"'{folder}': layer {i} of its {EXPORT_MARKER} records errors {errors} and kept_absmax "
                             f"{kept!r}, not numbers (searched scales record both errors); re-export it")
        fit.layers.append(LayerScales(k=k, v=v, k_absmax=k_absmax, v_absmax=v_absmax, error_absmax=errors[0],
                                      error_calibrated=errors[1], kept_absmax=kept))
    for i, (layer, (kv_heads, _)) in enumerate(zip(fit.layers, shapes)):
        per_layer = 1 if strategy == "tensor" else kv_heads
        for name, scale in zip(SCALE_NAMES, (layer.k, layer.v)):
            if scale.numel() != per_layer:
                raise KvcalError(f"'{folder}': layer {i} {name} has {scale.numel()} elements, strategy {strategy} takes "
                                 f"{per_layer}; re-export it")
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise KvcalError(f"'{folder}': layer {i} {name} is not finite and positive ({scale.tolist()}); re-export it")
    return fit
