"""TurboQuant-style codebooks (`turbo`, the `eval ppl` baseline `turboN`): each head rotated by a seeded
random-sign Hadamard transform, an fp16 L2 norm per token-head, and the unit vector's coordinates coded
with the Lloyd-Max codebook of N(0, 1/head_dim)."""

from __future__ import annotations

from kvcal import registry
from kvcal.methods.rotated import RotatedBaseline
from kvcal.rotation_codecs import TurboQuant


class TurboSpec(RotatedBaseline):
    name = "turbo"
    description = "rotation + Lloyd-Max codebook per coordinate + fp16 norm per token-head, TurboQuant-style (baseline)"
    prefix, codec_type, widths = "turbo", TurboQuant, "1-4"


registry.register_method(TurboSpec())
