"""Cocktail (`cocktail`, a runtime policy, no calibration and no bundle): the context is cut into chunks of
32 tokens and each chunk kept fp16, int4 or int2 by its similarity to the query (thresholds a = 0.6,
b = 0.1); int4/int2 chunks use KIVI's quantizers with G = the chunk for keys and 32 channels for values.
The planning and the cache live in kvcal.policy.cocktail; this spec holds the settings and codecs."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal import registry
from kvcal.errors import KvcalError
from kvcal.quantizers import ChannelBlockUniform, TokenUniform
from kvcal.registry import MethodSpec

WIDTHS = (16, 4, 2)  # fp16, int4, int2 chunks
VALUE_GROUP = 32


@dataclass(frozen=True)
class CocktailSettings:
    chunk: int = 32
    low: float = 0.6  # a: chunks below s_min + a (s_max - s_min) go to int2
    high: float = 0.1  # b: chunks above s_max - b (s_max - s_min) stay fp16

    def validate(self) -> None:
        if self.chunk < 1 or not 0 <= self.high <= 1 - self.low <= 1:
            raise KvcalError(f"Cocktail needs a chunk of at least 1 token and 0 <= b <= 1 - a <= 1 (got {self})")


def chunk_codecs(settings: CocktailSettings, keys: bool) -> dict:
    """The codec of each quantized chunk width, for keys or values."""
    return {bits: ChannelBlockUniform(bits, settings.chunk) if keys else TokenUniform(bits, VALUE_GROUP) for bits in WIDTHS[1:]}


class CocktailSpec(MethodSpec):
    name = "cocktail"
    description = "Cocktail: fp16/int4/int2 per 32-token chunk by similarity to the query (runtime policy, kvcal.policy.cocktail)"
    settings_type = CocktailSettings


registry.register_method(CocktailSpec())
