"""KVQuant (`kvquant`): non-uniform per-layer codebooks (nuqX) fit offline by `kvcal fit-nuq`, pre-RoPE
per-channel key thresholds, per-token value thresholds, dense-and-sparse outliers and an fp16 sink.
Its bundle layers use the `nuq` storage format defined here."""

from __future__ import annotations

from dataclasses import fields

from kvcal import registry
from kvcal.bundle import LayerRecipe
from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.fit.nuq import MAX_BITS, NUQ_KIND, NuqSettings, fit_nuq, nuq_layer, nuq_layers, nuq_name
from kvcal.packing import layout_for, packed_words
from kvcal.quantizers import FP16_BITS
from kvcal.registry import ArtifactSummary, LayerFormat, MethodSpec
from kvcal.simulate import Method

FP16_BYTES = FP16_BITS // 8


class NuqFormat(LayerFormat):
    """Codebook codes; keys with per-channel thresholds (bundle tensors lo, hi) or per-token ones, values with
    per-token thresholds (fp16 lo + hi per token); outliers (counted apart)."""

    name = "nuq"
    code_widths = tuple(range(1, MAX_BITS + 1))

    def problem(self, layer):
        return "nuq layers store fp16 parameters, not fp8" if layer.fp8 else None

    def tensor_schema(self, layer, kind, width):
        bits = int(layer.k_bits if kind == "k" else layer.v_bits)
        schema = {"codebook": ((2**bits,), "float32")}
        if kind == "k" and layer.key_granularity == "channel":
            schema |= {"lo": ((width,), "float32"), "hi": ((width,), "float32")}
        return schema

    def tensor_problem(self, layer, kind, tensors):
        """What the encoders and kernels read as sorted and ordered: a codebook in ascending order (k-means can give
        equal signposts), per-channel thresholds lo <= hi (equal for a channel that was constant in calibration)."""
        codebook = tensors["codebook"]
        if bool((codebook[1:] < codebook[:-1]).any()):
            return "its codebook is not in ascending order"
        if "lo" in tensors and bool((tensors["lo"] > tensors["hi"]).any()):
            return "a channel's lower threshold lo is above its upper threshold hi"
        return None

    def codecs(self, layer, tensors):
        return nuq_layer(tensors["k.codebook"], tensors["v.codebook"], tensors.get("k.lo"), tensors.get("k.hi"), layer.outliers,
                         layer.pre_rope)

    def policy(self, layer):
        return SegmentPolicy(sink=layer.sink, window=layer.window, residual=layer.residual)

    def body_bytes(self, layer, width, body, keys):
        bits = layer.k_bits if keys else layer.v_bits
        per_token_thresholds = not keys or layer.key_granularity == "token"
        return body * (packed_words(width, bits, layout_for(bits)) * 4 + (2 * FP16_BYTES if per_token_thresholds else 0))


NUQ = registry.register_format(NuqFormat())


def _codebook(tensor) -> str:
    return " ".join(f"{value:+.2f}" for value in tensor.tolist())


class KvquantSpec(MethodSpec):
    name = "kvquant"
    description = "KVQuant nuqX: Fisher-weighted codebooks, pre-RoPE per-channel keys, 1% outliers, fp16 sink (needs --nuq)"
    settings_type = NuqSettings
    artifact_kind = NUQ_KIND
    bundle_format = NUQ.name
    fit_command = "kvcal fit-nuq"
    per_layer_widths = False  # mixed: per-layer widths (fit-nuq --target-bits, or --bits-from-profile)
    settings_version = 3  # 2: NuqSettings.target_bits, 3: NuqSettings.window

    def calibrate_settings(self, bits):
        return NuqSettings(bits=3 if bits is None else bits)

    def fit(self, profile_path, settings, on_layer=None):
        return fit_nuq(profile_path, settings, on_layer)

    def bundle_settings(self, profile_config, fitted, settings):
        nuq = fitted[1]["nuq"]
        return NuqSettings(**{f.name: nuq[f.name] for f in fields(NuqSettings) if f.name in nuq})

    def bundle_layers(self, profile, profile_config, fitted, settings):
        tensors, config = fitted
        nuq = config["nuq"]
        if self.bundle_settings(profile_config, fitted, settings).per_layer_widths != self.per_layer_widths:
            raise KvcalError(f"recipe {self.name} needs a nuq artifact fit {'with' if self.per_layer_widths else 'without'} "
                             "per-layer widths (--bits-from-profile or --target-bits)")
        layers = [LayerRecipe(NUQ.name, nuq["bits_k"][i], nuq["bits_v"][i], nuq["key_rope"] == "pre", sink=nuq["sink"],
                              window=nuq.get("window", 0), outliers=nuq["outliers"], key_granularity=nuq["key_granularity"])
                  for i in range(len(nuq["bits_k"]))]
        return layers, tensors

    def artifact_method(self, tensors, config, path):
        nuq = config["nuq"]
        bits = nuq["bits_k"] + nuq["bits_v"]
        policy = SegmentPolicy(sink=nuq["sink"], window=nuq.get("window", 0))  # artifacts fit before --window have none
        return Method(nuq_name(nuq), sum(bits) / len(bits), nuq_layers(tensors, config, path), policy,
                      fingerprint=config["model"]["fingerprint"])

    def summarize_artifact(self, tensors, config):
        nuq = config["nuq"]
        settings = (f"outliers {nuq['outliers']:.2%}, sink {nuq['sink']}, window {nuq.get('window', 0)}, "
                    f"keys {nuq['key_rope']}-RoPE per-{nuq['key_granularity']}, codebook {nuq['codebook']}, "
                    f"weighting {nuq['weighting']}, Q-Norm {nuq['qnorm']}")
        if nuq.get("knapsack"):  # widths chosen by fit-nuq --target-bits
            chosen = [nuq["knapsack"][f"{i}.{kind}"][str(b)][1] for kind in ("k", "v") for i, b in enumerate(nuq[f"bits_{kind}"])]
            settings += f"; widths: Fisher knapsack to {nuq['target_bits']:g} real bits, chosen {sum(chosen) / len(chosen):.3f}"
        rows = [[str(i), str(nuq["bits_k"][i]), str(nuq["bits_v"][i]), _codebook(tensors[f"layers.{i}.k.codebook"]),
                 _codebook(tensors[f"layers.{i}.v.codebook"])] for i in range(len(nuq["bits_k"]))]
        return ArtifactSummary(NUQ_KIND, [("settings", settings)], ["layer", "bits K", "bits V", "K codebook", "V codebook"], rows)


registry.register_method(KvquantSpec())
