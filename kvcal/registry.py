"""The method registry: one spec per quantization method, and the per-layer storage formats they write.

- A LayerFormat (by name: nuq, skvq, uniform; the `method` of a bundle layer) is how one layer's K and V
  are stored: the bundle tensors it needs ({field: (shape, dtype)}), the recipe values it accepts, its
  codecs, which tokens stay fp16 (its segment policy) and the bytes its quantized body takes. The bundle
  (kvcal.bundle) validates any layer against its format without knowing the algorithm behind it.
- A MethodSpec (by name: kvquant, mixed, skvq, kivi, kvmix, int, cocktail, fp8, ...) is what a user picks:
  its typed settings, its fit if it is calibrated, the layers it writes into a bundle, the simulation of its
  fitted artifact, output folder or baseline, and the summary of its artifact.

This module is the bottom of the stack (it imports nothing of kvcal but errors): specs and formats live
one per module in kvcal.methods and register themselves when that package is imported, which the
lookups below do on first use, as a plugin registry does.
"""

from __future__ import annotations

import importlib
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from kvcal.errors import KvcalError

BUILTIN_METHODS = "kvcal.methods"

Schema = dict[str, tuple[tuple[int, ...], str]]  # tensor field -> (shape, dtype name)


@dataclass
class ArtifactSummary:
    """What `kvcal inspect` prints: provenance rows and a per-layer table."""

    kind: str
    provenance: list[tuple[str, str]]
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)


class LayerFormat:
    """How one layer's keys and values are stored. Subclasses set `name` and override what they use."""

    name: str = ""
    code_widths: tuple[float, ...] = (1, 2, 3, 4)

    def problem(self, layer) -> str | None:
        """Why a layer recipe (kvcal.bundle.LayerRecipe) is invalid for this format, or None."""
        return None

    def tensor_schema(self, layer, kind: str, width: int) -> Schema:
        """Bundle tensors `layers.{i}.{kind}.{field}` this layer needs for K ('k') or V ('v')."""
        return {}

    def tensor_problem(self, layer, kind: str, tensors: dict) -> str | None:
        """Why this layer's tensors (by field, shapes already checked) are invalid, or None."""
        return None

    def codecs(self, layer, tensors: dict):
        """kvcal.quantizers.LayerCodecs from the layer recipe and its tensors keyed `k.codebook`, `v.perm`, ..."""
        raise NotImplementedError

    def policy(self, layer):
        """kvcal.kv.SegmentPolicy: which tokens stay fp16 under token-by-token decoding."""
        raise NotImplementedError

    def body_block(self, layer, keys: bool) -> int:
        """The body's rows come and go in whole blocks of this many (per-channel key blocks; 1: per token)."""
        return 1

    def body_bytes(self, layer, width: int, body: int, keys: bool) -> int:
        """Bytes of `body` quantized tokens of K (keys) or V: codes and their per-token/per-block parameters
        (outliers are counted apart, their number depends on the data)."""
        raise NotImplementedError


class MethodSpec:
    """A quantization method users pick by name. Subclasses set the attributes and override what they offer."""

    name: str = ""
    description: str = ""
    settings_type: type | None = None  # typed settings (a frozen dataclass with validate())
    settings_version: int = 1  # bumped when settings_type's fields change meaning; bundles record it
    artifact_kind: str | None = None  # the kind of artifact `fit` writes, if the method is calibrated
    folder_kind: str | None = None  # what its output folder is called, if `eval ppl --quant` takes one (folder_method)
    bundle_format: str | None = None  # the LayerFormat its bundle layers use, if it makes bundles

    def calibrate_settings(self, bits: int | None):
        """The settings `kvcal calibrate --recipe NAME [--bits B]` uses; refuse a --bits it cannot honour."""
        if bits is not None:
            raise KvcalError(f"--bits does not apply to recipe {self.name}; leave it out")
        return self.settings_type() if self.settings_type else None

    def fit(self, profile_path: str, settings, on_layer=None) -> tuple[dict, dict]:
        raise KvcalError(f"method {self.name} needs no calibration")

    def bundle_settings(self, profile_config: dict, fitted: tuple[dict, dict] | None, settings):
        """The typed settings a bundle of this method records: those given, or those its artifact was fit with."""
        return settings

    def bundle_layers(self, profile: dict, profile_config: dict, fitted: tuple[dict, dict] | None, settings) -> tuple[list, dict]:
        """(layer recipes, tensors by bundle name) of a bundle; `fitted` is the (tensors, config) of its artifact."""
        raise KvcalError(f"method {self.name} does not make bundles")

    def artifact_method(self, tensors: dict, config: dict, path: str):
        """The simulation Method (kvcal.simulate) of a fitted artifact of this method."""
        raise KvcalError(f"'{path}': method {self.name} has no artifact to simulate")

    def folder_method(self, path: str):
        """The simulation Method of an output folder of this method (its folder_kind), or None if `path` is not one."""
        return None

    def summarize_artifact(self, tensors: dict, config: dict) -> ArtifactSummary:
        raise NotImplementedError

    def baseline(self, text: str, num_layers: int, head_dim: int):
        """The simulation Method of a baseline spec such as `int4-g64` for a model of `num_layers` layers and
        heads of `head_dim` channels, or None if `text` is not this method's."""
        return None

    def baseline_syntax(self) -> str | None:
        """How this method is written as an `eval ppl --baseline`, or None if it is not a baseline."""
        return None


