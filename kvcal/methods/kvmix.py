"""KVmix (`kvmix`): the profile's per-layer K/V widths and recent-pivotal-context ratios (from the gradient
importance of W_k, W_v; kvcal.fit.kvmix) on KVmix's uniform quantizer: K per channel over blocks of 32 tokens,
V per token over groups of 32 channels, in the `uniform` storage format."""

from __future__ import annotations

from kvcal import registry
from kvcal.bundle import LayerRecipe
from kvcal.errors import KvcalError
from kvcal.methods.kivi import UNIFORM
from kvcal.profile import KvmixSettings
from kvcal.registry import MethodSpec, settings_from_dict

GROUP = 32


class KvmixSpec(MethodSpec):
    name = "kvmix"
    description = "KVmix: the profile's per-layer widths and RPC ratios on a uniform quantizer (no fit)"
    bundle_format = UNIFORM.name
    settings_type = KvmixSettings  # the allocation the profile was made with (kvcal profile-gradients)

    def calibrate_settings(self, bits):
        if bits is not None:
            raise KvcalError("--bits does not apply to recipe kvmix (its widths come from the profile's KVmix allocation); leave it out")
        return None

    def bundle_settings(self, profile_config, fitted, settings):
        return settings_from_dict(KvmixSettings, profile_config["kvmix"])

    def bundle_layers(self, profile, profile_config, fitted, settings):
        bits_k, bits_v = profile["kvmix.bits.k"].tolist(), profile["kvmix.bits.v"].tolist()
        rpc_k, rpc_v = ([round(r, 6) for r in profile[f"kvmix.rpc.{kind}"].tolist()] for kind in ("k", "v"))  # float32 -> 0.1, not 0.10000000149
        layers = [LayerRecipe(UNIFORM.name, bits_k[i], bits_v[i], False, group_size=GROUP, rpc_k=rpc_k[i], rpc_v=rpc_v[i])
                  for i in range(len(bits_k))]
        return layers, {}


registry.register_method(KvmixSpec())
