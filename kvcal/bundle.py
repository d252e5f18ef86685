"""The bundle (schema v1): one safetensors file with a per-layer recipe and the tensors it needs.

Tensors: `layers.{i}.{k|v}.{field}` (codebook, lo, hi for nuq layers; perm, group_start, clip for skvq
layers; nothing for uniform KIVI-style layers), `layers.{i}.importance.{k|v}` and `rope.inv_freq`.
Metadata: `kvcal.config` JSON with the model fingerprint, the recipe (one entry per layer: method, bits,
group size, window, sink, residual, pre_rope, outlier fraction, fp8, packing layout and bit order) and
the calibration provenance; `kvcal.sha256`, a checksum of every tensor's name, dtype, shape and bytes.
load_bundle validates schema, checksum, recipe, tensor names, shapes and dtypes, and the model
fingerprint when given a model, and refuses anything else with a message naming the problem.

Recipes: kvquant (nuqX with outliers and sink), mixed (KVmix per-layer widths on KVQuant codebooks: fit-nuq
--bits-from-profile), skvq, kivi (no calibration: K per channel over blocks of G tokens, V per token,
fp16 residual R), kvmix (the profile's per-layer widths and RPC ratios on KVmix's uniform quantizer: K per
channel over blocks of G = 32 tokens, V per token over groups of 32 channels).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from kvcal.artifacts import read_artifact, read_header, write_artifact
from kvcal.errors import KvcalError

BUNDLE_KIND = "bundle"
RECIPES = ("kvquant", "mixed", "skvq", "kivi", "kvmix")
KVMIX_GROUP = 32
PACKING = {"word_bits": 32, "bit_order": "lsb-first", "layout": "lsb"}  # see kvcal.packing


@dataclass(frozen=True)
class LayerRecipe:
    """How one layer's keys and values are stored at run time."""

    method: str  # nuq, skvq or uniform
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

    def fields_for(self, kind: str) -> dict[str, str]:
        """Tensor fields this layer's recipe needs for K ('k') or V ('v'), with their dtypes."""
        if self.method == "nuq":
            if kind == "k" and self.key_granularity == "channel":
                return {"codebook": "float32", "lo": "float32", "hi": "float32"}
            return {"codebook": "float32"}
        if self.method == "skvq":
            return {"perm": "int32", "group_start": "int32", "clip": "float32"}
        return {}


@dataclass
class Bundle:
    path: Path
    recipe_name: str
    layers: list[LayerRecipe]
    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def fingerprint(self) -> dict:
        return self.config["model"]["fingerprint"]

    def check_model(self, adapter) -> None:
        from kvcal.evaluate import describe_fingerprint

        if adapter.fingerprint() != self.fingerprint:
            raise KvcalError(f"bundle '{self.path}' was made for {describe_fingerprint(self.fingerprint)}, "
                             f"not for this model ({describe_fingerprint(adapter.fingerprint())}); calibrate for this model")


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _same_model(artifact_config: dict, profile_config: dict, path: str) -> None:
    if artifact_config["model"]["fingerprint"] != profile_config["model"]["fingerprint"]:
        raise KvcalError(f"'{path}' was calibrated for {artifact_config['model']['spec']}, the profile for "
                         f"{profile_config['model']['spec']}; fit it from this profile")


