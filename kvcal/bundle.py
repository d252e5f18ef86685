"""The bundle (schema 2; 3 where it keeps indexer keys otherwise than as computed): one safetensors file with a
per-layer recipe and the tensors it needs.

Tensors: `layers.{i}.{k|v}.{field}` (whatever the layer's format needs: codebook, lo, hi for nuq layers;
perm, group_start, clip for skvq layers; nothing for uniform layers), `layers.{i}.importance.{k|v}` and
`rope.inv_freq` ((head_dim/2,), or (layers, head_dim/2) where layer types rotate differently). Metadata:
`kvcal.config` JSON with the model fingerprint, the recipe (its method name, one entry per layer: storage format,
bits, group size, window, sink, residual, pre_rope, outlier fraction, fp8, packing layout; and, where a model's
sparse layers keep them otherwise than as computed, `indexer_keys`: kvcal.indexer_keys) and the calibration
provenance; `kvcal.sha256`, a checksum of all the
metadata and of every tensor's name, dtype, shape and bytes (kvcal.artifacts). load_bundle validates
schema, checksum, recipe (every field by type and range), tensor names (no missing, no extra ones), shapes,
dtypes and finite values, RoPE frequencies positive then zero and non-negative importances, each layer's tensors
against its format (kvcal.registry: what the encoders and kernels rely on, such as sorted codebooks and ordered
thresholds), and the model fingerprint when given a model, and refuses anything else with a message naming the
problem: a bundle whose checksum was recomputed after an edit never reaches the runtime to be misread.

This module knows the format only: which methods write which layers is kvcal.methods' business, and
building a bundle from a profile is kvcal.calibration's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kvcal import registry
from kvcal.adapters import ModelAdapter, adapt, index_widths, kv_shapes
from kvcal.artifacts import NEWEST_SCHEMA, SCHEMA_VERSION, check_same_model, read_artifact, read_header, write_artifact
from kvcal.errors import KvcalError
from kvcal.indexer_keys import FORMATS as INDEXER_KEY_FORMATS

BUNDLE_KIND = "bundle"
# How the runtime packs codes (kvcal.packing): "lsb" words, except 3- and 5-7-bit codes as bit-planes. A bundle
# holds no codes, so this is a declaration; a layer's `packing` must name the "lsb" family. Bundles written before
# 5-7-bit codes declare PACKING_UP_TO_4_BITS, which stays true for their layers.
PACKING_UP_TO_4_BITS = {"word_bits": 32, "bit_order": "lsb-first", "layout": "lsb", "3-bit layout": "planes3"}
PACKING = {**PACKING_UP_TO_4_BITS, "5-7-bit layouts": "planes5, planes6, planes7"}


@dataclass(frozen=True)
class LayerRecipe:
    """How one layer's keys and values are stored at run time."""

    method: str  # the layer's storage format (kvcal.registry.LayerFormat): nuq, skvq or uniform
    k_bits: float
    v_bits: float
    pre_rope: bool
    group_size: int = 0  # uniform: channels per value group and tokens per key block; skvq: mean group size
    window: int = 0  # most recent tokens kept fp16
    sink: int = 0  # first tokens kept fp16
    residual: int = 0  # KIVI fp16 residual
    rpc_k: float = 0.0  # KVmix recent-pivotal-context ratios (fp16 share of each step's tokens, see kvcal.runtime)
    rpc_v: float = 0.0
    outliers: float = 0.0  # nuq: fraction kept exact
    key_granularity: str = "channel"
    fp8: bool = False
    packing: str = PACKING["layout"]

    @property
    def format(self) -> registry.LayerFormat:
        return registry.layer_format(self.method)


