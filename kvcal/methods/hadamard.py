"""Hadamard-rotated per-token-head integers (`hadamard`, the `eval ppl` baseline `hadamard-intN`): each head
rotated by a seeded random-sign Hadamard transform, then asymmetric min-max intN per token-head with an
fp16 scale and zero (QuaRot-style; vLLM's int4_per_token_head after a rotation)."""

from __future__ import annotations

from kvcal import registry
from kvcal.methods.rotated import RotatedBaseline
from kvcal.rotation_codecs import HadamardInt


class HadamardIntSpec(RotatedBaseline):
    name = "hadamard"
    description = "random-sign Hadamard rotation per head, then per-token-head intN, fp16 scale + zero (baseline)"
    prefix, codec_type, widths = "hadamard-int", HadamardInt, "2-8"


registry.register_method(HadamardIntSpec())
