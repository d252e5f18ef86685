"""The cache classes a model's decoder takes, and the argument it takes them by: transformers' own, or where the decoder
refuses any cache but a class of its own (MiniMax-Text-01 and MiniMax-M1: MiniMaxCache), a subclass that is one too and
keeps the decoder's recurrent states in its cache layers, as the other hybrids' states are kept, so that kvcal's caches
hold, copy and reset them alike (`taking`)."""

from __future__ import annotations

import functools

from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin

from kvcal.version import transformers_from

# The keyword models, generate() and model outputs name the cache by: transformers 5.24 renamed `past_key_values` to
# `cache` (the old name is deprecated there, with a warning, and goes in 5.40).
CACHE_ARGUMENT = "cache" if transformers_from(5, 24) else "past_key_values"


def cache_argument(cache) -> dict:
    """The keyword arguments that hand `cache` to a model's forward or generate()."""
    return {CACHE_ARGUMENT: cache}


class LightningStates:
    """MiniMax's cache interface over cache layers: a lightning attention layer's state (its decayed K^T V) is its
    LinearAttentionLayer's recurrent state, None until a forward sets it. MiniMaxCache's own keeps them in a list
    beside its layers, which it indexes by the number of layers (so never past the first forward's)."""

    def get_linear_cache(self, layer_idx: int):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(layer, LinearAttentionCacheLayerMixin) or not layer.is_recurrent_states_initialized[0]:
            return None
        return layer.recurrent_states[0]

    def set_linear_cache(self, layer_idx: int, state) -> None:
        self.layers[layer_idx].update_recurrent_state(state)

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens the cache holds, counted by its first attention layer where `layer_idx` is a lightning layer:
        MiniMax's set their states whole and count no tokens (from transformers 5.24 a linear layer counts those its
        model reports, and MiniMax's report none), so the decoder would place its next tokens from position 0."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], LinearAttentionCacheLayerMixin):
            layer_idx = next(i for i, layer in enumerate(self.layers)
                             if not isinstance(layer, LinearAttentionCacheLayerMixin))
        return Cache.get_seq_length(self, layer_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        Cache.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices) -> None:
        Cache.batch_select_indices(self, indices)


def _minimax_cache() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache


# model type -> the cache class its decoder refuses any other cache than (an instance of it)
OWN_CACHES = {"minimax": _minimax_cache}


@functools.cache
def taking(cache_class: type, model_type: str) -> type:
    """`cache_class` (DynamicCache or a subclass of Cache) as a decoder of `model_type` takes it: itself, or a subclass
    that is the model's own cache class too (LightningStates its interface where `cache_class` has none of its own:
    kvcal's batch edits of its layers before MiniMaxCache's, which edit a list of states kvcal does not keep). A Cache
    subclass given here calls its base's __init__ by name, not through super(): the model's class comes after it in
    the subclass's order."""
    own = OWN_CACHES.get(model_type)
    if own is None:
        return cache_class
    own = own()
    if cache_class is DynamicCache:  # (the model's class is already one)
        return type(f"{own.__name__}OnLayers", (LightningStates, own), {"__init__": DynamicCache.__init__})
    return type(f"{own.__name__}{cache_class.__name__}", (cache_class, LightningStates, own), {})


def model_cache(model) -> DynamicCache:
    """An empty DynamicCache of `model`'s layers (as generate() makes one) that its decoder takes."""
    return taking(DynamicCache, model.config.model_type)(config=model.config)
