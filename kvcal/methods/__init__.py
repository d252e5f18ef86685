"""The built-in methods, one spec per module (kvcal.registry), registered on import; and the simulation
Method (kvcal.simulate) of any calibrated artifact, bundle or baseline spec, found through the registry.

Adding a method: write its module here (a MethodSpec, and a LayerFormat if it stores layers in a new
way), import it below, and, if it fits from a profile, give it a `kvcal fit-*` command in kvcal.cli."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from kvcal import registry
from kvcal.adapters import kv_shapes
from kvcal.artifacts import read_artifact, read_header
from kvcal.bundle import BUNDLE_KIND, Bundle, load_bundle
from kvcal.errors import KvcalError
# The order here is the order `kvcal methods` lists them in: calibrated recipes, then baselines.
from kvcal.methods import kvquant, mixed, skvq, kivi, kvmix, cocktail  # noqa: F401, I001  (registers them)
from kvcal.methods import intn, hadamard, turbo, llama_cpp, fp8, vllm_dtypes, sglang_dtypes  # noqa: F401, I001
from kvcal.methods.llama_cpp import cache_type_pair, first_last_method, first_last_option, llama_cpp_method
from kvcal.methods.vllm_dtypes import DS_MLA, VLLM_DTYPES, ds_mla_refusal, turboquant_method
from kvcal.quantizers import FP16_LAYER
from kvcal.simulate import Method
from kvcal.vllm_codecs import TQ_PRESETS

__all__ = ["artifact_method", "baseline_method", "bundle_method", "check_baseline", "decoder_refusal",
           "split_baselines"]


def bundle_method(bundle: Bundle) -> Method:
    """A bundle's per-layer recipe on the reference quantizers, as the simulation reads it."""
    policies = {layer.format.policy(layer) for layer in bundle.layers}
    if len(policies) != 1:
        raise KvcalError(f"bundle '{bundle.path}': layers with different sinks/windows/residuals cannot be simulated yet")
    nominal = sum(layer.k_bits + layer.v_bits for layer in bundle.layers) / (2 * len(bundle.layers))
    codecs = [bundle.layer_codecs(i) for i in range(len(bundle.layers))]
    return Method(f"bundle:{bundle.recipe_name}", nominal, codecs, policies.pop(), fingerprint=bundle.fingerprint,
                  indexer_keys=bundle.indexer_keys)


def _accepted() -> str:
    """What `eval ppl --quant` takes, for messages."""
    kinds = [s.artifact_kind for s in registry.methods() if s.artifact_kind]
    folders = [s.folder_kind for s in registry.methods() if s.folder_kind]
    return f"a {' or '.join(dict.fromkeys(kinds))} or {BUNDLE_KIND} artifact" + "".join(f", or a {kind}" for kind in dict.fromkeys(folders))


def artifact_method(path: str) -> Method:
    """The simulation Method of a fitted artifact (nuq, skvq), a bundle, or a method's output folder (a kvcal
    export vllm folder), by its kind."""
    if Path(path).is_dir():
        for spec in registry.methods():
            method = spec.folder_method(path)
            if method is not None:
                return method
        raise KvcalError(f"'{path}' is a directory that no kvcal method wrote; --quant takes {_accepted()}")
    kind, _ = read_header(path)
    if kind == BUNDLE_KIND:
        return bundle_method(load_bundle(path))
    spec = registry.method_for_artifact(kind)
    if spec is None:
        raise KvcalError(f"'{path}' is a kvcal {kind}; --quant takes {_accepted()}")
    tensors, config = read_artifact(path, kind)
    method = spec.artifact_method(tensors, config, path)
    keys = kv_shapes(config["model"]["fingerprint"], "k")  # (an MLA key of no channel stores nothing, as in a bundle)
    return replace(method, layers=[layer.for_key_width(heads * head_dim) for layer, (heads, head_dim) in zip(method.layers, keys)])


