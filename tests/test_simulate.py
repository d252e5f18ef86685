"""The simulated quantization against an independent step-by-step decode of the same cache policy."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from helpers.tiny_models import (DSA, GEMMA4, GEMMA4_READERS_ON_KEPT_TOKENS, GLM5_NEXT, LATENT, MINIMAX_M3, OWN_ATTENTION,
                                 TINY_ARCHITECTURES, known, tiny_latent_widths, tiny_model)
from kvcal.adapters import adapt, text_inputs
from kvcal.errors import KvcalError
from kvcal.indexer_keys import round_trip, token_bytes
from kvcal.kv import SegmentPolicy, as_cached
from kvcal.methods import baseline_method
from kvcal.methods.kivi import kivi_layer
from kvcal.model_caches import cache_argument
from kvcal.quantizers import LayerCodecs, Quantized, uniform_per_channel, uniform_per_token
from kvcal.simulate import Method, StorageTally, SimulatedLayer, indexer_keys_kept_as, simulated


class Identity:
    def quantize(self, x):
        return Quantized(x.clone(), torch.full((x.shape[0],), 16.0 * x.shape[1]))


IDENTITY = LayerCodecs(Identity(), Identity(), key_pre_rope=True)


@GEMMA4_READERS_ON_KEPT_TOKENS
def test_the_simulation_refuses_gemma4_reading_layers_run_on_the_kept_logits_tokens_alone():
    """Gemma 4 runs its layers reading another's cache on the last logits_to_keep tokens only: the simulation, which
    scores every token, refuses that rather than attend with queries out of line with the tokens read."""
    model = tiny_model("gemma4_text")
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), simulated(model, adapt(model), Method("id", 16, [IDENTITY] * 2, SegmentPolicy()),
                                           StorageTally()):
        assert model(ids).logits.shape[1] == 20
        with pytest.raises(KvcalError, match="got 1 queries over 20 keys.*logits_to_keep=0"):
            model(ids, logits_to_keep=1)


def test_identity_scheme_reproduces_the_fp_model_for_every_architecture():
    """Pre-RoPE keys rotated again by kvcal give the model's own: where the key comes from (k_norm, seen heads first on
    Gemma 3) and each layer's frequencies (Gemma 3's two layer types) are right."""
    for model_type in TINY_ARCHITECTURES:
        model = tiny_model(model_type)
        ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
        text = text_inputs(model, ids)  # (PaliGemma's text read causally, as what it writes)
        with torch.inference_mode():
            expected = model(ids, **text).logits
            with simulated(model, adapt(model), Method("id", 16, [IDENTITY] * 2, SegmentPolicy(sink=1)), StorageTally()) as tally:
                got = model(ids, **text).logits
        # the cache holds K/V in fp16 (Gemma 3n: 7e-4, its layers reading another's cache see them rounded too; 6e-7 in fp32;
        # Gemma 4: up to 2.1e-3, Gemma 4 Unified: 2.7e-3, as much as their fp models' logits move with K/V alone rounded
        # to fp16 in transformers' own cache)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol={"gemma3n_text": 1e-3, **dict.fromkeys(GEMMA4, 3e-3)}.get(model_type, 5e-4),
                                   msg=lambda message: f"{model_type}: {message}")
        assert tally.key_bits + tally.value_bits == 16 * (tally.key_elements + tally.value_elements)
        # (the indexer keys, kept as computed: MiniMax-M3's layer 0's, Qwen4-Exp's two layers')
        indexed = 1 if model_type in MINIMAX_M3 else 2 if model_type in ("qwen4_exp_text", "qwen4_exp") else 0
        assert tally.index_elements == indexed * 2 * 33 * 16
        assert model.config._attn_implementation == OWN_ATTENTION.get(model_type, "sdpa")


class _RoundedCache(DynamicCache):
    """transformers' cache holding what it is handed rounded to fp16, as kvcal's caches hold it."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(as_cached(key_states).float(), as_cached(value_states).float(), layer_idx, *args, **kwargs)


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_simulated_unquantized_is_the_models_own(model_type):
    """MLA in the simulation (kvcal.adapters.LatentAttention: scores over the latent by the query's absorbed part, plus
    over the rotated key; outputs by W_UV of the latent's mix) gives the model's logits, within what rounding its cache
    to fp16 moves them (MiniCPM3 and Youtu: 2e-3 on logits up to 13); DeepSeek Sparse Attention's over the 8 tokens of
    33 its indexer picks for each query."""
    model = tiny_model(model_type)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits
        rounded = model(ids, **cache_argument(_RoundedCache(config=model.config)), use_cache=True).logits
        method = Method("id", 16, [IDENTITY] * len(adapt(model).layers), SegmentPolicy(sink=1))
        with simulated(model, adapt(model), method, StorageTally()) as tally:
            got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=max(5e-4, 1.5 * float((rounded - expected).abs().max())))
    assert tally.key_bits + tally.value_bits == 16 * tally.elements
    assert model.config._attn_implementation == OWN_ATTENTION.get(model_type, "sdpa")
    # DeepSeek Sparse Attention's indexer keys, kept as this float32 model computes them (Hy V4: layer 0's alone)
    index_width = sum(tiny_latent_widths(model_type)[2])
    assert (tally.index_bits, tally.index_elements) == (32 * 2 * 33 * index_width, 2 * 33 * index_width)


