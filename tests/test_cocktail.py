"""Cocktail: thresholds, chunk reordering that keeps every token at its position, the default encoder."""

import pytest
import torch

from helpers.tiny_models import LONGROPE_PREFILLED_AGAIN, known, longrope, tiny_model
from kvcal.errors import KvcalError
from kvcal.model_caches import cache_argument
from kvcal.policy.cocktail import ChunkEncoder, chunk_widths, cocktail_cache, compress, compressed_cache


def test_thresholds_follow_the_paper():
    # s_min 0, s_max 1: T_low = 0.6, T_high = 0.9
    assert chunk_widths(torch.tensor([0.0, 0.59, 0.61, 0.89, 0.91, 1.0])) == [2, 2, 4, 4, 16, 16]


def test_compressed_chunks_keep_their_positions_and_fp16_chunks_are_exact():
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 32 * 4 + 5), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode(), cocktail_cache(model) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
        before = cache.layers[0].values_store.read(0).clone()
        compress(cache, [[2, 16, 4, 16]])
        store = cache.layers[0].values_store
        order = torch.argsort(store.positions(0))
        after = store.read(0)[order]
        assert torch.equal(store.positions(0)[order], torch.arange(ids.shape[1]))
        for chunk, width in enumerate([2, 16, 4, 16]):
            rows = slice(32 * chunk, 32 * (chunk + 1))
            error = (after[rows] - before[rows]).abs().max()
            assert error == 0 if width == 16 else 0 < error < (0.6 if width == 2 else 0.1)
        assert torch.equal(after[128:], before[128:])  # the tail stays fp16
        assert cache.used_bytes() < 2 * 2 * ids.shape[1] * 32 * 2


def test_all_fp16_chunks_decode_like_the_fp_model():
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        expected = model(ids).logits[:, -5:]
        with cocktail_cache(model) as cache:
            model(ids[:, :65], **cache_argument(cache), use_cache=True)
            compress(cache, [[16, 16]])
            got = torch.cat([model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True).logits for t in range(65, 70)], dim=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)  # the cache holds fp16


def test_compressed_sequences_taken_decode_as_the_batch_compressed_so(decode_path):
    """Two contexts compressed to widths of their own, their sequences taken (reordered and one repeated): decoding
    gives the logits, bytes and positions of the taken contexts compressed so from the start."""
    model = tiny_model("llama")
    ids = torch.randint(3, 512, (2, 32 * 4 + 9), generator=torch.Generator().manual_seed(4))
    widths, taken = [[2, 16, 4, 16], [16, 4, 2, 2]], [1, 0, 1]
    results = []
    with torch.inference_mode():
        for fed in ([0, 1], taken):
            with cocktail_cache(model) as cache:
                model(ids[fed, :-4], **cache_argument(cache), use_cache=True)
                compress(cache, [widths[b] for b in fed])
                if fed != taken:
                    cache.take_sequences(taken)
                logits = [model(ids[taken, t : t + 1], **cache_argument(cache), use_cache=True).logits for t in range(ids.shape[1] - 4, ids.shape[1])]
                store = cache.layers[0].keys_store
                results.append((torch.cat(logits, 1), cache.used_bytes(), [store.positions(b).tolist() for b in range(3)]))
    (edited, *edited_state), (fed, *fed_state) = results
    assert edited_state == fed_state
    torch.testing.assert_close(edited, fed, rtol=0, atol=1e-4)


@LONGROPE_PREFILLED_AGAIN
def test_generate_crossing_longropes_switch_after_compression_is_refused():
    """Phi-3's generate drops the cache at LongRoPE's switch to compute the sequence again: a prefill would not make
    the compressed chunks again (the tiny Phi-3's switch: 32 tokens, a chunk of context then 4 query tokens). Emptied,
    the cache is a prefill's to fill again."""
    model = tiny_model("phi3", **longrope(32))
    ids = torch.randint(3, 512, (1, 36), generator=torch.Generator().manual_seed(8))
    with compressed_cache(model, ids[:, :32], [4]) as cache:
        with pytest.raises(KvcalError, match="compressed after its prefill"):
            model.generate(input_ids=ids, **cache_argument(cache), max_new_tokens=4, do_sample=False)
        cache.reset()  # empty, it is a prefill's to fill again
        assert cache.refillable and cache.tokens() == []


@pytest.mark.parametrize("model_type", known(("minimax_m3_vl_text", "qwen4_exp_text")))
def test_sparse_attention_is_refused(model_type):
    """MiniMax-M3's indexer picks key blocks by cache column, Qwen4-Exp's tokens, which Cocktail's stores, keeping
    tokens by chunk, do not hold in order: refused in one line naming what serves it."""
    with pytest.raises(KvcalError, match=rf"{model_type}: Cocktail's cache keeps tokens by chunk, out of cache "
                                         r"order, and its sparse layers .*; use quantized_cache"):
        cocktail_cache(tiny_model(model_type))


def test_default_encoder_ranks_the_matching_text_first():
    encoder = ChunkEncoder()
    texts = ["The cathedral was built in the twelfth century from local limestone.",
             "The striker scored twice in the second half of the cup final.",
             "Photosynthesis converts light energy into chemical energy in plants."]
    similarity = encoder.embed(texts) @ encoder.embed(["Which team won the football match?"])[0]
    assert int(similarity.argmax()) == 1 and chunk_widths(similarity)[1] == 16
