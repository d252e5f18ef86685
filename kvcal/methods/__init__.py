"""The built-in methods, one spec per module (kvcal.registry), registered on import; and the simulation
Method (kvcal.simulate) of any calibrated artifact, bundle or baseline spec, found through the registry.

Adding a method: write its module here (a MethodSpec, and a LayerFormat if it stores layers in a new
way), import it below, and, if it fits from a profile, give it a `kvcal fit-*` command in kvcal.cli."""

from __future__ import annotations

from pathlib import Path

from kvcal import registry
from kvcal.artifacts import read_artifact, read_header
from kvcal.bundle import BUNDLE_KIND, Bundle, load_bundle
from kvcal.errors import KvcalError
# The order here is the order `kvcal methods` lists them in: calibrated recipes, then baselines.
from kvcal.methods import kvquant, mixed, skvq, kivi, kvmix, cocktail  # noqa: F401, I001  (registers them)
from kvcal.methods import intn, hadamard, turbo, llama_cpp, fp8  # noqa: F401, I001
from kvcal.simulate import Method

__all__ = ["artifact_method", "baseline_method", "bundle_method"]


def bundle_method(bundle: Bundle) -> Method:
    """A bundle's per-layer recipe on the reference quantizers, as the simulation reads it."""
    policies = {layer.format.policy(layer) for layer in bundle.layers}
    if len(policies) != 1:
        raise KvcalError(f"bundle '{bundle.path}': layers with different sinks/windows/residuals cannot be simulated yet")
    nominal = sum(layer.k_bits + layer.v_bits for layer in bundle.layers) / (2 * len(bundle.layers))
    codecs = [bundle.layer_codecs(i) for i in range(len(bundle.layers))]
    return Method(f"bundle:{bundle.recipe_name}", nominal, codecs, policies.pop(), fingerprint=bundle.fingerprint)


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
    return spec.artifact_method(tensors, config, path)


def baseline_method(text: str, num_layers: int, head_dim: int) -> Method:
    """The simulation Method of a baseline spec such as `int4-g64` or `kivi2-g32-r128` for a model of
    `num_layers` layers and heads of `head_dim` channels."""
    text = text.strip()
    for spec in registry.methods():
        method = spec.baseline(text, num_layers, head_dim)
        if method is not None:
            return method
    syntax = "; ".join(s.baseline_syntax() for s in registry.methods() if s.baseline_syntax())
    raise KvcalError(f"unknown baseline '{text}'; use {syntax}, e.g. int4-g64, kivi2-g32-r128")
