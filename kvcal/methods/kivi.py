"""KIVI (`kivi`, no calibration): keys per channel over blocks of G tokens, values per token over groups of
G channels, an fp16 residual of R tokens; as a bundle recipe and as the `eval ppl` baseline
`kiviN[-gG][-rR]`. Its layers use the `uniform` storage format defined here, which KVmix shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvcal import registry
from kvcal.bundle import LayerRecipe
from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.packing import layout_for, packed_words
from kvcal.quantizers import FP16_BITS, ChannelBlockUniform, LayerCodecs, TokenUniform
from kvcal.registry import LayerFormat, MethodSpec
from kvcal.simulate import Method

FP16_BYTES = FP16_BITS // 8


def kivi_layer(bits: int, group: int) -> LayerCodecs:
    """Keys per channel over blocks of `group` tokens, values per token over groups of `group` channels."""
    return LayerCodecs(ChannelBlockUniform(bits, group), TokenUniform(bits, group), key_pre_rope=False)


def kivi_policy(group: int, residual: int, sink: int = 0, window: int = 0) -> SegmentPolicy:
    """KIVI's segments: keys quantized per channel over blocks of `group` tokens wait fp16 for a whole block, unless an
    fp16 residual of `residual` tokens (a multiple of the group) keeps them until they fill blocks anyway."""
    return SegmentPolicy(sink=sink, window=window, residual=residual, key_block=0 if residual else group)


class UniformFormat(LayerFormat):
    """Min-max codes: keys per channel over blocks of G tokens (fp16 scale + zero per channel per block; keys
    wait fp16 for a whole block unless a residual flushes them), values per token over groups of G channels
    (fp16 scale + zero per group). Needs no bundle tensors."""

    name = "uniform"

    def problem(self, layer):
        if layer.group_size <= 0 or layer.sink != 0 or layer.residual % layer.group_size:
            return "uniform layers need a group size, no sink, and a residual that is a multiple of the group size"
        if layer.outliers or layer.fp8 or layer.pre_rope:
            return "uniform layers keep no outliers, store fp16 parameters and post-RoPE keys"
        return None

    def codecs(self, layer, tensors):
        return LayerCodecs(ChannelBlockUniform(int(layer.k_bits), layer.group_size), TokenUniform(int(layer.v_bits), layer.group_size),
                           False)

    def policy(self, layer):
        return kivi_policy(layer.group_size, layer.residual, layer.sink, layer.window)

    def body_block(self, layer, keys):
        return layer.group_size if keys else 1

    def body_bytes(self, layer, width, body, keys):
        bits = layer.k_bits if keys else layer.v_bits
        codes = packed_words(width, bits, layout_for(bits)) * 4
        if keys:
            return body * codes + (body // layer.group_size) * width * 2 * FP16_BYTES
        return body * (codes + math.ceil(width / layer.group_size) * 2 * FP16_BYTES)


UNIFORM = registry.register_format(UniformFormat())


@dataclass(frozen=True)
class KiviSettings:
    bits: int = 2
    group: int = 32
    residual: int = 128

    def validate(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (1, 2, 3, 4):
            raise KvcalError(f"KIVI bits {self.bits!r} is not one of 1, 2, 3, 4")
        if self.group < 1:
            raise KvcalError(f"KIVI group size must be at least 1 (got {self.group})")
        if self.residual < 0 or self.residual % self.group:
            raise KvcalError(f"KIVI residual {self.residual} must be a multiple of the group size {self.group}")

    @property
    def label(self) -> str:
        return f"kivi{self.bits}-g{self.group}-r{self.residual}"


_BASELINE = re.compile(r"^kivi(\d+)(?:-g(\d+))?(?:-r(\d+))?$")


class KiviSpec(MethodSpec):
    name = "kivi"
    description = "KIVI, no calibration: K per channel over G-token blocks, V per token, fp16 residual R"
    settings_type = KiviSettings
    bundle_format = UNIFORM.name

    def calibrate_settings(self, bits):
        settings = KiviSettings() if bits is None else KiviSettings(bits=bits)
        settings.validate()
        return settings

    def bundle_settings(self, profile_config, fitted, settings):
        return settings or KiviSettings()

    def bundle_layers(self, profile, profile_config, fitted, settings):
        settings = settings or KiviSettings()
        settings.validate()
        num_layers = profile_config["model"]["fingerprint"]["num_layers"]
        layers = [LayerRecipe(UNIFORM.name, settings.bits, settings.bits, False, group_size=settings.group, residual=settings.residual)
                  for _ in range(num_layers)]
        return layers, {}

    def baseline_syntax(self):
        return "kiviN[-gG][-rR] (defaults G 32, R 128)"

    def baseline(self, text, num_layers, head_dim):
        match = _BASELINE.match(text)
        if match is None:
            return None
        bits, group, residual = (int(g) if g else None for g in match.groups())
        settings = KiviSettings(bits, KiviSettings.group if group is None else group,
                                KiviSettings.residual if residual is None else residual)
        try:
            settings.validate()
        except KvcalError as exc:
            raise KvcalError(f"baseline '{text}': {exc}") from None
        return Method(settings.label, settings.bits, [kivi_layer(settings.bits, settings.group)] * num_layers,
                      kivi_policy(settings.group, settings.residual))


registry.register_method(KiviSpec())