def baseline_method(text: str, head_dims: list[int], windows: list[int | None] | None = None, decoder: str = "dense",
                    value_dims: list[int] | None = None, latent: bool = False, indexed: bool = False) -> Method:
    """The simulation Method of a baseline spec such as `int4-g64` or `kivi2-g32-r128` for a model whose layers'
    heads have `head_dims` channels (one a layer: Gemma 4's differ, each layer's codecs made for its own), their values
    `value_dims` where those differ (MLA's latent: the ModelAdapter's value_dims). `decoder`:
    the model's kvcal.adapters.decoder_kind, which a TurboQuant preset's fp16 boundary layers follow as vLLM picks them
    (at 1471680b): the first and last two of a "dense" decoder, none in a "recurrent" one (its is_hybrid), and in a
    "shared" one (layers reading another's cache, which vLLM may count among them) and a "cross" one (layers attending
    across to an image) refused.
    `SPEC;skip=L+L+...` keeps layers L unquantized in fp16
    (vLLM's --kv-cache-dtype-skip-layers: layer indices, or `sliding_window` for every layer with a window in
    `windows`, the adapter's); after a llama.cpp type or K/V pair, `;k_first=TYPE,N`, `;k_last=TYPE,M`,
    `;v_first=...`, `;v_last=...` give the first / last layers of K or V another type (ik_llama.cpp's mixed cache,
    kvcal.methods.llama_cpp). `latent`: the model's attention is MLA (ModelAdapter.latent), whose cache engines store
    in their own way (latent_refusal): a llama.cpp type is then its unrotated MLA row. `indexed`: some of its layers
    keep an indexer's keys (sparse attention: vLLM's fp8_ds_mla)."""
    base, skip, first_last = _spec_parts(text)
    refusal = decoder_refusal(base, decoder)
    if refusal is not None:
        raise KvcalError(f"baseline '{text}': {refusal}; evaluate another vLLM dtype")
    refusal = latent_refusal(base, skip, first_last, indexed) if latent else None
    if refusal is not None:
        raise KvcalError(f"baseline '{text}' on a multi-head latent attention (MLA) model: {refusal}")
    num_layers, value_dims = len(head_dims), value_dims or head_dims
    refusal = ds_mla_refusal(latent, indexed, head_dims, value_dims) if base == DS_MLA else None
    if refusal is not None:
        raise KvcalError(f"baseline '{text}': {refusal}; evaluate another cache type")
    # (a key of no channel, a latent layer's without RoPE, takes its value's codecs' for_key_width(0))
    by_head_dim = {head_dim: _base_baseline(base, first_last, num_layers, head_dim, text, decoder == "dense", latent)
                   for head_dim in dict.fromkeys(head_dims + value_dims) if head_dim}
    method = by_head_dim[value_dims[0]]
    if len(by_head_dim) > 1 or 0 in head_dims:
        layers = [replace(by_head_dim[value_dim].layers[i], key_codec=by_head_dim[head_dim or value_dim].layers[i].key_codec)
                  .for_key_width(head_dim) for i, (head_dim, value_dim) in enumerate(zip(head_dims, value_dims))]
        method = replace(method, layers=layers)
    if skip is None:
        return method
    skipped = skipped_layers(skip, num_layers, windows, text)
    layers = [FP16_LAYER if i in skipped else layer for i, layer in enumerate(method.layers)]
    return replace(method, name=f"{method.name};skip={'+'.join(map(str, sorted(skipped)))}", layers=layers)


def decoder_refusal(base: str, decoder: str) -> str | None:
    """Why baseline `base` is not modelled on a decoder of this kvcal.adapters.decoder_kind, or None where it is."""
    if decoder == "shared" and base in TQ_PRESETS:
        return ("vLLM's TurboQuant boundary layers are not modelled in a model whose layers read another's cache (KV "
                "sharing)")
    if decoder == "cross" and base in TQ_PRESETS:
        return ("vLLM's TurboQuant boundary layers are not modelled in a model whose layers attend across to an image "
                "(cross-attention)")
    return None


def latent_refusal(base: str, skip: str | None, first_last: dict, indexed: bool) -> str | None:
    """Why a baseline is not what an engine stores for MLA, or None where it is. llama.cpp stores a token's latent and
    rotated key as one row of -ctk's type, -ctv equal to it (src/llama-context.cpp refuses two), unrotated (the V-less
    cache's attention in src/llama-graph.cpp applies no Hadamard); vLLM's MLA backends cache fp8 or 16-bit only and
    read no skipped layers (MLAAttention takes cache_config.cache_dtype for every layer). On sparse MLA (`indexed`)
    vLLM turns fp8 into fp8_ds_mla (DeepseekV32ForCausalLM.verify_and_update_config), the tiled layout SGLang's
    sparse cache also stores, so plain fp8 at scale 1.0 is what neither stores."""
    pair = cache_type_pair(base)
    if pair is not None and pair[0] != pair[1]:
        return "llama.cpp stores its latent and rotated key as one row of one type (-ctk and -ctv equal): give one type"
    if first_last:
        return "ik_llama.cpp's MLA cache (its first / last layer types) is not modelled: give one llama.cpp type"
    if base in VLLM_DTYPES or base in TQ_PRESETS:
        return (f"vLLM's MLA attention caches fp8 or 16-bit only, not {base}: evaluate {DS_MLA if indexed else 'fp8'}, "
                "or kvcal's own int or kivi baselines")
    if indexed and base == "fp8":
        return ("vLLM stores sparse MLA's fp8 cache (an indexer's pick) as fp8_ds_mla, 128-channel tiles with a scale "
                "each, as SGLang does, not plain fp8: evaluate fp8_ds_mla")
    if skip is not None:
        return "vLLM's MLA attention leaves no layer unquantized (it reads no --kv-cache-dtype-skip-layers): drop ;skip="
    return None


