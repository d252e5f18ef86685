"""SKVQ (`skvq`): channels reordered by KMeans into unequal groups, clipped per-token group quantization,
an fp16 sliding window and sinks, optional FP8 parameters; fit by `kvcal fit-skvq`. Its bundle layers
use the `skvq` storage format defined here."""

from __future__ import annotations

import math

import torch

from kvcal import registry
from kvcal.bundle import LayerRecipe
from kvcal.kv import SegmentPolicy
from kvcal.packing import layout_for, packed_words
from kvcal.registry import ArtifactSummary, LayerFormat, MethodSpec
from kvcal.simulate import Method
from kvcal.fit.skvq import SKVQ_KIND, TERNARY, SkvqSettings, SkvqTensor, fit_skvq, skvq_layer, skvq_layers, skvq_name


def _groups(layer, width: int) -> int:
    return math.ceil(width / layer.group_size)


class SkvqFormat(LayerFormat):
    """Codes in permuted channel order (bundle tensors perm, group_start), a scale and zero per (token, group)
    in fp16 or fp8, per-group clipping scales (clip); 1.5-bit values are ternary."""

    name = "skvq"
    code_widths = (1, TERNARY, 2, 3, 4)

    def problem(self, layer):
        if layer.group_size <= 0:
            return "skvq layers need a group size"
        if layer.outliers or not layer.pre_rope:
            return "skvq layers keep no outliers and store keys pre-RoPE"
        return None

    def tensor_schema(self, layer, kind, width):
        groups = _groups(layer, width)
        return {"perm": ((width,), "int32"), "group_start": ((groups + 1,), "int32"), "clip": ((groups,), "float32")}

    def tensor_problem(self, layer, kind, tensors):
        perm, starts = tensors["perm"], tensors["group_start"]
        width = perm.numel()
        if not torch.equal(perm.sort().values, torch.arange(width, dtype=torch.int32)) or starts[0] != 0 \
                or starts[-1] != width or bool((starts[1:] <= starts[:-1]).any()):
            return "permutation or group bounds are invalid"
        if not bool(torch.isfinite(tensors["clip"]).all()) or bool((tensors["clip"] <= 0).any()):
            return "clipping scales are not positive finite numbers"
        return None

    def codecs(self, layer, tensors):
        return skvq_layer(*(SkvqTensor(tensors[f"{k}.perm"], tensors[f"{k}.group_start"], tensors[f"{k}.clip"], bits, layer.fp8)
                            for k, bits in (("k", layer.k_bits), ("v", layer.v_bits))))

    def policy(self, layer):
        return SegmentPolicy(sink=layer.sink, window=layer.window, residual=layer.residual)

    def body_bytes(self, layer, width, body, keys):
        bits = layer.k_bits if keys else layer.v_bits
        return body * (packed_words(width, bits, layout_for(bits)) * 4 + _groups(layer, width) * 2 * (1 if layer.fp8 else 2))


SKVQ = registry.register_format(SkvqFormat())


class SkvqSpec(MethodSpec):
    name = "skvq"
    description = "SKVQ: channel reorder, clipped groups, fp16 window and sinks, optional FP8 parameters (needs --skvq)"
    settings_type = SkvqSettings
    artifact_kind = SKVQ_KIND
    bundle_format = SKVQ.name
    fit_command = "kvcal fit-skvq"

    def calibrate_settings(self, bits):
        return SkvqSettings() if bits is None else SkvqSettings(kbits=bits, vbits=bits)

    def fit(self, profile_path, settings, on_layer=None):
        return fit_skvq(profile_path, settings, on_layer)

    def bundle_settings(self, profile_config, fitted, settings):
        return SkvqSettings(**fitted[1]["skvq"])

    def bundle_layers(self, profile, profile_config, fitted, settings):
        tensors, config = fitted
        s = config["skvq"]
        num_layers = config["model"]["fingerprint"]["num_layers"]
        layers = [LayerRecipe(SKVQ.name, s["kbits"], s["vbits"], True, group_size=s["group_size"], window=s["window"], sink=s["sink"],
                              fp8=s["fp8"], key_granularity="token") for _ in range(num_layers)]
        return layers, tensors

    def artifact_method(self, tensors, config, path):
        settings = SkvqSettings(**config["skvq"])
        return Method(skvq_name(settings), (settings.kbits + settings.vbits) / 2, skvq_layers(tensors, config, path), settings.policy,
                      fingerprint=config["model"]["fingerprint"])

    def summarize_artifact(self, tensors, config):
        s = config["skvq"]
        settings = (f"K{s['kbits']:g} V{s['vbits']:g}, group {s['group_size']}, window {s['window']}, sink {s['sink']}, "
                    f"clip {s['clip']}, reorder {s['reorder']}, fp8 {s['fp8']}")
        rows = []
        for i in range(config["model"]["fingerprint"]["num_layers"]):
            cells = [str(i)]
            for kind in ("k", "v"):
                starts = tensors[f"layers.{i}.{kind}.group_start"]
                cells += [" ".join(map(str, (starts[1:] - starts[:-1]).tolist())),
                          " ".join(f"{a:.2f}" for a in tensors[f"layers.{i}.{kind}.clip"].tolist())]
            rows.append(cells)
        return ArtifactSummary(SKVQ_KIND, [("settings", settings)], ["layer", "K group sizes", "K clip", "V group sizes", "V clip"], rows)


registry.register_method(SkvqSpec())
