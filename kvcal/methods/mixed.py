"""KVmix widths on KVQuant codebooks (`mixed`): the profile's per-layer K/V widths (KVmix importance),
each layer with its own nuq codebooks (`kvcal fit-nuq --bits-from-profile`)."""

from __future__ import annotations

from kvcal import registry
from kvcal.errors import KvcalError
from kvcal.methods.kvquant import KvquantSpec
from kvcal.nuq import NuqSettings


class MixedSpec(KvquantSpec):
    name = "mixed"
    description = "KVmix per-layer widths on KVQuant codebooks (needs --nuq fit with --bits-from-profile)"
    fit_command = "kvcal fit-nuq --bits-from-profile"
    per_layer_widths = True

    def calibrate_settings(self, bits):
        if bits is not None:
            raise KvcalError("--bits does not apply to recipe mixed (its widths come from the profile's KVmix allocation); leave it out")
        return NuqSettings(bits_from_profile=True)


registry.register_method(MixedSpec())