def split_baselines(text: str) -> list[str]:
    """The specs of a comma-separated list (--baseline): split at the commas a spec begins after, not those within
    its first / last options (`k_first=TYPE,N`), as no spec begins with a digit."""
    return [spec.strip() for spec in re.split(r",(?!\s*\d)", text) if spec.strip()]


def check_baseline(text: str) -> None:
    """Refuse a baseline spec (baseline_method's) that no model would take: its syntax, its types, before a model is
    loaded; what depends on the model's layers (their number, windows, KV sharing) is checked by baseline_method."""
    base, _, first_last = _spec_parts(text)
    most = max((count for _, count in first_last.values()), default=1)
    _base_baseline(base, first_last, 2 * most, 64, text, boundary=True)  # room for each first and last option


def _spec_parts(text: str) -> tuple[str, str | None, dict[str, tuple[str, int]]]:
    """A baseline spec's base, its skip= layer map (None without one) and its first / last options."""
    base, *options = [part.strip() for part in text.strip().split(";")]
    skip, first_last = None, {}
    for option in options:
        name, _, value = option.partition("=")
        end = first_last_option(option)
        if name == "skip" and value and skip is None:
            skip = value
        elif end is not None and end[0] not in first_last:
            first_last[end[0]] = end[1]
        else:
            raise KvcalError(f"baseline '{text}': after ';' give skip=L+L+... (layer indices, or sliding_window), or after "
                             "a llama.cpp type k_first=TYPE,N (k_last, v_first, v_last)")
    return base, skip, first_last


def skipped_layers(layer_map: str, num_layers: int, windows: list[int | None] | None, text: str) -> set[int]:
    """The layers `skip=L+L+...` names (indices, or `sliding_window`): layer_map is what follows `skip=`."""
    skipped = set()
    for entry in layer_map.split("+"):
        if entry == "sliding_window":
            if windows is None:
                raise KvcalError(f"baseline '{text}': skip=sliding_window needs the model's layers (give it with a model)")
            windowed = {i for i, window in enumerate(windows) if window is not None}
            if not windowed:  # (vLLM's skips nothing there: the spec would say a skip that is not made)
                raise KvcalError(f"baseline '{text}': the model has no sliding-window layers for skip=sliding_window; "
                                 "skip layers by index, or leave skip= out")
            skipped |= windowed
        elif entry.isdigit() and int(entry) < num_layers:
            skipped.add(int(entry))
        else:
            raise KvcalError(f"baseline '{text}': '{entry}' is not a layer index below {num_layers} or sliding_window")
    return skipped


def _base_baseline(base: str, first_last: dict, num_layers: int, head_dim: int, text: str, boundary: bool,
                   latent: bool = False) -> Method:
    """The Method of baseline `base` (with ik_llama.cpp's first/last layer types where `first_last` gives them) for
    `num_layers` layers of heads of `head_dim` channels; `text` is the whole spec, for errors; `boundary`: a
    TurboQuant preset keeps its boundary layers fp16; `latent`: MLA's, a llama.cpp type unrotated (latent_refusal)."""
    pair = cache_type_pair(base) if latent else None
    if pair is not None:
        return llama_cpp_method(*pair, num_layers, head_dim, hadamard=None)
    if first_last:
        try:
            return first_last_method(base, first_last, [head_dim] * num_layers)
        except KvcalError as exc:
            raise KvcalError(f"baseline '{text}': {exc}") from None
    if base in TQ_PRESETS and not boundary:
        return turboquant_method(base, num_layers, head_dim, boundary=False)
    for spec in registry.methods():
        method = spec.baseline(base, num_layers, head_dim)
        if method is not None:
            return method
    syntax = "; ".join(s.baseline_syntax() for s in registry.methods() if s.baseline_syntax())
    raise KvcalError(f"unknown baseline '{base}'; use {syntax}, e.g. int4-g64, kivi2-g32-r128 (any of them ;skip=L+L+...)")