@dataclass
class Bundle:
    path: Path
    recipe_name: str
    layers: list[LayerRecipe]
    tensors: dict[str, torch.Tensor]
    config: dict
    settings: object | None = None  # the method's typed settings (kvcal.registry), None in bundles that predate them

    @property
    def fingerprint(self) -> dict:
        return self.config["model"]["fingerprint"]

    @property
    def indexer_keys(self) -> str:
        """How the cache keeps sparse layers' indexer keys (kvcal.indexer_keys.FORMATS; "model" where the recipe
        names none)."""
        return self.config.get("recipe", {}).get("indexer_keys", "model")

    def check_model(self, adapter: ModelAdapter) -> None:
        check_same_model(self.fingerprint, adapter.fingerprint(), f"bundle '{self.path}'", "this model", "calibrate for this model")

    def layer_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s K/V tensors keyed `k.codebook`, `v.perm`, ..."""
        prefix = f"layers.{index}."
        return {name[len(prefix):]: t for name, t in self.tensors.items() if name.startswith(prefix) and ".importance." not in name}

    def layer_codecs(self, index: int):
        """The codecs of one layer (kvcal.quantizers.LayerCodecs), shared by the simulation and the runtime cache, for
        its key's width (LayerCodecs.for_key_width)."""
        layer = self.layers[index]
        heads, head_dim = kv_shapes(self.fingerprint, "k")[index]
        return layer.format.codecs(layer, self.layer_tensors(index)).for_key_width(heads * head_dim)


def write_bundle(path, tensors: dict, config: dict) -> Path:
    """Write a bundle; as schema 3 where it keeps indexer keys otherwise than as computed, which a kvcal reading
    schema 2 alone would pass over and store them as computed."""
    schema = SCHEMA_VERSION if config["recipe"].get("indexer_keys", "model") == "model" else NEWEST_SCHEMA
    return write_artifact(path, tensors, BUNDLE_KIND, config, schema=schema)


MAX_TOKENS = 2**31 - 1  # token counts (sink, window, residual, group) fit the kernels' int32


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_TOKENS