def build_bundle(profile_path: str, recipe: str, nuq_path: str | None = None, skvq_path: str | None = None,
                 kivi_bits: int = 2, kivi_group: int = 32, kivi_residual: int = 128) -> tuple[dict, dict]:
    """(tensors, config) of a bundle for `recipe` from a profile and the fitted artifacts it needs."""
    if recipe not in RECIPES:
        raise KvcalError(f"unknown recipe '{recipe}'; choose one of {', '.join(RECIPES)}")
    profile, profile_config = read_artifact(profile_path, "profile")
    num_layers = profile_config["model"]["fingerprint"]["num_layers"]
    tensors = {"rope.inv_freq": profile["rope.inv_freq"]}
    for i in range(num_layers):
        for kind in ("k", "v"):
            tensors[f"layers.{i}.importance.{kind}"] = profile[f"importance.{kind}"][i : i + 1].clone()
    if recipe in ("kvquant", "mixed"):
        if nuq_path is None:
            raise KvcalError(f"recipe {recipe} needs --nuq (from kvcal fit-nuq{' --bits-from-profile' if recipe == 'mixed' else ''})")
        fitted, config = read_artifact(nuq_path, "nuq")
        _same_model(config, profile_config, nuq_path)
        nuq = config["nuq"]
        if nuq["bits_from_profile"] != (recipe == "mixed"):
            raise KvcalError(f"recipe {recipe} needs a nuq artifact fit {'with' if recipe == 'mixed' else 'without'} --bits-from-profile")
        layers = [LayerRecipe("nuq", nuq["bits_k"][i], nuq["bits_v"][i], nuq["key_rope"] == "pre", sink=nuq["sink"],
                              outliers=nuq["outliers"], key_granularity=nuq["key_granularity"]) for i in range(num_layers)]
        source = fitted
    elif recipe == "skvq":
        if skvq_path is None:
            raise KvcalError("recipe skvq needs --skvq (from kvcal fit-skvq)")
        fitted, config = read_artifact(skvq_path, "skvq")
        _same_model(config, profile_config, skvq_path)
        s = config["skvq"]
        layers = [LayerRecipe("skvq", s["kbits"], s["vbits"], True, group_size=s["group_size"], window=s["window"],
                              sink=s["sink"], fp8=s["fp8"], key_granularity="token") for _ in range(num_layers)]
        source = fitted
    elif recipe == "kvmix":
        bits_k, bits_v = profile["kvmix.bits.k"].tolist(), profile["kvmix.bits.v"].tolist()
        rpc_k, rpc_v = ([round(r, 6) for r in profile[f"kvmix.rpc.{kind}"].tolist()] for kind in ("k", "v"))  # float32 -> 0.1, not 0.10000000149
        layers = [LayerRecipe("uniform", bits_k[i], bits_v[i], False, group_size=KVMIX_GROUP, rpc_k=rpc_k[i], rpc_v=rpc_v[i])
                  for i in range(num_layers)]
        source = {}
    else:
        from kvcal.baselines import parse_baseline

        parse_baseline(f"kivi{kivi_bits}-g{kivi_group}-r{kivi_residual}")  # validates the combination
        layers = [LayerRecipe("uniform", kivi_bits, kivi_bits, False, group_size=kivi_group, residual=kivi_residual)
                  for _ in range(num_layers)]
        source = {}
    for i, layer in enumerate(layers):
        for kind in ("k", "v"):
            for field in layer.fields_for(kind):
                tensors[f"layers.{i}.{kind}.{field}"] = source[f"layers.{i}.{kind}.{field}"]
    config = {"model": profile_config["model"], "rope": profile_config["rope"], "calibration": profile_config["calibration"],
              "recipe": {"name": recipe, "packing": PACKING, "layers": [asdict(layer) for layer in layers]}}
    return tensors, config


def write_bundle(path, tensors: dict, config: dict) -> Path:
    return write_artifact(path, tensors, BUNDLE_KIND, config, extra_metadata={"kvcal.sha256": tensors_checksum(tensors)})


def _layer_recipe(entry, index: int, path) -> LayerRecipe:
    names = {f.name for f in fields(LayerRecipe)}
    if not isinstance(entry, dict) or set(entry) != names:
        raise KvcalError(f"bundle '{path}': the recipe of layer {index} is malformed; re-export the bundle")
    layer = LayerRecipe(**entry)
    bits_ok = all(isinstance(b, (int, float)) and (b in (1, 2, 3, 4) or (b == 1.5 and layer.method == "skvq"))
                  for b in (layer.k_bits, layer.v_bits))
    counts_ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in (layer.group_size, layer.window, layer.sink, layer.residual))
    rpc_ok = all(isinstance(r, (int, float)) and 0 <= r < 1 for r in (layer.rpc_k, layer.rpc_v))
    uniform_ok = layer.method != "uniform" or (layer.group_size > 0 and layer.sink == 0 and layer.residual % layer.group_size == 0)
    if layer.method not in ("nuq", "skvq", "uniform") or not bits_ok or not counts_ok or not rpc_ok or not uniform_ok \
            or layer.packing != PACKING["layout"]:
        raise KvcalError(f"bundle '{path}': the recipe of layer {index} is invalid ({entry}); re-export the bundle")
    return layer


def _check_tensor(tensors: dict, name: str, dtype: str, shape: tuple, path) -> None:
    if name not in tensors:
        raise KvcalError(f"bundle '{path}' lacks tensor {name}; re-export the bundle")
    tensor = tensors[name]
    if str(tensor.dtype) != f"torch.{dtype}" or tuple(tensor.shape) != shape:
        raise KvcalError(f"bundle '{path}': tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")


