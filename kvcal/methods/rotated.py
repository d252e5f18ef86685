"""What the rotation baselines (kvcal.methods.hadamard, kvcal.methods.turbo) share: no calibration, keys
post-RoPE, one codec of kvcal.rotation_codecs for keys and values, nothing kept fp16."""

from __future__ import annotations

import re

from kvcal.kv import SegmentPolicy
from kvcal.quantizers import LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.simulate import Method


class RotatedBaseline(MethodSpec):
    """A baseline written `<prefix>N`: codec(N, head_dim) for keys and values."""

    prefix: str
    codec_type: type
    widths: str

    def baseline_syntax(self):
        return f"{self.prefix}N (N {self.widths})"

    def baseline(self, text, num_layers, head_dim):
        match = re.fullmatch(rf"{re.escape(self.prefix)}(\d+)", text)
        if match is None:
            return None
        codec = self.codec_type(int(match.group(1)), head_dim)
        return Method(text, codec.bits, [LayerCodecs(codec, codec, key_pre_rope=False)] * num_layers, SegmentPolicy())