def _is_fraction(x, upper: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < upper


def _layer_problem(layer: LayerRecipe) -> str | None:
    """Why a layer recipe is invalid, by type and range first, then by its format's own rules."""
    layer_format = registry.layer_format(layer.method)
    if layer_format is None:
        return f"method {layer.method!r} is not a storage format this kvcal knows"
    for name in ("k_bits", "v_bits"):
        bits = getattr(layer, name)
        if isinstance(bits, bool) or bits not in layer_format.code_widths:
            return f"{name} {bits!r} is not one of {', '.join(map(str, layer_format.code_widths))}"
    for name in ("group_size", "window", "sink", "residual"):
        if not _is_count(getattr(layer, name)):
            return f"{name} {getattr(layer, name)!r} is not a whole number of tokens in [0, {MAX_TOKENS}]"
    for name, upper in (("rpc_k", 1.0), ("rpc_v", 1.0), ("outliers", 0.1 + 1e-12)):
        if not _is_fraction(getattr(layer, name), upper):
            return f"{name} {getattr(layer, name)!r} is not a fraction in [0, {upper:.2g})"
    for name in ("pre_rope", "fp8"):
        if not isinstance(getattr(layer, name), bool):
            return f"{name} {getattr(layer, name)!r} is not true or false"
    if layer.key_granularity not in ("channel", "token"):
        return f"key_granularity {layer.key_granularity!r} is not channel or token"
    if layer.packing != PACKING["layout"]:
        return f"packing {layer.packing!r} is not {PACKING['layout']}"
    return layer_format.problem(layer)


def _layer_recipe(entry, index: int, path) -> LayerRecipe:
    names = {f.name for f in fields(LayerRecipe)}
    if not isinstance(entry, dict) or set(entry) != names:
        raise KvcalError(f"bundle '{path}': the recipe of layer {index} is malformed; re-export the bundle")
    layer = LayerRecipe(**entry)
    problem = _layer_problem(layer)
    if problem is not None:
        raise KvcalError(f"bundle '{path}': the recipe of layer {index} is invalid ({problem}); re-export the bundle")
    return layer


def _check_tensor(tensors: dict, name: str, dtype: str, shape: tuple, path) -> None:
    if name not in tensors:
        raise KvcalError(f"bundle '{path}' lacks tensor {name}; re-export the bundle")
    tensor = tensors[name]
    if str(tensor.dtype) != f"torch.{dtype}" or tuple(tensor.shape) != tuple(shape):
        raise KvcalError(f"bundle '{path}': tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {tuple(shape)}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise KvcalError(f"bundle '{path}': tensor {name} has values that are not finite; re-export the bundle")


def _fingerprint_shape(config: dict, path) -> tuple[dict, dict[str, list[tuple[int, int]]]]:
    """(fingerprint, per tensor kind ("k", "v") and layer (KV heads, channels of a head)) of a bundle's metadata, each
    number a positive int (an MLA key's width 0 or more)."""
    try:
        fingerprint = config["model"]["fingerprint"]
        numbers = [fingerprint[key] for key in ("num_layers", "num_heads", "num_kv_heads")]
        latent = "value_dim" in fingerprint  # MLA's latent
        numbers += [fingerprint["value_dim"]] if latent else [fingerprint["head_dim"]]
        # where the layers differ (kv_shapes, query_heads); an MLA key may have no channel (a layer without RoPE)
        rotated_widths = [fingerprint["head_dim"]] if latent else []
        for key in ("layer_kv_heads", "layer_head_dims", "layer_value_dims", "layer_num_heads"):
            if key in fingerprint:
                per_layer = fingerprint[key] if isinstance(fingerprint[key], list) and len(fingerprint[key]) == numbers[0] else [None]
                if key == "layer_head_dims" and latent:
                    rotated_widths += per_layer
                else:
                    numbers += per_layer
    except (KeyError, TypeError) as exc:
        raise KvcalError(f"bundle '{path}' has incomplete metadata (missing {exc}); re-export the bundle") from exc
    if not all(_is_count(n) and n > 0 for n in numbers) or not all(_is_count(n) for n in rotated_widths):
        raise KvcalError(f"bundle '{path}': the model fingerprint's layer/head counts {numbers + rotated_widths} are not "
                         "positive integers, one a layer; re-export")
    index = fingerprint.get("layer_index_dims", [0] * numbers[0])  # DeepSeek Sparse Attention's indexer keys
    if not (isinstance(index, list) and len(index) == numbers[0] and all(_is_count(n) and n >= 0 for n in index)):
        raise KvcalError(f"bundle '{path}': the model fingerprint's indexer widths {index} are not non-negative integers, one "
                         "a layer; re-export")
    return fingerprint, {kind: kv_shapes(fingerprint, kind) for kind in "kv"}


def _recorded_settings(recipe: dict, name: str, path):
    if "settings" not in recipe:
        return None
    try:
        settings = registry.settings_from_metadata(recipe["settings"])
    except KvcalError as exc:
        raise KvcalError(f"bundle '{path}': {exc}; re-export the bundle") from None
    if recipe["settings"]["method"] != name:
        raise KvcalError(f"bundle '{path}' records {recipe['settings']['method']} settings for recipe {name}; re-export the bundle")
    return settings


def load_bundle(path: str | Path, model=None) -> Bundle:
    """Validate and load a bundle; with a model (or its adapter), also refuse a bundle made for another."""
    path = Path(path)
    kind, _ = read_header(path)
    if kind != BUNDLE_KIND:
        raise KvcalError(f"'{path}' is a kvcal {kind}, not a bundle")
    tensors, config = read_artifact(path, BUNDLE_KIND)  # verifies the checksum over metadata and tensors
    fingerprint, shapes = _fingerprint_shape(config, path)
    num_layers, halves = len(shapes["k"]), [head_dim // 2 for _, head_dim in shapes["k"]]
    try:
        entries, name, packing = config["recipe"]["layers"], config["recipe"]["name"], config["recipe"]["packing"]
    except (KeyError, TypeError) as exc:
        raise KvcalError(f"bundle '{path}' has incomplete metadata (missing {exc}); re-export the bundle") from exc
    if not isinstance(name, str) or name not in registry.recipes():
        raise KvcalError(f"bundle '{path}' names recipe {name!r}, which this kvcal does not know ({', '.join(registry.recipes())})")
    if packing not in (PACKING, PACKING_UP_TO_4_BITS):
        raise KvcalError(f"bundle '{path}' packs codes as {packing!r}, this kvcal as {PACKING}; re-export the bundle")
    if not isinstance(entries, list) or len(entries) != num_layers:
        raise KvcalError(f"bundle '{path}' has a recipe for {len(entries) if isinstance(entries, list) else 'no'} layers, "
                         f"the model {num_layers}; re-export the bundle")
    indexer_keys = config["recipe"].get("indexer_keys", "model")
    if indexer_keys not in INDEXER_KEY_FORMATS:
        raise KvcalError(f"bundle '{path}' keeps indexer keys as {indexer_keys!r}, which this kvcal does not know "
                         f"({', '.join(INDEXER_KEY_FORMATS)}); re-export the bundle")
    if indexer_keys != "model" and not any(index_widths(fingerprint)):
        raise KvcalError(f"bundle '{path}' keeps indexer keys as {indexer_keys} for a model whose layers keep none; "
                         "re-export the bundle")
    layers = [_layer_recipe(entry, i, path) for i, entry in enumerate(entries)]
    if packing != PACKING and any(bits in (5, 6, 7) for layer in layers for bits in (layer.k_bits, layer.v_bits)):
        raise KvcalError(f"bundle '{path}' declares packing {packing!r}, which has no layout for its 5-7-bit codes; re-export the bundle")
    expected = {"rope.inv_freq"}
    # models whose layer types differ: a row a layer, zero past a layer's head_dim / 2 where the layers' differ
    per_layer = "rope.inv_freq" in tensors and tensors["rope.inv_freq"].dim() == 2 or len(set(halves)) > 1
    _check_tensor(tensors, "rope.inv_freq", "float32", (num_layers,) * per_layer + (max(halves),), path)
    rows = tensors["rope.inv_freq"].reshape(num_layers if per_layer else 1, max(halves))  # (of no column: no RoPE)
    # a layer's frequencies are positive, then zero over the channels RoPE leaves alone (kvcal.rope.rotate_half_order;
    # all of them on SmolLM3's NoPE layers)
    if not bool((rows >= 0).all() and (rows > 0).int().diff(dim=1).le(0).all()) or any(
            bool(row[half:].any()) for row, half in zip(rows, halves)):
        raise KvcalError(f"bundle '{path}': rope.inv_freq has a layer whose frequencies are not positive then zero (the "
                         "channels RoPE leaves alone); re-export the bundle")
    for i, layer in enumerate(layers):
        for kind in ("k", "v"):
            expected.add(f"layers.{i}.importance.{kind}")
            _check_tensor(tensors, f"layers.{i}.importance.{kind}", "float32", (1,), path)
            if bool((tensors[f"layers.{i}.importance.{kind}"] < 0).any()):
                raise KvcalError(f"bundle '{path}': layers.{i}.importance.{kind} is negative (an importance is a gradient norm); "
                                 "re-export the bundle")
            schema = layer.format.tensor_schema(layer, kind, shapes[kind][i][0] * shapes[kind][i][1])
            for field, (shape, dtype) in schema.items():
                expected.add(f"layers.{i}.{kind}.{field}")
                _check_tensor(tensors, f"layers.{i}.{kind}.{field}", dtype, shape, path)
            problem = layer.format.tensor_problem(layer, kind, {f: tensors[f"layers.{i}.{kind}.{f}"] for f in schema})
            if problem is not None:
                raise KvcalError(f"bundle '{path}': layer {i} {kind}: {problem}; re-export the bundle")
    extra = sorted(set(tensors) - expected)
    if extra:
        raise KvcalError(f"bundle '{path}' has tensors its recipe does not use ({', '.join(extra[:3])}"
                         f"{', ...' if len(extra) > 3 else ''}); re-export the bundle")
    bundle = Bundle(path, name, layers, tensors, config, _recorded_settings(config["recipe"], name, path))
    if model is not None:
        bundle.check_model(model if isinstance(model, ModelAdapter) else adapt(model))
    return bundle