_FORMATS: dict[str, LayerFormat] = {}
_METHODS: dict[str, MethodSpec] = {}
_loaded = False


def register_format(layer_format: LayerFormat) -> LayerFormat:
    if layer_format.name in _FORMATS:
        raise ValueError(f"layer format {layer_format.name!r} is registered twice")
    _FORMATS[layer_format.name] = layer_format
    return layer_format


def register_method(spec: MethodSpec) -> MethodSpec:
    if spec.name in _METHODS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _METHODS[spec.name] = spec
    return spec


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module(BUILTIN_METHODS)


def layer_format(name: str) -> LayerFormat | None:
    _load_builtins()
    return _FORMATS.get(name) if isinstance(name, str) else None


def methods() -> list[MethodSpec]:
    """Every registered method, in registration order."""
    _load_builtins()
    return list(_METHODS.values())


def method(name: str) -> MethodSpec:
    _load_builtins()
    if not isinstance(name, str) or name not in _METHODS:
        raise KvcalError(f"unknown method {name!r}; choose one of {', '.join(_METHODS)}")
    return _METHODS[name]


def recipes() -> list[str]:
    """Methods that make bundles (`kvcal calibrate --recipe`, `kvcal export bundle --recipe`)."""
    return [spec.name for spec in methods() if spec.bundle_format is not None]


def recipe(name: str) -> MethodSpec:
    if name not in recipes():
        raise KvcalError(f"unknown recipe {name!r}; choose one of {', '.join(recipes())}")
    return method(name)


def method_for_artifact(kind: str) -> MethodSpec | None:
    return next((spec for spec in methods() if spec.artifact_kind == kind), None)


def settings_metadata(spec: MethodSpec, settings) -> dict:
    """Typed settings as bundle metadata: {method, version, values}; settings_from_metadata reads it back."""
    return {"method": spec.name, "version": spec.settings_version, "values": asdict(settings)}


def settings_from_dict(cls: type, values):
    """An instance of dataclass `cls` from asdict() output, nested dataclasses included, or TypeError."""
    if not isinstance(values, dict) or set(values) != {f.name for f in fields(cls)}:
        raise TypeError(f"{cls.__name__} takes the fields {', '.join(f.name for f in fields(cls))}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: settings_from_dict(hints[name], value) if is_dataclass(hints[name]) else value for name, value in values.items()})


def settings_from_metadata(entry) -> object:
    """The typed, validated settings recorded by settings_metadata, or KvcalError naming what is wrong."""
    if not isinstance(entry, dict) or set(entry) != {"method", "version", "values"}:
        raise KvcalError("its settings metadata is malformed")
    spec = method(entry["method"])
    if spec.settings_type is None:
        raise KvcalError(f"method {spec.name} has no settings, yet settings are recorded")
    if entry["version"] != spec.settings_version:
        raise KvcalError(f"its {spec.name} settings are version {entry['version']!r}; this kvcal reads version {spec.settings_version}")
    try:
        settings = settings_from_dict(spec.settings_type, entry["values"])
        settings.validate()
    except (TypeError, ValueError) as exc:
        raise KvcalError(f"its {spec.name} settings are malformed ({exc})") from None
    return settings
