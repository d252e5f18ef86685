"""Built-in baselines that need no calibration, parsed from specs such as `int4`, `int2-g64`,
`kivi2`, `kivi2-g64-r128`:
- intN[-gG]: keys (post-RoPE) and values per token, asymmetric min-max over groups of G channels (64).
- kiviN[-gG][-rR]: KIVI, keys per channel over blocks of G tokens, values per token over groups of G
  channels (G = 32), fp16 residual of R tokens (128, R % G == 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvcal.errors import KvcalError
from kvcal.quantizers import ChannelBlockUniform, TokenUniform
from kvcal.simulate import LayerCodecs, Method, SegmentPolicy

_SPEC = re.compile(r"^(int|kivi)([1-4])(?:-g(\d+))?(?:-r(\d+))?$")
DEFAULT_GROUP = {"int": 64, "kivi": 32}
DEFAULT_RESIDUAL = 128


def per_token_layer(bits: int, group: int) -> LayerCodecs:
    return LayerCodecs(TokenUniform(bits, group), TokenUniform(bits, group), key_pre_rope=False)


def kivi_layer(bits: int, group: int) -> LayerCodecs:
    """KIVI: keys per channel over blocks of `group` tokens, values per token over groups of `group` channels."""
    return LayerCodecs(ChannelBlockUniform(bits, group), TokenUniform(bits, group), key_pre_rope=False)


@dataclass(frozen=True)
class BaselineSpec:
    family: str
    bits: int
    group: int
    residual: int = 0

    def method(self, num_layers: int) -> Method:
        if self.family == "int":
            return Method(f"int{self.bits}-g{self.group}", self.bits, [per_token_layer(self.bits, self.group)] * num_layers,
                          SegmentPolicy())
        return Method(f"kivi{self.bits}-g{self.group}-r{self.residual}", self.bits,
                      [kivi_layer(self.bits, self.group)] * num_layers, SegmentPolicy(residual=self.residual))


def parse_baseline(spec: str) -> BaselineSpec:
    match = _SPEC.match(spec.strip())
    if match is None:
        raise KvcalError(f"unknown baseline '{spec}'; use intN[-gG] or kiviN[-gG][-rR] with N in 1-4, e.g. int4-g64, kivi2-g32-r128")
    family, bits, group, residual = match.group(1), int(match.group(2)), match.group(3), match.group(4)
    group = int(group) if group else DEFAULT_GROUP[family]
    if group < 1:
        raise KvcalError(f"baseline '{spec}': group size must be at least 1")
    if family == "int":
        if residual:
            raise KvcalError(f"baseline '{spec}': intN has no residual; use kiviN-gG-rR")
        return BaselineSpec(family, bits, group)
    residual = int(residual) if residual else DEFAULT_RESIDUAL
    if residual % group:
        raise KvcalError(f"baseline '{spec}': the residual {residual} must be a multiple of the group size {group}")
    return BaselineSpec(family, bits, group, residual)


def baseline_method(spec: str, num_layers: int) -> Method:
    return parse_baseline(spec).method(num_layers)