@pytest.mark.parametrize("model_type", MINIMAX_M3)
def test_block_sparse_attention_simulated_unquantized_is_the_models_own(model_type):
    """MiniMax-M3's block-sparse layer in the simulation, each query over the 2 blocks of 4 keys its indexer picked for
    its KV head (of 33 tokens' 9), gives the model's logits, which the same weights picking 64 blocks do not; its
    indexer keys (16 channels, layer 0's alone) are counted kept as this float32 model computes them."""
    model = tiny_model(model_type)
    ids = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits
        dense = tiny_model(model_type, index_topk_blocks=64)(ids).logits
        with simulated(model, adapt(model), Method("id", 16, [IDENTITY] * 2, SegmentPolicy(sink=1)), StorageTally()) as tally:
            got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=5e-4)
    assert (dense - expected).abs().max() > 0.1
    assert (tally.index_bits, tally.index_elements) == (32 * 2 * 33 * 16, 2 * 33 * 16)


@pytest.mark.parametrize("model_type", DSA[:1] + MINIMAX_M3[:1] + known(("qwen4_exp_text",)) + GLM5_NEXT)
def test_indexer_keys_simulated_in_fp8_are_picked_from_as_the_cache_keeps_them(model_type):
    """A method keeping indexer keys in FP8 (kvcal.indexer_keys): the simulation's indexers pick from their keys rounded
    so, the model's logits where transformers' own cache hands them back rounded so (and its K/V rounded to fp16, as
    kvcal's), or, without a cache, indexer_keys_kept_as hands back the window's keys rounded so; they differ from those
    of keys kept as computed; the tally counts e4m3 codes and one fp32 scale a token and layer."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    ids = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(1))
    method = Method("id", 16, [IDENTITY] * 2, SegmentPolicy(sink=1), indexer_keys="fp8")
    with torch.inference_mode():
        with indexer_keys_kept_as(adapter, "fp8"):
            expected = model(ids, **cache_argument(_RoundedCache(config=model.config)), use_cache=True).logits
            without_cache = model(ids, use_cache=False).logits
        as_computed = model(ids, **cache_argument(_RoundedCache(config=model.config)), use_cache=True).logits
        with simulated(model, adapter, method, StorageTally()) as tally:
            got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=5e-4)
    torch.testing.assert_close(without_cache, expected, rtol=1e-3, atol=5e-4)  # (a window's keys handed back rounded)
    assert (as_computed - expected).abs().max() > 0.01
    widths = [width for width in adapter.index_widths if width]
    assert tally.index_bits == 8 * 2 * 33 * sum(token_bytes("fp8", width, 4) for width in widths)
    assert tally.index_elements == 2 * 33 * sum(widths)


def _written_as_the_simulation_reads(model, adapter, method, ids):
    """(the simulation's tally, a QuantizedOnWrite cache prefilled with ids but the last, one loaded with their fp
    context, the simulation's logits), after checking that a QuantizedOnWrite cache prefilled with 12 of the 40 ids,
    then decoding token by token, gives the simulation's logits at every position."""
    from kvcal.runtime.fp_context import fp_context
    from kvcal.simulate import QuantizedOnWrite

    with torch.inference_mode():
        with simulated(model, adapter, method, StorageTally()) as tally:
            expected = model(ids).logits
        cache = QuantizedOnWrite(model, method)
        steps = [model(ids[:, :12], **cache_argument(cache), use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True).logits for t in range(12, 40)]
        prefilled, loaded = QuantizedOnWrite(model, method), QuantizedOnWrite(model, method)
        model(ids[:, :39], **cache_argument(prefilled), use_cache=True)
        loaded.load(fp_context(model, ids[:, :39]))
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=0, atol=1e-4)
    return tally, prefilled, loaded, expected


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_quantized_on_write_decodes_what_the_simulation_evaluates(model_type):
    """transformers' own MLA over a cache quantizing each token as written (QuantizedOnWrite: its latent with the value
    codec, its rotated key with the key codec, in the model's channel order as the engine stores it), prefilled then
    decoding token by token, gives the simulation's logits at every position; a context loaded into it stores its
    first layer as a prefill through it does (its ggml blocks of 32 channels split the key as the engine does; DeepSeek
    Sparse Attention's indexer keys too). Effective
    bits weigh each tensor by its width: q8_0 keys (8.5 bits, 64 channels) beside q4_0 latents (4.5 bits, 96 channels)
    store 6.1 bits per element."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    method = baseline_method("q8_0/q4_0", adapter.head_dims, adapter.windows, value_dims=adapter.value_dims)
    # (Kimi K2.5's composite reads its image and video token ids as no token; the context's prefill, its decoder alone,
    # as any: text here)
    ids = torch.randint(0, 508 if model_type == "kimi_k25" else 512, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        fp_logits = model(ids).logits
    tally, prefilled, loaded, expected = _written_as_the_simulation_reads(model, adapter, method, ids)
    assert not torch.allclose(fp_logits, expected, atol=1e-3)
    first = adapter.model_layers[0]  # (Kimi Linear's after a KDA layer, which nothing quantized reaches)
    assert torch.equal(loaded.layers[first].keys, prefilled.layers[first].keys)
    assert torch.equal(loaded.layers[first].values, prefilled.layers[first].values)
    ours, theirs = (getattr(cache.layers[first], "indexer_keys", None) for cache in (loaded, prefilled))  # (DSA's)
    assert (ours is None) == (theirs is None) and (ours is None or torch.equal(ours, theirs))
    # (DeepSeek Sparse Attention's also its indexer keys of 80 channels, kept as this float32 model computes them; Hy
    # V4's in one of its two layers; Mistral Large 4's layer 1 has no rotated key; dots.note3's sliding layers keep
    # their last 15 tokens, a key and a latent of their own widths)
    keys, latents, index_widths = tiny_latent_widths(model_type)
    kept = [40 if span is None else span.size - 1 for span in adapter.spans]
    stored = [(tokens * (key * 8.5 + latent * 4.5) + 40 * index * 32, tokens * (key + latent) + 40 * index)
              for tokens, key, latent, index in zip(kept, keys, latents, index_widths)]
    assert tally.effective_bits == pytest.approx(sum(bits for bits, _ in stored) / sum(width for _, width in stored))


@pytest.mark.parametrize("model_type", DSA[:1])
def test_vllms_cache_of_sparse_mla_decodes_what_the_simulation_evaluates(model_type):
    """fp8_ds_mla (vLLM's cache of DeepSeek-V3.2): over a latent of 128 channels (one tile; theirs 512) in FP8 with an
    fp32 scale, the rotated key 16-bit and the indexer's keys in FP8 (kvcal.indexer_keys), transformers' own cache
    quantizing each token as written, prefilled then decoding token by token, gives the simulation's logits at every
    position, a context loaded into it the indexer keys a prefill stores; effective bits weigh each part: 16 bits a
    key channel, 8 + 32 / 128 a latent one, 8 + 32 / 80 an indexer one."""
    model = tiny_model(model_type, kv_lora_rank=128)
    adapter = adapt(model)
    method = baseline_method("fp8_ds_mla", adapter.head_dims, adapter.windows, adapter.decoder_kind, adapter.value_dims,
                             adapter.latent, indexed=True)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(4))
    tally, prefilled, loaded, _ = _written_as_the_simulation_reads(model, adapter, method, ids)
    first = adapter.model_layers[0]
    assert torch.equal(loaded.layers[first].indexer_keys, prefilled.layers[first].indexer_keys)
    assert torch.equal(prefilled.layers[first].indexer_keys, round_trip("fp8", prefilled.layers[first].indexer_keys))
    assert (tally.key_bits / tally.key_elements, tally.value_bits / tally.value_elements) == (16.0, 8.25)
    assert tally.index_bits / tally.index_elements == pytest.approx(8 + 32 / 80)


def test_policy_masks():
    key, value = SegmentPolicy(sink=1, residual=4).quantized_masks(10)
    # after 9 tokens (query 8): keys flushed in blocks of 4 -> tokens 1..7 quantized; values keep 4 fp16 -> 1..4
    assert key[8].nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert value[8].nonzero().flatten().tolist() == [1, 2, 3, 4]
    window_key, window_value = SegmentPolicy(sink=2, window=3).quantized_masks(8)
    assert torch.equal(window_key, window_value)
    assert window_key[7].nonzero().flatten().tolist() == [2, 3, 4]


def kivi_decode_reference(query, keys, values, bits, group, residual, scaling):
    """Token-by-token KIVI cache: keys flushed per channel in blocks of `residual` (quantized in groups
    of `group` tokens), values quantized one by one as they leave an fp16 FIFO of `residual`."""
    heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[0]
    flat_k = as_cached(keys.transpose(0, 1).reshape(tokens, -1))
    flat_v = as_cached(values.transpose(0, 1).reshape(tokens, -1))
    stored_k, stored_v, fifo_k, fifo_v, outputs = [], [], [], [], []
    for t in range(tokens):
        fifo_k.append(flat_k[t])
        fifo_v.append(flat_v[t])
        if len(fifo_k) == residual:
            stored_k.extend(uniform_per_channel(torch.stack(fifo_k), bits, group).values)
            fifo_k = []
        if len(fifo_v) > residual:
            stored_v.append(uniform_per_token(fifo_v.pop(0)[None], bits, group).values[0])
        k = torch.stack(stored_k + fifo_k).view(t + 1, kv_heads, head_dim).transpose(0, 1)
        v = torch.stack(stored_v + fifo_v).view(t + 1, kv_heads, head_dim).transpose(0, 1)
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        p = torch.softmax(query[:, t : t + 1] @ k.transpose(1, 2) * scaling, dim=-1)
        outputs.append((p @ v)[:, 0])
    return torch.stack(outputs, dim=0)  # (tokens, heads, head_dim)


def test_kivi_simulation_equals_token_by_token_decode():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, tokens, head_dim = 4, 2, 37, 8
    query = torch.randn(1, heads, tokens, head_dim, generator=g)
    keys = torch.randn(1, kv_heads, tokens, head_dim, generator=g) * torch.linspace(0.2, 3, head_dim)
    values = torch.randn(1, kv_heads, tokens, head_dim, generator=g)
    state = SimulatedLayer(kivi_layer(bits=2, group=4), SegmentPolicy(residual=8), lambda tokens: torch.ones(4), 1.0,
                           StorageTally())
    got = state.attend(query, keys, values, scaling=0.35)[0]
    expected = kivi_decode_reference(query[0], keys[0], values[0], 2, 4, 8, 0.35)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_effective_bits_count_fp16_tokens_at_the_evaluated_length():
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), simulated(model, adapt(model), baseline_method("kivi2-g4-r8", [16] * 2), StorageTally()) as tally:
        model(ids)
    # keys: 40 tokens all flushed, 2 bits + fp16 scale and zero per channel per 4 tokens = 10 bits
    # values: 32 quantized tokens at 2 + 32/4 = 10 bits, the last 8 in fp16
    assert tally.key_bits / tally.key_elements == 10.0
    assert tally.value_bits / tally.value_elements == (32 * 10 + 8 * 16) / 40


def window_decode_reference(query, keys, values, quantize_keys, quantize_values, sink, window, scaling):
    """Token-by-token cache with fp16 sinks and an fp16 sliding window: a token is quantized once, when it
    slides out of the window, and stays so."""
    heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[0]
    flat_k = as_cached(keys.transpose(0, 1).reshape(tokens, -1))
    flat_v = as_cached(values.transpose(0, 1).reshape(tokens, -1))
    stored_k, stored_v, outputs = [], [], []
    for t in range(tokens):
        stored_k.append(flat_k[t])
        stored_v.append(flat_v[t])
        leaving = t - window  # the token that just slid out of the window
        if leaving >= sink:
            stored_k[leaving] = quantize_keys(flat_k[leaving][None]).values[0]
            stored_v[leaving] = quantize_values(flat_v[leaving][None]).values[0]
        k = torch.stack(stored_k).view(t + 1, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = torch.stack(stored_v).view(t + 1, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        p = torch.softmax(query[:, t : t + 1] @ k.transpose(1, 2) * scaling, dim=-1)
        outputs.append((p @ v)[:, 0])
    return torch.stack(outputs, dim=0)


def test_skvq_window_and_sink_simulation_equals_token_by_token_decode():
    from kvcal.fit.skvq import SkvqTensor, channel_groups

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, tokens, head_dim = 4, 2, 41, 8
    query = torch.randn(1, heads, tokens, head_dim, generator=g)
    keys = torch.randn(1, kv_heads, tokens, head_dim, generator=g) * torch.linspace(0.2, 3, head_dim)
    values = torch.randn(1, kv_heads, tokens, head_dim, generator=g)
    flat = keys[0].transpose(0, 1).reshape(tokens, -1)
    permutation, starts = channel_groups(flat.amin(0), flat.amax(0), 2, reorder=True, seed=0)
    scheme = LayerCodecs(SkvqTensor(permutation, starts, torch.tensor([0.9, 0.7]), 2, fp8=True),
                         SkvqTensor(permutation, starts, torch.tensor([1.0, 0.8]), 1.5, fp8=False), key_pre_rope=False)
    state = SimulatedLayer(scheme, SegmentPolicy(sink=3, window=6), lambda tokens: torch.ones(4), 1.0,
                           StorageTally())
    got = state.attend(query, keys, values, scaling=0.35)[0]
    expected = window_decode_reference(query[0], keys[0], values[0], scheme.key_codec.quantize, scheme.value_codec.quantize, 3, 6, 0.35)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# per model, its span of 8 tokens and one past the windows evaluated (Llama 4: its first layer's attention chunk)
SPANS = {"mistral": ("sliding_window", dict(sliding_window=64)), "gemma3_text": ("sliding_window", dict(sliding_window=64)),
         "llama4_text": ("attention_chunk_size", dict(attention_chunk_size=64))}


@pytest.mark.parametrize("model_type", SPANS)
def test_windows_longer_than_a_span_see_only_the_span(model_type):
    """An 8-token sliding window (Llama 4: attention chunks of 8) and 33-token windows: with fp16 storage the
    simulation gives the model's own logits (its mask hides what the span hides; without it they differ), and the
    model is left as it was."""
    name, wider = SPANS[model_type]
    model = tiny_model(model_type, **{name: 8})
    method = Method("id", 16, [IDENTITY] * 2, SegmentPolicy(sink=1))
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits
        unwindowed = tiny_model(model_type, **wider)(ids).logits
        with simulated(model, adapt(model), method, StorageTally()):
            got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=5e-4)
    assert (unwindowed - expected).abs().max() > 0.1
    assert model.config._attn_implementation == "sdpa"


def test_one_simulation_at_a_time_and_only_over_whole_windows():
    model = tiny_model("llama")
    method = Method("id", 16, [IDENTITY] * 2, SegmentPolicy(sink=1))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), simulated(model, adapt(model), method, StorageTally()):
        with pytest.raises(KvcalError, match="wired for a kvcal simulation .* still open"):
            with simulated(model, adapt(model), method, StorageTally()):
                pass
        with pytest.raises(KvcalError, match="whole windows in one forward"):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        model(ids, use_cache=False)  # the simulation still serves after the refusals
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(("model_type", "spec"), [("llama", "q4_0"), ("gemma3_text", "int4_per_token_head"),
                                                  ("glm4", "int4_per_token_head"), ("qwen3_5_text", "q4_0"),
                                                  ("falcon_h1", "q4_0"), ("gemma3n_text", "int4_per_token_head"),
                                                  ("gemma4_text", "int4_per_token_head"), ("minimax", "q4_0"),
                                                  *((kind, "q4_0") for kind in known(("minimax_m3_vl_text", "qwen4_exp_text")))])
def test_a_cache_quantized_on_write_decodes_what_the_simulation_evaluates(model_type, spec):
    """QuantizedOnWrite (an engine's cache type in generate()) prefilled in steps and decoding token by token gives the
    simulation's logits for every position: each token is stored once, as its codec quantizes it; on the tiny Gemma 3
    (16-token windows) the sliding layers keep their window and read it; on GLM-4, whose keys kvcal reads in another
    channel order, the simulation rotates them by vLLM's Hadamard transform in the model's order, as the engine does.
    On Gemma 3n the layers reading another's cache read it as stored (transformers hands them what update returned).
    Loading an fp context stores the first attention layer (whose K/V come from the embeddings and, on Qwen3.5, a
    DeltaNet layer) as a prefill through the cache does; Qwen3.5's DeltaNet layers (Falcon-H1's Mamba 2 beside its
    attention) start from the context's states, each cache loading it from its own copy (a step of one leaves the
    other's as they were); MiniMax's lightning attention layers too, in a cache of its decoder's own class. MiniMax-M3's
    and Qwen4-Exp's sparse layers take its indexer keys (Qwen4-Exp's first one also every token's positions)."""
    from kvcal.runtime.fp_context import fp_context
    from kvcal.simulate import quantized_on_write

    model = tiny_model(model_type)
    adapter = adapt(model)
    method = baseline_method(spec, adapter.head_dims, adapter.windows)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        fp_logits = model(ids).logits
        with simulated(model, adapter, method, StorageTally()):
            expected = model(ids).logits
        cache = quantized_on_write(model, method)
        steps = [model(ids[:, :12], **cache_argument(cache), use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True).logits for t in range(12, 40)]
        prefilled, loaded, again = (quantized_on_write(model, method) for _ in range(3))
        model(ids[:, :39], **cache_argument(prefilled), use_cache=True)
        context = fp_context(model, ids[:, :39])
        loaded.load(context)
        again.load(context)
        first = adapter.model_layers[0]
        assert torch.equal(loaded.layers[first].keys, prefilled.layers[first].keys)
        assert torch.equal(loaded.layers[first].values, prefilled.layers[first].values)
        for name in ("indexer_keys", "idx_keys", "indexer_position_ids"):  # (sparse layers': Qwen4-Exp's, MiniMax-M3's)
            ours, theirs = (getattr(cache.layers[first], name, None) for cache in (loaded, prefilled))
            assert (ours is None) == (theirs is None) and (ours is None or torch.equal(ours, theirs))
        for i in [i for i, layer in enumerate(context.cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]:
            for kind in ("conv_states", "recurrent_states"):  # (MiniMax's layers keep no convolution state)
                ours, theirs = getattr(loaded.layers[i], kind), getattr(context.cache.layers[i], kind)
                assert ours.keys() == theirs.keys() and all(
                    ours[k] is None if state is None else torch.equal(ours[k], state) for k, state in theirs.items())
                assert any(state is not None for state in theirs.values()) or kind == "conv_states"
        continued = [model(ids[:, 39:], **cache_argument(cache), use_cache=True).logits for cache in (loaded, again)]
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=0, atol=2e-4)
    assert not torch.allclose(fp_logits, expected, atol=1e-3)
    assert loaded.get_seq_length() == 40 and torch.equal(*continued)


def test_a_cache_quantized_on_write_refuses_methods_that_are_not_per_token():
    """KIVI groups keys over tokens and keeps a residual in fp16: writing each token on its own would be wrong."""
    from kvcal.simulate import QuantizedOnWrite

    model = tiny_model("llama")
    with pytest.raises(KvcalError, match="quantizes each post-RoPE token on its own"):
        QuantizedOnWrite(model, baseline_method("kivi2", [16] * 2))
