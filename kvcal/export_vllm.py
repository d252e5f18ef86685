"""`kvcal export vllm`: calibrated FP8 (e4m3) KV-cache scales for vLLM, written as a compressed-tensors model folder.

vLLM reads calibrated KV-cache quantization only as FP8 scales, one per layer for K and one for V
(`strategy: tensor`) or one per KV head (`strategy: attn_head`); without them it uses scale 1.0. It stores
each token's key and value once, as `fp8_e4m3(x / scale)` saturated at +-448, and reads `fp8 * scale`.
The key it stores is the POST-RoPE key, so scales are searched on post-RoPE keys.

Scales come from a kvcal profile (`kvcal profile-gradients`). For each layer, starting from absmax / 448
(absmax over every calibration token the profile saw: its streaming statistics and its stored windows),
multiples 0.5 to 2.0 of it are tried and the one with the smallest error of the attention output on the
profile's stored windows is kept: keys first (values fp), then values (keys at the chosen scale). With
`attn_head` every KV head is chosen on its own (a head's output depends only on its own scales). A layer
or head whose calibrated pair does not beat absmax / 448 on the windows keeps absmax / 448. A profile
without stored windows gives plain absmax / 448 from its streaming statistics (sink tokens excluded).
`scales="absmax"` (`--scales absmax`) writes the absmax / 448 starting scales without searching, the
baseline the calibrated scales are measured against (`kvcal eval ppl --quant <folder>` evaluates either).

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

`fp8_fake_quantize` is the same quantize-dequantize as a function of per-layer scales, for simulation (it is
bit-identical to compressed-tensors' own `fake_quantize` for these schemes; tests/test_export_vllm.py).
Not modelled: the query quantization some vLLM attention backends add with an fp8 cache (no `q_scale` is
written, so vLLM keeps its default 1.0), ROCm's e4m3fnuz format, and rounding of the keys to the serving
dtype before they are quantized.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from kvcal.adapters import adapt
from kvcal.artifacts import check_same_model, read_artifact, read_header
from kvcal.errors import KvcalError
from kvcal.models import load_model, resolve_model
from kvcal.quantizers import store_as
from kvcal.rope import rotate_keys
from kvcal.version import __version__

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
STRATEGIES = ("tensor", "attn_head")
# Multiples of absmax / 448 tried, 0.5 to 2.0 by 0.025; 1.0 first so that ties keep plain absmax / 448. Below 1
# the largest values saturate; from 1 to 2 nothing does and the e4m3 grid (3 mantissa bits) shifts by one
# octave, which is all a float format's scale changes apart from saturation and subnormals.
SCALE_GRID = (1.0, *(round(0.5 + 0.025 * i, 3) for i in range(61) if i != 20))
MIN_SCALE = 2.0**-24  # a head that is all zeros still gets a usable (positive) scale
EXPORT_MARKER = "kvcal_export.json"
EXPORT_KIND = "vllm-fp8-kv-scales"
SCALE_NAMES = ("k_scale", "v_scale")
SCALE_CHOICES = ("calibrated", "absmax")  # searched on the windows, or the absmax / 448 they start from


def fp8_fake_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """What vLLM's FP8 (e4m3) KV cache stores and reads back for x of shape (tokens, kv_heads * head_dim):
    fp8_e4m3(x / scale) * scale, saturated at +-448, computed in float32 and returned as float32.

    `scale` is a number or a tensor of 1 element (per tensor) or of num_kv_heads elements (per KV head,
    in head order; the exported [num_kv_heads, 1, 1] shape is accepted). Keys must be post-RoPE: that is
    what vLLM writes to the cache."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).flatten()
    if x.dim() != 2:
        raise KvcalError(f"fp8_fake_quantize takes a (tokens, width) tensor, got shape {tuple(x.shape)}")
    tokens, width = x.shape
    heads = scale.numel()
    if heads == 0 or width % heads:
        raise KvcalError(f"{heads} scales do not divide a K/V width of {width} into heads")
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise KvcalError(f"FP8 scales must be finite and positive, got {scale.tolist()}")
    per_head = scale[:, None]
    y = x.float().reshape(tokens, heads, width // heads) / per_head
    return (store_as(y, FP8_DTYPE).float() * per_head).reshape(tokens, width)


@dataclass(frozen=True)
class Fp8KvScales:
    """Per-layer FP8 K and V scales (1 element per layer, or one per KV head): the vLLM quantizer for
    simulation. `unit` is vLLM's default (scale 1.0); `read` loads an exported folder's scales."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @classmethod
    def unit(cls, num_layers: int) -> Fp8KvScales:
        ones = tuple(torch.ones(1) for _ in range(num_layers))
        return cls(ones, ones)

    @classmethod
    def read(cls, folder: str | Path) -> Fp8KvScales:
        return cls.of_fit(read_export(folder))

    @classmethod
    def of_fit(cls, fit: ScaleFit) -> Fp8KvScales:
        return cls(tuple(layer.k for layer in fit.layers), tuple(layer.v for layer in fit.layers))

    def keys(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize post-RoPE keys (tokens, width) of `layer`."""
        return fp8_fake_quantize(x, self.k[layer])

    def values(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return fp8_fake_quantize(x, self.v[layer])


@dataclass
class LayerScales:
    """One layer's chosen scales and their absmax / 448 starting points, (heads,) float32 each, where
    heads is 1 for the tensor strategy; errors are the attention-output MSE on the stored windows."""

    k: torch.Tensor
    v: torch.Tensor
    k_absmax: torch.Tensor
    v_absmax: torch.Tensor
    error_absmax: float | None = None
    error_calibrated: float | None = None
    kept_absmax: int = 0  # heads (or the layer) where the searched pair lost to absmax / 448

    @property
    def reduction(self) -> float | None:
        if self.error_absmax is None or self.error_calibrated is None or self.error_absmax == 0:
            return None
        return 1.0 - self.error_calibrated / self.error_absmax


@dataclass
class ScaleFit:
    strategy: str
    source: str  # "windows" (absmax over windows and statistics) or "statistics" (absmax of the streaming statistics only)
    scales: str = "calibrated"  # what was asked: searched scales, or the absmax / 448 starting points
    fingerprint: dict | None = None  # of the profiled model, which the scales are for
    layers: list[LayerScales] = field(default_factory=list)

    @property
    def searched(self) -> bool:
        return self.source == "windows" and self.scales == "calibrated"

    @property
    def note(self) -> str:
        if self.scales == "absmax" and self.source == "windows":
            return ("scales are plain absmax / 448 (--scales absmax) over every token the profile saw (post-RoPE keys, values), "
                    "not searched")
        if self.source == "windows":
            return "scales searched on the profile's stored windows (attention-output MSE, post-RoPE keys)"
        return ("the profile has no stored windows: scales are plain absmax / 448 of its streaming statistics "
                "(post-RoPE keys, values; sink tokens excluded), not searched; re-run kvcal profile-gradients "
                "with --store-windows 2 to calibrate them")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise KvcalError(f"unknown --strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")


def _check_scales(scales: str) -> None:
    if scales not in SCALE_CHOICES:
        raise KvcalError(f"unknown --scales '{scales}'; choose one of {', '.join(SCALE_CHOICES)}")


class WindowAttention:
    """One layer's attention over the profile's stored windows, with K (post-RoPE) and V fake-quantized to
    FP8 as vLLM stores them; errors are per KV head: the MSE of the attention output of the query heads
    it serves, summed over windows. Every query row sees every earlier token quantized (vLLM keeps no
    fp16 sinks or window)."""

    def __init__(self, profile: dict, layer: int, fingerprint: dict, rope_scaling: float):
        prefix = f"layers.{layer}.windows"
        heads, self.kv_heads, self.head_dim = fingerprint["num_heads"], fingerprint["num_kv_heads"], fingerprint["head_dim"]
        self.group = heads // self.kv_heads
        inv_freq, positions = profile["rope.inv_freq"], profile["windows.positions"].long()
        self.queries, self.keys, self.values, self.reference = [], [], [], []
        tokens = profile[f"{prefix}.k"].shape[1]
        self.blocked = ~torch.ones(tokens, tokens, dtype=torch.bool).tril()
        for w in range(profile[f"{prefix}.k"].shape[0]):
            q = rotate_keys(profile[f"{prefix}.q"][w].float(), positions[w], heads, inv_freq, rope_scaling)
            self.queries.append(q.view(tokens, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3) * self.head_dim**-0.5)
            self.keys.append(rotate_keys(profile[f"{prefix}.k"][w].float(), positions[w], self.kv_heads, inv_freq, rope_scaling))
            self.values.append(profile[f"{prefix}.v"][w].float())
        self.reference = [self._probs(w, k) @ self._heads(v) for w, (k, v) in enumerate(zip(self.keys, self.values))]
        self._cached: tuple[torch.Tensor | None, list[torch.Tensor]] | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, kv_heads * head_dim) -> (kv_heads, 1, tokens, head_dim)."""
        return x.view(x.shape[0], self.kv_heads, self.head_dim).transpose(0, 1)[:, None]

    def _probs(self, w: int, keys: torch.Tensor) -> torch.Tensor:
        scores = self.queries[w] @ self._heads(keys).transpose(-1, -2)
        return torch.softmax(scores.masked_fill(self.blocked, float("-inf")), dim=-1)

    def errors(self, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
        """Per-KV-head attention-output MSE (kv_heads,) with keys and/or values quantized at these scales
        (None: kept in full precision). Scales are (kv_heads,) or (1,)."""
        if self._cached is None or not _same(self._cached[0], k_scale):
            probs = [self._probs(w, k if k_scale is None else fp8_fake_quantize(k, k_scale)) for w, k in enumerate(self.keys)]
            self._cached = (None if k_scale is None else k_scale.clone(), probs)
        total = torch.zeros(self.kv_heads, dtype=torch.float64)
        for probs, v, ref in zip(self._cached[1], self.values, self.reference):
            out = probs @ self._heads(v if v_scale is None else fp8_fake_quantize(v, v_scale))
            total += (out - ref).square().mean(dim=(1, 2, 3)).double()
        return total


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def _per_head_absmax(channel_absmax: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return channel_absmax.float().view(kv_heads, -1).amax(dim=1)


def _starting_scales(absmax: torch.Tensor, strategy: str) -> torch.Tensor:
    """absmax / 448 per KV head (attn_head) or the layer's, repeated for every head (tensor)."""
    if strategy == "tensor":
        absmax = absmax.amax().expand_as(absmax)
    return (absmax / FP8_MAX).clamp(min=MIN_SCALE).contiguous()


def _search(error: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The multiple of `start` (per head, or one for all heads) with the smallest error."""
    errors = torch.stack([error(start * m) for m in SCALE_GRID])  # (grid, kv_heads)
    grid = torch.tensor(SCALE_GRID, dtype=torch.float32)
    if per_head:
        return start * grid[errors.argmin(dim=0)]
    return start * grid[errors.sum(dim=1).argmin()]


def _fit_layer(objective: WindowAttention, k_start: torch.Tensor, v_start: torch.Tensor, strategy: str) -> LayerScales:
    per_head = strategy == "attn_head"
    k = _search(lambda s: objective.errors(s, None), k_start, per_head)
    v = _search(lambda s: objective.errors(k, s), v_start, per_head)
    calibrated, baseline = objective.errors(k, v), objective.errors(k_start, v_start)
    kept = 0
    if per_head:  # heads are independent: keep absmax / 448 where the searched pair does not beat it
        lost = calibrated > baseline
        kept = int(lost.sum())
        if kept:
            k, v = torch.where(lost, k_start, k), torch.where(lost, v_start, v)
            calibrated = objective.errors(k, v)
    elif float(calibrated.sum()) > float(baseline.sum()):
        k, v, calibrated, kept = k_start, v_start, baseline, 1
    width = slice(None) if per_head else slice(0, 1)
    return LayerScales(k=k[width].clone(), v=v[width].clone(), k_absmax=k_start[width].clone(), v_absmax=v_start[width].clone(),
                       error_absmax=float(baseline.mean()), error_calibrated=float(calibrated.mean()), kept_absmax=kept)


def calibrate_scales(profile_path: str | Path, strategy: str, on_layer: Callable[[int], None] | None = None,
                     scales: str = "calibrated") -> tuple[ScaleFit, dict]:
    """(per-layer FP8 K/V scales, the profile's config) for vLLM from a kvcal profile: searched on its stored
    windows (`scales="calibrated"`), or their absmax / 448 starting points (`scales="absmax"`)."""
    _check_strategy(strategy)
    _check_scales(scales)
    profile, config = read_artifact(profile_path, "profile")
    fingerprint = config["model"]["fingerprint"]
    kv_heads, num_layers = fingerprint["num_kv_heads"], fingerprint["num_layers"]
    has_windows = "layers.0.windows.q" in profile and "windows.positions" in profile
    fit = ScaleFit(strategy, "windows" if has_windows else "statistics", scales, fingerprint)
    for layer in range(num_layers):
        try:
            k_absmax = _per_head_absmax(profile[f"layers.{layer}.k_post.absmax"], kv_heads)
            v_absmax = _per_head_absmax(profile[f"layers.{layer}.v.absmax"], kv_heads)
        except KeyError as exc:
            raise KvcalError(f"profile '{profile_path}' lacks tensor {exc}; re-create it with kvcal profile-gradients") from exc
        if has_windows:  # the windows also hold the sink tokens the streaming statistics leave out
            objective = WindowAttention(profile, layer, fingerprint, config["rope"]["attention_scaling"])
            k_absmax = torch.maximum(k_absmax, _per_head_absmax(torch.stack([k.abs().amax(0) for k in objective.keys]).amax(0), kv_heads))
            v_absmax = torch.maximum(v_absmax, _per_head_absmax(torch.stack([v.abs().amax(0) for v in objective.values]).amax(0), kv_heads))
        k_start, v_start = _starting_scales(k_absmax, strategy), _starting_scales(v_absmax, strategy)
        if fit.searched:
            fit.layers.append(_fit_layer(objective, k_start, v_start, strategy))
        else:
            width = slice(None) if strategy == "attn_head" else slice(0, 1)
            error = float(objective.errors(k_start, v_start).mean()) if has_windows else None
            fit.layers.append(LayerScales(k=k_start[width].clone(), v=v_start[width].clone(),
                                          k_absmax=k_start[width].clone(), v_absmax=v_start[width].clone(), error_absmax=error))
        if on_layer is not None:
            on_layer(layer)
    return fit, config


def kv_cache_scheme(strategy: str) -> dict:
    """compressed-tensors QuantizationArgs of an FP8 e4m3 KV cache with static symmetric scales."""
    _check_strategy(strategy)
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True, "group_size": None}


def quantization_config(strategy: str) -> dict:
    """`quantization_config` of config.json: a compressed-tensors config that quantizes only the KV cache
    (no config groups, dense weights), as LLM-Compressor writes for a KV-cache-only recipe."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "global_compression_ratio": None,
        "kv_cache_scheme": kv_cache_scheme(strategy),
    }


def scale_tensors(fit: ScaleFit, attention_names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors vLLM loads: `{attention}.k_scale` / `.v_scale`, float32, shape [1] (tensor)
    or [num_kv_heads, 1, 1] (attn_head)."""
    tensors = {}
    for name, layer in zip(attention_names, fit.layers, strict=True):
        for suffix, scale in zip(SCALE_NAMES, (layer.k, layer.v)):
            scale = scale.float().reshape(1) if fit.strategy == "tensor" else scale.float().reshape(-1, 1, 1)
            tensors[f"{name}.{suffix}"] = scale.contiguous()
    return tensors


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


def is_previous_export(folder: Path) -> bool:
    marker = folder / EXPORT_MARKER
    try:
        return marker.is_file() and json.loads(marker.read_text()).get("kind") == EXPORT_KIND
    except (OSError, ValueError, AttributeError):
        return False


def check_out_folder(out: str | Path, inputs: list[Path] = ()) -> Path:
    """Refuse, before any work, an --out that cannot be written or would destroy something: an existing
    path that is not a directory, a non-empty directory that is not a previous kvcal vllm export, a
    folder that is or holds one of the inputs."""
    out = Path(out).expanduser()
    resolved = out.resolve()
    for path in inputs:
        path = Path(path).expanduser().resolve()
        if path == resolved or resolved in path.parents:
            raise KvcalError(f"--out '{out}' is or contains the input '{path}'; choose a new folder")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise KvcalError(f"--out '{out}' exists and is not a directory; pass a new folder, an empty one or a previous kvcal vllm export")
    if out.is_dir() and any(out.iterdir()) and not is_previous_export(out):
        raise KvcalError(f"--out '{out}' is a non-empty directory that is not a kvcal vllm export; pass a new or empty folder")
    existing = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvcalError(f"cannot write '{out}': '{existing or out.parent}' is not a writable folder; choose another --out")
    return out


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


def _save_folder(folder: Path, model, tokenizer, adapter, names: list[str], fit: ScaleFit, marker: dict) -> None:
    """save_pretrained with the scales registered as buffers on the attention modules (so they are written
    under the modules' own names), the tokenizer, quantization_config in config.json, the marker."""
    tensors = scale_tensors(fit, names)
    registered = []
    try:
        for handles, name in zip(adapter.layers, names):
            for suffix in SCALE_NAMES:
                handles.attention.register_buffer(suffix, tensors[f"{name}.{suffix}"].clone(), persistent=True)
                registered.append((handles.attention, suffix))
        with _saveable(model):
            model.save_pretrained(folder)
    finally:
        for module, suffix in registered:
            del module._buffers[suffix]
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(fit.strategy)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_folder_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """write(temp) into a temp folder beside `out`, then rename it to `out` (replacing an empty folder or
    a previous kvcal export): an interrupted export leaves no half-written folder at `out`."""
    temp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        write(temp)
        mask = _current_umask()  # mkdtemp makes 0700 and save_pretrained writes some files 0600: give them normal permissions
        for path in (temp, *temp.rglob("*")):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        if out.is_dir() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old)  # old is an empty folder: the rename replaces it
            os.replace(temp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temp, out)  # over nothing, or over an empty folder
        temp = None
    except OSError as exc:
        raise KvcalError(f"cannot write '{out}': {exc.strerror or exc}; choose another --out or free space") from exc
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return out


def export_vllm(profile: str | Path, model: str | None, strategy: str, out: str | Path,
                on_stage: Callable[[str, int | None], None] | None = None,
                on_layer: Callable[[int], None] | None = None, scales: str = "calibrated") -> tuple[Path, ScaleFit, dict]:
    """Check everything, load the model, check it is the profile's, fit the scales (or take absmax / 448 with
    scales="absmax"), write the folder. Returns (folder, fit, marker). on_stage(description, total) marks each
    stage (total: layers or None)."""
    stage = on_stage or (lambda description, total: None)
    _check_strategy(strategy)
    _check_scales(scales)
    profile = Path(profile)
    kind, profile_config = read_header(profile)
    if kind != "profile":
        raise KvcalError(f"'{profile}' is a kvcal {kind}, expected a profile from kvcal profile-gradients")
    source = resolve_model(model)
    inputs = [profile] + ([Path(source.path)] if Path(source.path).exists() else [])
    out = check_out_folder(out, inputs)
    stage("loading model", None)
    loaded, tokenizer, source = load_model(model, dtype=_checkpoint_dtype(model))
    adapter = adapt(loaded)
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
    if not is_previous_export(folder):
        raise KvcalError(f"'{folder}' is not a kvcal vllm export (no {EXPORT_MARKER}); pass a folder written by kvcal export vllm")
    try:
        marker = json.loads((folder / EXPORT_MARKER).read_text())
        strategy, source, scales, entries = marker["strategy"], marker["source"], marker["scales"], list(marker["layers"])
        fingerprint = marker["fingerprint"]
        num_layers, kv_heads = fingerprint["num_layers"], fingerprint["num_kv_heads"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvcalError(f"'{folder}' has a malformed {EXPORT_MARKER} ({exc!r}); re-export it") from exc
    if strategy not in STRATEGIES or scales not in SCALE_CHOICES or len(entries) != num_layers:
        raise KvcalError(f"'{folder}' has a malformed {EXPORT_MARKER} (strategy {strategy!r}, scales {scales!r}, {len(entries)} "
                         f"layers for a model of {num_layers!r}); re-export it")
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith((".k_scale", ".v_scale")):
                    found[key] = handle.get_tensor(key)
    fit = ScaleFit(strategy, source, scales, fingerprint)
    for entry in entries:
        try:
            k, v = (found[f"{entry['attention']}.{suffix}"].float().flatten() for suffix in SCALE_NAMES)
            fit.layers.append(LayerScales(k=k, v=v, k_absmax=torch.tensor(entry["k_absmax_scale"]),
                                          v_absmax=torch.tensor(entry["v_absmax_scale"]),
                                          error_absmax=entry["error_absmax"], error_calibrated=entry["error_calibrated"],
                                          kept_absmax=entry["kept_absmax"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KvcalError(f"'{folder}' lacks or has a malformed scale entry {exc!r}; re-export it") from exc
    per_layer = 1 if strategy == "tensor" else kv_heads
    for i, layer in enumerate(fit.layers):
        for name, scale in zip(SCALE_NAMES, (layer.k, layer.v)):
            if scale.numel() != per_layer:
                raise KvcalError(f"'{folder}': layer {i} {name} has {scale.numel()} elements, strategy {strategy} takes "
                                 f"{per_layer}; re-export it")
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise KvcalError(f"'{folder}': layer {i} {name} is not finite and positive ({scale.tolist()}); re-export it")
    return fit
