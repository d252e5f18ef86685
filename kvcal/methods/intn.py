"""Per-token integer quantization (`int`, the `eval ppl` baseline `intN[-gG]`): keys (post-RoPE) and values
per token, asymmetric min-max over groups of G channels (default 64), fp16 scale and zero per group."""

from __future__ import annotations

import re

from kvcal import registry
from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import LayerCodecs, TokenUniform
from kvcal.registry import MethodSpec
from kvcal.simulate import Method

DEFAULT_GROUP = 64
_BASELINE = re.compile(r"^int(\d+)(?:-g(\d+))?(-r\d+)?$")


class IntSpec(MethodSpec):
    name = "int"
    description = "per-token asymmetric intN over groups of G channels, no calibration (baseline)"

    def baseline_syntax(self):
        return "intN[-gG] (default G 64)"

    def baseline(self, text, num_layers, head_dim):
        match = _BASELINE.match(text)
        if match is None:
            return None
        if match.group(3):
            raise KvcalError(f"baseline '{text}': intN has no residual; use kiviN-gG-rR")
        bits, group = int(match.group(1)), int(match.group(2) or DEFAULT_GROUP)
        if bits not in (1, 2, 3, 4) or group < 1:
            raise KvcalError(f"baseline '{text}': bits must be 1-4 and the group size at least 1")
        layer = LayerCodecs(TokenUniform(bits, group), TokenUniform(bits, group), key_pre_rope=False)
        return Method(f"int{bits}-g{group}", bits, [layer] * num_layers, SegmentPolicy())


registry.register_method(IntSpec())
