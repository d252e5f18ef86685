"""Architecture adapters: what kvcal hooks in a loaded transformers model, found by structure; nothing here forks a
modeling file.

Every served model's attention is q/k/v/o projections and RoPE as kvcal.rope computes it, up to the order of each
head's channels. `adapt(model)` reads, per layer of the cache, where the pre-RoPE query and key and the value come
out, each layer's RoPE frequencies and channel order, its window or chunk, and what the decoder holds besides KV caches
(recurrent states, layers reading another's cache, cross-attention); anything it cannot read it refuses in one line
naming what is missing. tests/test_adapters.py checks every served type's reading against the model's own cached keys.

- model_types: the types kvcal serves, and a table for each trait of theirs the modules do not show;
- handles: where a layer's query, key and value come out (LayerHandles; MLA's LatentAttention);
- rotary: the model's RoPE as kvcal stores it;
- adapter: adapt() and the ModelAdapter the rest of kvcal holds of a model;
- fingerprint: what an artifact's record of its model says without the model.

Which type has which trait, and what kvcal does about each, is in docs/models.md.
"""

from kvcal.adapters.adapter import ModelAdapter, adapt, chunk_positions, decoder_of, prefix_lm, text_inputs
from kvcal.adapters.fingerprint import (attention_sinks, attention_softcap, decoder_kind, first_position, index_key_bytes,
                                        index_widths, kv_shapes, kv_widths, latent_attention, query_heads, rope_orders,
                                        score_scale)
from kvcal.adapters.handles import LatentAttention, LayerHandles
from kvcal.adapters.model_types import (LATENT_ATTENTION_TYPES, SUPPORTED_MODEL_TYPES, served_by_installed_transformers,
                                        served_types)

__all__ = ["LATENT_ATTENTION_TYPES", "SUPPORTED_MODEL_TYPES", "LatentAttention", "LayerHandles", "ModelAdapter", "adapt",
           "attention_sinks", "attention_softcap", "chunk_positions", "decoder_kind", "decoder_of", "first_position",
           "index_key_bytes", "index_widths", "kv_shapes", "kv_widths", "latent_attention", "prefix_lm", "query_heads",
           "rope_orders", "score_scale", "served_by_installed_transformers", "served_types", "text_inputs"]
