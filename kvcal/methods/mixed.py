"""Mixed widths on KVQuant codebooks (`mixed`): each layer's K and V width (2-4) chosen by a Fisher-weighted
knapsack to a budget of real bits per element (`kvcal fit-nuq --target-bits`, kvcal.fit.nuq), each layer with its
own nuq codebooks. Artifacts with the profile's KVmix widths (`--bits-from-profile`) make bundles too: on
SmolLM2 the knapsack matched their perplexity at 0.13 fewer real bits (see README), hence the default."""

from __future__ import annotations

from kvcal import registry
from kvcal.methods.kvquant import KvquantSpec
from kvcal.fit.nuq import NuqSettings

DEFAULT_TARGET_BITS = 3.0  # real bits per element of the quantized body


class MixedSpec(KvquantSpec):
    name = "mixed"
    description = "per-layer K/V widths on KVQuant codebooks by a Fisher knapsack to --bits real bits (needs --nuq fit with --target-bits)"
    fit_command = "kvcal fit-nuq --target-bits"
    per_layer_widths = True

    def calibrate_settings(self, bits):
        return NuqSettings(target_bits=DEFAULT_TARGET_BITS if bits is None else float(bits))


registry.register_method(MixedSpec())