def load_bundle(path: str | Path, model=None) -> Bundle:
    """Validate and load a bundle; with a model (or its adapter), also refuse a bundle made for another."""
    from safetensors import safe_open

    path = Path(path)
    kind, config = read_header(path)
    if kind != BUNDLE_KIND:
        raise KvcalError(f"'{path}' is a kvcal {kind}, not a bundle")
    with safe_open(str(path), framework="pt") as handle:
        expected_checksum = (handle.metadata() or {}).get("kvcal.sha256")
    tensors, _ = read_artifact(path, BUNDLE_KIND)
    if expected_checksum != tensors_checksum(tensors):
        raise KvcalError(f"bundle '{path}' fails its checksum: the file is corrupt; re-export or re-download it")
    try:
        fingerprint = config["model"]["fingerprint"]
        recipe = config["recipe"]
        num_layers, width = fingerprint["num_layers"], fingerprint["num_kv_heads"] * fingerprint["head_dim"]
        entries, name = recipe["layers"], recipe["name"]
    except (KeyError, TypeError) as exc:
        raise KvcalError(f"bundle '{path}' has incomplete metadata (missing {exc}); re-export the bundle") from exc
    if not isinstance(entries, list) or len(entries) != num_layers:
        raise KvcalError(f"bundle '{path}' has a recipe for {len(entries) if isinstance(entries, list) else 'no'} layers, "
                         f"the model {num_layers}; re-export the bundle")
    layers = [_layer_recipe(entry, i, path) for i, entry in enumerate(entries)]
    _check_tensor(tensors, "rope.inv_freq", "float32", (fingerprint["head_dim"] // 2,), path)
    for i, layer in enumerate(layers):
        for kind in ("k", "v"):
            _check_tensor(tensors, f"layers.{i}.importance.{kind}", "float32", (1,), path)
            bits = layer.k_bits if kind == "k" else layer.v_bits
            groups = math.ceil(width / layer.group_size) if layer.group_size else 0
            shapes = {"codebook": (2 ** int(bits),), "lo": (width,), "hi": (width,), "perm": (width,),
                      "group_start": (groups + 1,), "clip": (groups,)}
            for field, dtype in layer.fields_for(kind).items():
                _check_tensor(tensors, f"layers.{i}.{kind}.{field}", dtype, shapes[field], path)
            if layer.method == "skvq":
                perm = tensors[f"layers.{i}.{kind}.perm"]
                starts = tensors[f"layers.{i}.{kind}.group_start"]
                if not torch.equal(perm.sort().values, torch.arange(width, dtype=torch.int32)) or starts[0] != 0 \
                        or starts[-1] != width or bool((starts[1:] <= starts[:-1]).any()):
                    raise KvcalError(f"bundle '{path}': layer {i} {kind} permutation or group bounds are invalid; re-export")
    bundle = Bundle(path, name, layers, tensors, config)
    if model is not None:
        from kvcal.adapters import ModelAdapter, adapt

        bundle.check_model(model if isinstance(model, ModelAdapter) else adapt(model))
    return bundle


def layer_codecs(bundle: Bundle, index: int):
    """The codecs of one layer of a bundle (shared by the simulation and the runtime cache)."""
    from kvcal.nuq import nuq_layer
    from kvcal.quantizers import ChannelBlockUniform, TokenUniform
    from kvcal.simulate import LayerCodecs
    from kvcal.skvq import SkvqTensor, skvq_layer

    layer, prefix = bundle.layers[index], f"layers.{index}."
    t = {name[len(prefix):]: v for name, v in bundle.tensors.items() if name.startswith(prefix)}
    if layer.method == "nuq":
        return nuq_layer(t["k.codebook"], t["v.codebook"], t.get("k.lo"), t.get("k.hi"), layer.outliers, layer.pre_rope)
    if layer.method == "skvq":
        return skvq_layer(*(SkvqTensor(t[f"{k}.perm"], t[f"{k}.group_start"], t[f"{k}.clip"], bits, layer.fp8)
                            for k, bits in (("k", layer.k_bits), ("v", layer.v_bits))))
    # uniform (KIVI, KVmix): K per channel over blocks of G tokens, V per token over groups of G channels
    return LayerCodecs(ChannelBlockUniform(int(layer.k_bits), layer.group_size), TokenUniform(int(layer.v_bits), layer.group_size), False)


def layer_policy(layer: LayerRecipe):
    """Which tokens the cache keeps fp16 for a layer, under token-by-token decoding (RPC keeps none then)."""
    from kvcal.simulate import SegmentPolicy

    key_block = layer.group_size if layer.method == "uniform" and not layer.residual else 0
    return SegmentPolicy(sink=layer.sink, window=layer.window, residual=layer.residual, key_block=key_block)


def bundle_method(path: str):
    """The simulation Method of a bundle: its per-layer recipe on the reference quantizers."""
    from kvcal.simulate import Method

    bundle = load_bundle(path)
    policies = {layer_policy(layer) for layer in bundle.layers}
    if len(policies) != 1:
        raise KvcalError(f"bundle '{path}': layers with different sinks/windows/residuals cannot be simulated yet")
    nominal = sum(l.k_bits + l.v_bits for l in bundle.layers) / (2 * len(bundle.layers))
    codecs = [layer_codecs(bundle, i) for i in range(len(bundle.layers))]
    return Method(f"bundle:{bundle.recipe_name}", nominal, codecs, policies.pop(), fingerprint=bundle.fingerprint)
