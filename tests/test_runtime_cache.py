"""The runtime cache against the simulation of `kvcal eval ppl`, through transformers' own forward and generate()."""

import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (assert_a_pick_generates_the_models_tokens, assert_later_steps_read_as_decode_steps_like_one_token_steps,
                     assert_taking_back_leaves_a_shorter_steps_cache, decode_step_operations, decode_token_by_token,
                     generate_taking_sequences, logits_in_steps, ways_of_decode_steps)
from helpers.tiny_bundles import fp16_kivi_bundle, kivi_bundle
from helpers.tiny_models import (ALTERNATING, DOTS3_NOTE, DSA, GEMMA4, GEMMA4_READERS_ON_KEPT_TOKENS, GLM5_NEXT, GLM_VL, HY_V4, IMAGE_TOWERS,
                                 LATENT, LONGROPE, LONGROPE_PREFILLED_AGAIN, MINICPM_V, MINIMAX_M3, MISTRAL_LARGE4, MUSE,
                                 OWN_ATTENTION, QWEN3_5_MROPE, QWEN3_5_VL, QWEN4_EXP, QWEN_OMNI, QWEN_VL, SPARSE_LATENTS,
                                 TINY_ARCHITECTURES, known, left_padded, longrope, tiny_model)
from kvcal import registry, wiring
from kvcal.adapters import adapt, text_inputs
from kvcal.bundle import load_bundle
from kvcal.errors import KvcalError
from kvcal.indexer_keys import token_bytes
from kvcal.methods import artifact_method, bundle_method
from kvcal.model_caches import CACHE_ARGUMENT, cache_argument
from kvcal.runtime import cpu_kernel, generate, quantized_cache
from kvcal.runtime.cache import ATTENTION_NAME, LATER_STEPS
from kvcal.runtime.fp_context import _indexer_keys, fp_context
from kvcal.simulate import StorageTally, indexer_keys_kept_as, simulated
from kvcal.version import transformers_from

TOKENS = 40
# The tokens' seed where the default (5) puts a code at a rounding edge: a decode step's one-row projections and the
# whole sequence's differ in the last bit, one code flips, and the 1e-5 that moves the next layer's inputs flips more
# (AFMoE's kvquant at seeds 1 and 5: up to 2.8e-3 on one row, after a first step of 1e-5; its SKVQ at 2; OLMo Hybrid at 5:
# 8.1e-4 on 0.1% of the logits, one row's last step; Gemma 4's KIVI at 0: 7.6e-4, its kvmix at 5: 5.4e-4, every other
# recipe within 1e-4). A wrong rotation, window or mask shows at every seed and on both rows; seeds 0, 3 and 4 pass every
# recipe (OLMo Hybrid: 0 and 3 tried; Gemma 4 and Gemma 4 Unified, text models and composites: 0-6 tried, 4 passing
# all four, 3 all but the Unified ones; Qwen3.5's composite, at its multimodal RoPE: KIVI at 5, 2.6e-3, every other
# seed of 0-5 and recipe within 6.2e-5; GLM-4.1V's and 4.6V's (glmga's: 4.6V's model) at 5: up to 2.9e-3 on one row,
# HunyuanOCR's kvquant 1e-2 on one row from its 22nd token, Qwen3-Omni's thinker 2.6e-3 on one row, at 0, 3 and 4 every
# recipe within the tolerance; Llama 3.2 Vision's causal LM: SKVQ at 5, 4.4e-3 from its 18th token, 0 and 4 passing
# all; Emu3's kvquant at 2 and 5, 4.3e-3 from its 16th or 17th token, 3e-7 at 0, 1 and 4).
EDGE_FREE_SEED = {"afmoe": 0, "olmo_hybrid": 0, **dict.fromkeys(GEMMA4, 4), "qwen3_5": 0,
                  **dict.fromkeys(("glm4v", "glm46v", "glmga", "hunyuan_vl", "qwen3_omni_moe_thinker"), 0),
                  **dict.fromkeys(("mllama_text_model", "emu3", "emu3_text_model"), 0)}


RECIPES = registry.recipes()


def assert_runtime_logits_match_the_simulation(bundle_path, model_type: str = "llama", atol: float = 1e-4, **overrides):
    """The runtime's logits, decoding token by token, against the simulation's of the same bundle; the cache."""
    model = tiny_model(model_type, **overrides)
    ids = torch.randint(0, 512, (2, TOKENS), generator=torch.Generator().manual_seed(EDGE_FREE_SEED.get(model_type, 5)))
    with torch.inference_mode():
        with simulated(model, adapt(model), artifact_method(str(bundle_path)), StorageTally()):
            simulated_logits = model(ids, **text_inputs(model, ids)).logits
        runtime_logits, cache = decode_token_by_token(model, bundle_path, ids)
    torch.testing.assert_close(runtime_logits, simulated_logits, rtol=0, atol=atol)
    assert model.config._attn_implementation == OWN_ATTENTION.get(model_type, "sdpa") and cache.tokens() == [TOKENS, TOKENS]
    return cache


@pytest.mark.parametrize("recipe", RECIPES)
def test_token_by_token_runtime_logits_match_the_simulation(recipe_bundles, recipe, decode_path):
    assert_runtime_logits_match_the_simulation(recipe_bundles[recipe])


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemma3_runtime_logits_match_the_simulation(gemma3_bundles, recipe, decode_path):
    """Gemma 3: head_dim 16 here, q/k norms seen heads first, a sliding and a full layer with their own frequencies.
    Within 5e-4: a decode step's one-row projections and the simulation's whole-sequence ones can differ in the last
    bit (BLAS blocking), enough to move a code at a rounding edge: kivi's logits differed by 3.0e-4 on 0.3% of them on
    a Xeon with AVX-512, with either decode backend, and by less than 1e-4 there with torch's scalar kernels
    (ATEN_CPU_CAPABILITY=default)."""
    assert_runtime_logits_match_the_simulation(gemma3_bundles[recipe], "gemma3_text", atol=5e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [kind for kind in TINY_ARCHITECTURES if kind not in ("llama", "gemma3_text")])
def test_every_architecture_decodes_every_recipe_to_the_simulation(architecture_bundles, model_type):
    """The tiny Llama's and Gemma 3's tests above for every other architecture kvcal supports (MoE MLPs, q/k norms per
    head or over the whole projection, sliding layers), each with bundles from its own profile, on the default decode
    path."""
    bundles = architecture_bundles(model_type)
    for recipe in RECIPES:
        assert_runtime_logits_match_the_simulation(bundles[recipe], model_type, atol=5e-4)


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_decodes_every_recipe_to_the_simulation(architecture_bundles, model_type, decode_path):
    """MLA (kvcal.adapters.LatentAttention): the cache stores the rotated key and the latent, each at its own width,
    and attends over them as the simulation does (the query's latent part scoring the latent beside its rotated part
    scoring the key), for every recipe fit from the model's own profile, on both CPU decode paths."""
    bundles = architecture_bundles(model_type)
    for recipe in RECIPES:
        assert_runtime_logits_match_the_simulation(bundles[recipe], model_type, atol=5e-4)


@MISTRAL_LARGE4
def test_a_latent_layer_storing_no_key_decodes_every_recipe_to_the_simulation(tiny_model_dir, tiny_corpus, tmp_path,
                                                                               decode_path):
    """Mistral Large 4's layer 1, without RoPE, stores no key: each decode path scores its latent alone, for every
    recipe, as the simulation does. Its indexer picks 64 tokens here (every one), so that every step runs on the path
    under test (past its pick a step attends over it on the reference)."""
    from helpers.tiny_bundles import every_recipe

    every_token = dict(index_topk=64)
    _, bundles = every_recipe(tiny_model_dir("mistral_large4", **every_token), tiny_corpus, tmp_path, latent=True)
    for path in bundles.values():
        cache = assert_runtime_logits_match_the_simulation(path, "mistral_large4", atol=5e-4, **every_token)
        assert [layer.decode_path for layer in cache.layers] == [decode_path.removeprefix("torch-")] * 2


@pytest.mark.slow
@pytest.mark.parametrize("model_type", known(("gpt_oss", "flint")))
def test_attention_sinks_decode_to_the_simulation(architecture_bundles, model_type, decode_path):
    """gpt-oss's and Flint's sinks on each CPU decode path (the kernel's running state takes them after its last launch;
    the reference adds them to its softmax), against the simulation's softmax with them, which equals the model's own
    (tests/test_simulate.py); Flint's full layers without RoPE."""
    for recipe in ("kivi", "kvquant"):
        assert_runtime_logits_match_the_simulation(architecture_bundles(model_type)[recipe], model_type, atol=5e-4)


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_5_to_8_bit_codes_decode_to_the_simulation(wide_nuq_bundles, bits, decode_path):
    """Codes wider than the kernels serve (planes5-7, 8-bit words) decode with the torch reference on every path."""
    assert_runtime_logits_match_the_simulation(wide_nuq_bundles[bits])


def test_a_recent_fp16_window_decodes_to_the_simulation(windowed_kvquant_bundle, decode_path):
    """fit-nuq --window: the sliding window leaves fp16 storage one token per step, as the simulation quantizes it."""
    assert_runtime_logits_match_the_simulation(windowed_kvquant_bundle)


@pytest.mark.parametrize("model_type, recipe", [("llama", recipe) for recipe in RECIPES] + [
    ("gemma3_text", "kvquant"), ("qwen3_5_text", "kvquant"), ("granitemoehybrid", "kvquant"), ("nemotron_h", "kvquant"),
    ("falcon_h1", "kvquant"), ("gemma3n_text", "kvquant"), ("gemma4_text", "kvquant"), ("qwen3_vl", "kvquant"),
    ("opt", "kvquant"), ("biogpt", "kvquant"), ("gpt2", "kvquant"), ("gpt_bigcode", "kvquant"), ("deepseek_v3", "kvquant"),
    ("bamba", "kvquant"), ("minimax", "kvquant")])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(recipe_bundles, gemma3_bundles, architecture_bundles,
                                                                      model_type, recipe, decode_path):
    """Padding is never stored and positions are each sequence's own: a left-padded batch of prompts of
    different lengths (prefill, then decode) gives each prompt the logits it gets alone (Qwen3.5, Granite 4.0-H,
    Nemotron-H and Bamba: their DeltaNet and Mamba 2 layers' states in transformers' cache layers among kvcal's;
    Granite 4.0-H and Nemotron-H without RoPE; Falcon-H1: Mamba 2 beside attention, its states in kvcal's layers; Gemma 3n: its last layers
    read the cache of earlier ones, after a prefill what that layer's prefill read; Qwen3-VL: its (3, batch, tokens)
    positions, each sequence's from its first real token; OPT, BioGPT, GPT-2 and GPT-BigCode: no RoPE, learned positions
    counted from the mask)."""
    model = tiny_model(model_type)
    bundles = {"llama": recipe_bundles, "gemma3_text": gemma3_bundles}.get(model_type) or architecture_bundles(model_type)
    lengths = (21, 9, 14)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, -len(prompt):], mask[row, -len(prompt):] = prompt, 1
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        batch = generate(model, bundles[recipe], input_ids=ids, attention_mask=mask, **settings)
        for row, prompt in enumerate(prompts):
            alone = generate(model, bundles[recipe], input_ids=prompt[None], **settings)
            torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=1e-4)
            assert torch.equal(batch.sequences[row, max(lengths):], alone.sequences[0, len(prompt):])
    assert model.config._attn_implementation == "sdpa"


# sequences taken by a cache's batch edit: one dropped, one repeated, the order changed
TAKEN = [2, 0, 2]


@pytest.mark.parametrize("model_type, recipe", [("llama", recipe) for recipe in RECIPES] + [
    ("gemma3_text", "kivi"), ("qwen3_5_text", "kvquant"), ("falcon_h1", "kvquant"), ("gemma3n_text", "kvquant"),
    ("deepseek_v3", "kvquant"), pytest.param("deepseek_v32", "kvquant", marks=SPARSE_LATENTS), ("minimax", "kvquant")])
def test_a_cache_whose_sequences_were_taken_decodes_as_the_batch_fed_so(recipe_bundles, gemma3_bundles,
                                                                         architecture_bundles, model_type, recipe,
                                                                         decode_path):
    """take_sequences (beam search's reorder_cache, batch_select_indices, batch_repeat_interleave) between two
    generate() calls on one cache: the second gives the tokens and logits, bytes and outliers of a cache fed the taken
    sequences from the start, after decode steps on either path (whose kernel descriptors must follow the moved
    buffers): codes, parameters, outliers, fp16 segments, KVmix's RPC counts, a sliding window's drops (Gemma 3),
    recurrent states in transformers' layers (Qwen3.5) and in kvcal's (Falcon-H1), KV sharing (Gemma 3n), MLA,
    DeepSeek Sparse Attention's indexer keys, and MiniMax's own cache class."""
    model = tiny_model(model_type)
    bundles = {"llama": recipe_bundles, "gemma3_text": gemma3_bundles}.get(model_type) or architecture_bundles(model_type)
    ids, mask = left_padded((21, 9, 14), seed=6)
    (edited, *edited_state), (fed, *fed_state) = generate_taking_sequences(model, bundles[recipe], ids, mask, TAKEN)
    assert torch.equal(edited.sequences, fed.sequences) and edited_state == fed_state
    torch.testing.assert_close(torch.stack(edited.logits), torch.stack(fed.logits), rtol=0, atol=1e-4)


@pytest.mark.parametrize("recipe", RECIPES)
def test_taken_sequences_keep_their_positions_and_segments(recipe_bundles, recipe, decode_path):
    """Left-padded prompts of 13, 6 and 10 tokens at positions of their own (from 0, 5 and 11), taken after their
    prefill, keep them: every store's segment lengths and RPC counts (KVmix's differ after prompts of other lengths)
    are a cache's fed the taken sequences so, and stay so, with the same logits, over a step of 9 tokens and decode
    steps."""
    model = tiny_model("llama")
    ids, mask = left_padded((13, 6, 10), seed=1)
    new = torch.randint(3, 512, (3, 15), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([0, 5, 11])[:, None] + (mask.cumsum(1) - 1).clamp(min=0)
    segments = lambda cache: [[list(counts) for counts in (store.rpc, store.sink.length, store.body.length, store.recent.length)]
                              for layer in cache.attention_layers for store in (layer.keys_store, layer.values_store)]
    results = []
    with torch.inference_mode():
        for fed, edit in ((list(range(3)), True), (TAKEN, False)):
            with quantized_cache(model, recipe_bundles[recipe]) as cache:
                model(ids[fed], attention_mask=mask[fed], position_ids=positions[fed], **cache_argument(cache), use_cache=True)
                if edit:
                    cache.take_sequences(TAKEN)
                taken = segments(cache)
                logits = [model(new[TAKEN, t0:t1], **cache_argument(cache), use_cache=True,
                                position_ids=positions[TAKEN, -1:] + 1 + torch.arange(t0, t1)).logits
                          for t0, t1 in [(0, 9), *((t, t + 1) for t in range(9, 15))]]
                results.append((torch.cat(logits, 1), [taken, segments(cache)]))
    (edited, edited_segments), (fed, fed_segments) = results
    assert edited_segments == fed_segments
    torch.testing.assert_close(edited, fed, rtol=0, atol=1e-4)


def test_beam_search_scores_every_beam_as_a_cache_fed_it_alone(recipe_bundles):
    """Beam search (num_beams 3, every beam returned) over two left-padded prompts on a kvquant cache (outliers,
    keys before RoPE): each returned beam's score is the sum of its tokens' log-probabilities in a cache fed that
    prompt and those tokens alone, so every step's reorder_cache gave each beam its own history."""
    model = tiny_model("llama")
    ids, mask = left_padded((17, 11), seed=2)
    settings = dict(num_beams=3, num_return_sequences=3, length_penalty=0.0, max_new_tokens=6, eos_token_id=None,
                    do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        beams = generate(model, recipe_bundles["kvquant"], input_ids=ids, attention_mask=mask, **settings)
        for row, sequence in enumerate(beams.sequences):
            prompt = ids[row // 3][mask[row // 3].bool()]
            new = sequence[ids.shape[1]:]
            with quantized_cache(model, recipe_bundles["kvquant"]) as cache:
                steps = [model(prompt[None], **cache_argument(cache), use_cache=True).logits[0, -1]]
                steps += [model(token.view(1, 1), **cache_argument(cache), use_cache=True).logits[0, -1] for token in new[:-1]]
            score = sum(torch.log_softmax(logits.float(), -1)[token] for logits, token in zip(steps, new))
            torch.testing.assert_close(score, beams.sequences_scores[row], rtol=0, atol=1e-4)
    assert len({tuple(sequence.tolist()) for sequence in beams.sequences}) == 6  # the beams differ


def test_a_cache_refuses_other_batches_and_sequences_it_does_not_hold(recipe_bundles):
    """A step of another batch than the cache holds (beam search from a filled context: as many beams as sequences
    are made with batch_repeat_interleave first) and take_sequences outside the batch are refused before anything is
    stored."""
    model = tiny_model("llama")
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), quantized_cache(model, recipe_bundles["kivi"]) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
        held = cache.used_bytes()
        with pytest.raises(KvcalError, match=r"this step feeds 4 sequences to a cache holding 2: .*batch_repeat_interleave"):
            model(ids[:, :1].repeat(2, 1), **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match=r"sequences \[0, 2\] asked of a cache holding 2: give indices from 0 to 1"):
            cache.take_sequences([0, 2])
        assert cache.used_bytes() == held and cache.tokens() == [12, 12]
        cache.batch_repeat_interleave(2)
        model(ids[:, :1].repeat_interleave(2, 0), **cache_argument(cache), use_cache=True)
        assert cache.tokens() == [13] * 4 and cache.used_bytes() > 2 * held


@pytest.mark.parametrize("model_type, recipe, prompt, step", [
    ("llama", recipe, prompt, step) for recipe in RECIPES for prompt, step in ((0, 7), (60, 7), (0, 70))] + [
    ("llama", "kivi-r128", 0, 130), ("gemma3_text", "kivi", 8, 7), ("gemma3n_text", "kvquant", 8, 7),
    ("deepseek_v3", "kvquant", 60, 7), pytest.param("deepseek_v32", "kvquant", 60, 7, marks=SPARSE_LATENTS)])
def test_tokens_taken_back_leave_the_cache_a_shorter_step_leaves(recipe_bundles, gemma3_bundles, architecture_bundles,
                                                                 model_type, recipe, prompt, step, decode_path):
    """crop(-3) after a step of 7 tokens (assisted generation's check of its candidates) leaves the cache a step of 4
    leaves: every store's segments, RPC counts (KVmix's after a 60-token prompt: 6, then 1 after 7 tokens and after
    4), outliers and tokens read back, indexer keys, and the logits and bytes of decode steps after it; also as the
    first step (its first tokens fp16 sinks), after a first step of 70 (assisted generation's first check comes with
    the prompt), where the shorter step keeps a whole KIVI residual of keys fp16 that the step moved to the body (130
    tokens and 127 with a residual of 128), for Gemma 3 and 3n within their windows, for layers reading another's
    cache (Gemma 3n), MLA and DeepSeek Sparse Attention."""
    model = tiny_model(model_type)
    bundles = {"llama": recipe_bundles, "gemma3_text": gemma3_bundles}.get(model_type) or architecture_bundles(model_type)
    bundle = kivi_bundle(model, 2, 32, 128) if recipe == "kivi-r128" else bundles[recipe]
    ids = torch.randint(3, 512, (2, prompt + step + 8), generator=torch.Generator().manual_seed(7))
    assert_taking_back_leaves_a_shorter_steps_cache(model, bundle, ids, prompt, step=step)


@pytest.mark.parametrize("model_type, recipe", [("llama", recipe) for recipe in RECIPES] + [
    ("gpt_oss", "kvquant"), ("gemma2", "kivi"), ("deepseek_v3", "kvquant"), ("gemma3_text", "kvquant"),
    ("llama4_text", "kvquant"), ("gemma3n_text", "kvquant"), ("gemma4_text", "kvquant")])
def test_a_short_step_reads_the_cache_through_the_kernel_as_the_reference_does(recipe_bundles, gemma3_bundles,
                                                                              architecture_bundles, model_type, recipe,
                                                                              monkeypatch):
    """A step of a few tokens over a stored cache (speculative decoding's check of its candidates) attends over the
    stored tokens through the CPU kernel, merged with the step's own tokens in fp16 by log-sum-exp: the logits the
    torch reference gives, reading each sequence's cache whole (1e-4), on a left-padded batch; with attention sinks
    (gpt-oss: joining the merged softmax once), soft-capped scores (Gemma 2), MLA's latent (DeepSeek-V3), and a sliding
    layer past its window (Gemma 3's 16 tokens, gpt-oss's: each of the step's queries sees the stored tokens of its own
    window, its first one passed to the kernel per query row), and chunked attention (Llama 4's chunks of 16: the
    shorter prompt's second step of 5 crosses into a new chunk, whose queries see none of the stored tokens and only
    their own chunk's among the step's), and KV sharing (Gemma 3n's and Gemma 4's last layers read the first ones'
    caches: through the same kernel, over the cache before the step, whose rows are appended after them)."""
    from kvcal.runtime.layer import RuntimeLayer

    model = tiny_model(model_type)
    bundles = {"llama": recipe_bundles, "gemma3_text": gemma3_bundles}.get(model_type) or architecture_bundles(model_type)
    bundle = bundles[recipe]
    ids, mask = left_padded((30, 22), seed=8)
    mask = torch.cat([mask, torch.ones(2, 13, dtype=mask.dtype)], 1)
    ids = torch.cat([ids, torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(9))], 1)
    steps = [30, 1, 1, 5, 1, 5]
    served = []
    short_step = RuntimeLayer._short_step
    monkeypatch.setattr(RuntimeLayer, "_short_step", lambda *args: served.append(short_step(*args)) or served[-1])
    through_kernel = logits_in_steps(model, bundle, ids, mask, steps)
    layers = served.count(None)  # the prefill finds nothing stored; each step of 5 is served, for the readers too
    calls_a_layer = 2 if model_type in ("gemma3n_text", "gemma4_text") else 1  # its own, its reader's
    assert layers and [out is None for out in served] == [True] * layers + [False] * (2 * layers * calls_a_layer)
    monkeypatch.setattr(cpu_kernel, "library", lambda: None)
    by_reference = logits_in_steps(model, bundle, ids, mask, steps)
    for got, want in zip(through_kernel, by_reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@GEMMA4_READERS_ON_KEPT_TOKENS
def test_a_second_turn_on_gemma_4_reads_a_short_steps_rows_for_reading_layers_run_on_the_last_token(monkeypatch):
    """generate() twice on one cache (a chat's second turn, 11 tokens over 24 stored): Gemma 4 runs its layers reading
    another's cache on the kept logits' tokens alone, so they read the short step's cache before it and its own rows
    per sequence (the rows wait for them), giving the reference's tokens and logits (1e-5)."""
    from kvcal.runtime.layer import RuntimeLayer

    model = tiny_model("gemma4_text")
    ids = torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    lazily, reader = [], RuntimeLayer.attend_as_reader
    monkeypatch.setattr(RuntimeLayer, "attend_as_reader", lambda self, query, plan, *args, **kwargs: (
        lazily.append(self.step.pending is not None and query.shape[2] < plan.m), reader(self, query, plan, *args, **kwargs))[1])

    def second_turn():
        with torch.inference_mode(), quantized_cache(model, kivi_bundle(model, 4, 16, 16)) as cache:
            first = model.generate(input_ids=ids[:, :20], **cache_argument(cache), **settings)
            return model.generate(input_ids=torch.cat([first.sequences, ids[:, 25:35]], 1), **cache_argument(cache), **settings)

    through_kernel = second_turn()
    assert any(lazily)
    monkeypatch.setattr(cpu_kernel, "library", lambda: None)
    by_reference = second_turn()
    assert torch.equal(through_kernel.sequences, by_reference.sequences)
    torch.testing.assert_close(torch.stack(through_kernel.logits), torch.stack(by_reference.logits), rtol=0, atol=1e-5)


def test_prompt_lookup_decoding_generates_the_models_own_tokens(recipe_bundles, monkeypatch):
    """generate() with prompt_lookup_num_tokens, and with an assistant model of other weights, on a cache holding
    every token fp16: the candidates checked in steps of several tokens, the rejected ones taken back (crop), each
    gives the model's own greedy tokens; on a 2-bit kivi cache prompt lookup runs, taking tokens back as well."""
    from kvcal.runtime.cache import WiredCache

    taken_back = []
    crop = WiredCache.crop
    monkeypatch.setattr(WiredCache, "crop", lambda self, n: (taken_back.append(-n), crop(self, n))[1])
    model = tiny_model("llama")
    text = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text, text[:, :12], text[:, 4:10]], 1)  # repeats that prompt lookup proposes
    settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        own = model.generate(input_ids=ids, **settings)
        looked_up = generate(model, fp16_kivi_bundle(model), input_ids=ids, prompt_lookup_num_tokens=4, **settings)
        assert torch.equal(looked_up, own) and any(taken_back)
        taken_back.clear()
        assisted = generate(model, fp16_kivi_bundle(model), input_ids=ids, assistant_model=tiny_model("llama", seed=3),
                            **settings)
        assert torch.equal(assisted, own) and any(taken_back)
        taken_back.clear()
        generate(model, recipe_bundles["kivi"], input_ids=ids, prompt_lookup_num_tokens=4, **settings)
    assert any(taken_back)


@pytest.mark.parametrize("recipe", RECIPES)
def test_later_steps_read_as_decode_steps_give_one_token_steps_logits_and_cache(recipe_bundles, recipe, decode_path,
                                                                                monkeypatch):
    """later_steps="decode": steps of 12 and 8 tokens after a 20-column prefill (two sequences, one left-padded by
    6) give the logits and leave the cache of one-token steps, on every recipe (KVmix's RPC count decaying a token at
    a time) and decode path: the CPU kernel's short steps re-read, the torch reference's own way."""
    ways = ways_of_decode_steps(monkeypatch)
    ids, mask = left_padded([40, 34])
    assert_later_steps_read_as_decode_steps_like_one_token_steps(tiny_model("llama"), recipe_bundles[recipe], ids, mask,
                                                                 [20, 12, 8])
    assert ways and set(ways) == {decode_path == "cpu-kernel"}


@pytest.mark.parametrize("model_type, settings, kernels", [("gpt_oss", dict(sliding_window=8), True),
                                                           ("gemma2", dict(sliding_window=8), True),
                                                           ("llama4_text", dict(attention_chunk_size=16), True),
                                                           ("gemma4_text", {}, False), ("deepseek_v3", {}, True),
                                                           pytest.param("deepseek_v32", {}, False, marks=SPARSE_LATENTS),
                                                           ("minimax_m3_vl_text", {}, True)])
def test_later_steps_read_as_decode_steps_under_windows_sinks_shared_caches_and_mla(model_type, settings, kernels,
                                                                                   monkeypatch):
    """The same on 2-bit KIVI (blocks of 8, a residual of 8) under a sliding window of 8 with attention sinks (gpt-oss)
    and soft-capped scores (Gemma 2), in chunks of 16 (Llama 4: placed by position), with layers reading another's
    cache (Gemma 4: the torch reference's way, the others the CPU kernel's), on MLA's latent (DeepSeek-V3) and with an
    indexer's pick of the tokens each query attends (DeepSeek-V3.2: the reference's way) or of the key blocks
    (MiniMax-M3's block-sparse layer, over prompts of equal length); logits within 1e-3 and tokens read back within
    2e-3 (Gemma 4's keys and values of a forward over several tokens and over one can differ by an fp16 step)."""
    ways = ways_of_decode_steps(monkeypatch)
    model = tiny_model(model_type, **settings)
    ids, mask = left_padded([40, 40] if model_type in MINIMAX_M3 else [40, 34])
    assert_later_steps_read_as_decode_steps_like_one_token_steps(model, kivi_bundle(model, 2, 8, 8), ids, mask,
                                                                 [20, 12, 8], atol=1e-3, stored_atol=2e-3)
    assert kernels in ways


@pytest.mark.parametrize("recipe", RECIPES)
def test_prompt_lookup_on_a_cache_reading_later_steps_as_decode_steps_gives_its_greedy_tokens(recipe_bundles, recipe,
                                                                                            monkeypatch):
    """With later_steps="decode", prompt lookup decoding (its checks steps of several tokens, the rejected candidates
    taken back) gives the tokens of greedy decoding on the same quantized cache."""
    from kvcal.runtime.cache import WiredCache

    taken_back = []
    crop = WiredCache.crop
    monkeypatch.setattr(WiredCache, "crop", lambda self, n: (taken_back.append(-n), crop(self, n))[1])
    model = tiny_model("llama")
    text = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text, text[:, :12], text[:, 4:10], text[:, :16]], 1)
    settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        greedy = generate(model, recipe_bundles[recipe], input_ids=ids, **settings)
        looked_up = generate(model, recipe_bundles[recipe], "decode", input_ids=ids, prompt_lookup_num_tokens=4, **settings)
    assert torch.equal(looked_up, greedy) and any(taken_back)


def test_later_steps_other_than_prefill_or_decode_are_refused():
    model = tiny_model("llama")
    with pytest.raises(KvcalError, match=r"later_steps 'exact': give one of 'prefill', 'decode'"):
        quantized_cache(model, fp16_kivi_bundle(model), later_steps="exact")


def test_taking_tokens_back_is_refused_where_it_cannot_be_exact(recipe_bundles, gemma3_bundles, architecture_bundles):
    """crop refuses, with nothing changed: after a decode step, more tokens than the step brought or than 64, a
    positive count; after a step whose sliding window let go of tokens; on a hybrid model's recurrent states and on
    Cocktail's chunks. crop(0) (generate's steps ask it) changes nothing."""
    from kvcal.policy.cocktail import cocktail_cache

    ids = torch.randint(3, 512, (2, 160), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    with torch.inference_mode(), quantized_cache(model, recipe_bundles["kivi"]) as cache:
        model(ids[:, :150], **cache_argument(cache), use_cache=True)
        held = cache.used_bytes()
        cache.crop(0)
        with pytest.raises(KvcalError, match=r"crop\(-65\): the last step brought 150 tokens to a sequence; up to 64"):
            cache.crop(-65)
        model(ids[:, 150:153], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="the last step brought 3 tokens to a sequence; up to 64 of them can go"):
            cache.crop(-4)
        with pytest.raises(KvcalError, match="as a negative count"):
            cache.crop(2)
        model(ids[:, 153:154], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="the last step brought one token a sequence"):
            cache.crop(-1)
        assert cache.tokens() == [154, 154] and cache.used_bytes() > held
    gemma3 = tiny_model("gemma3_text")
    with torch.inference_mode(), quantized_cache(gemma3, gemma3_bundles["kivi"]) as cache:
        gemma3(ids[:, :30], **cache_argument(cache), use_cache=True)
        gemma3(ids[:, 30:40], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="a sliding window let go of tokens after that step"):
            cache.crop(-2)
    hybrid, hybrid_bundle = tiny_model("qwen3_5_text"), architecture_bundles("qwen3_5_text")["kvquant"]  # (profiled: autograd)
    with torch.inference_mode(), quantized_cache(hybrid, hybrid_bundle) as cache:
        hybrid(ids[:, :10], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match=r"layers \[.*\] keep recurrent states"):
            cache.crop(-2)
    with torch.inference_mode(), cocktail_cache(model) as cache:
        model(ids[:, :10], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="Cocktail's chunks take no tokens back"):
            cache.crop(-2)


def test_qwen3_5s_multimodal_position_ids_decode_as_text():
    """Qwen3.5's rotary takes (3, batch, tokens) position ids (time, height, width; equal for a text token): the runtime
    reads the first row, and a cache holding every token fp16 decodes as the model does (9.5e-5 here: fp16 K/V)."""
    model = tiny_model("qwen3_5_text", rope_parameters=QWEN3_5_MROPE)
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        decoded, _ = decode_token_by_token(model, fp16_kivi_bundle(model), ids)
        torch.testing.assert_close(decoded, model(ids).logits, rtol=0, atol=5e-4)


def test_a_bundle_for_another_model_is_refused(recipe_bundles):
    from kvcal.errors import KvcalError

    with pytest.raises(KvcalError, match="made for"):
        quantized_cache(tiny_model("qwen2"), recipe_bundles["kivi"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_live_cache_bytes_equal_the_formula(recipe_bundles, recipe):
    from kvcal.bundle import load_bundle
    from kvcal.runtime.memory import cache_bytes, fp16_bytes

    model = tiny_model("llama")
    bundle = load_bundle(recipe_bundles[recipe])
    width = model.config.num_key_value_heads * model.config.head_dim
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
    expected = cache_bytes(bundle.layers, width, 150, outliers=cache.outliers(), kv_heads=model.config.num_key_value_heads)
    assert cache.used_bytes() == expected < fp16_bytes(2, width, 150)
    assert (cache.outliers() > 0) == (recipe in ("kvquant", "mixed"))



@pytest.mark.parametrize("recipe", ["kvquant", "kivi"])
def test_a_prefill_holds_none_of_its_pre_rope_keys_after_its_step(recipe_bundles, recipe):
    """A step's pre-RoPE keys (as large as a prefill's keys, whether the recipe stores them or not) are let go when
    its layer has attended: the cache holds its stores alone until the next step."""
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode(), quantized_cache(model, load_bundle(recipe_bundles[recipe])) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
        assert [layer.pending_pre_rope for layer in cache.attention_layers] == [None] * model.config.num_hidden_layers


@pytest.mark.slow  # starts Python
def test_a_cache_is_made_and_decodes_without_importing_the_fits_clustering():
    """Serving a bundle needs no sklearn (the fits' KMeans): its import, a heavy one, is left to the fits."""
    script = ("import sys, torch\n"
              "from helpers.tiny_bundles import kivi_bundle\n"
              "from helpers.tiny_models import tiny_model\n"
              "from kvcal.runtime import generate\n"
              "model = tiny_model('llama')\n"
              "generate(model, kivi_bundle(model, 2, 16, 8), input_ids=torch.ones(1, 40, dtype=torch.long), max_new_tokens=3)\n"
              "print(sorted(name for name in sys.modules if name.split('.')[0] == 'sklearn'))\n")
    tests = Path(__file__).parent
    run = subprocess.run([sys.executable, "-c", script], cwd=tests.parent, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tests, tests.parent)))})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


# Misuse: each gives one clear KvcalError and no tokens; the cache and the model are left as they were.

GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def prompt(seed: int = 0, tokens: int = 12) -> torch.Tensor:
    return torch.randint(3, 512, (1, tokens), generator=torch.Generator().manual_seed(seed))


def test_a_cache_used_after_it_is_closed_is_refused():
    model = tiny_model("llama")
    with torch.inference_mode():
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            model.generate(prompt(), **cache_argument(cache), **GREEDY)
        with pytest.raises(KvcalError, match="this quantized cache is closed"):
            model.generate(prompt(), **cache_argument(cache), **GREEDY)
        with quantized_cache(model, fp16_kivi_bundle(model)):  # the model wired again, by another cache
            with pytest.raises(KvcalError, match="this quantized cache is closed"):
                model.generate(prompt(), **cache_argument(cache), **GREEDY)
        with pytest.raises(KvcalError, match="this quantized cache is closed"):
            cache.load(None)
    assert model.config._attn_implementation == "sdpa"


def test_an_unknown_cuda_layout_is_refused_before_the_model_is_wired():
    model = tiny_model("llama")
    with pytest.raises(KvcalError, match="cuda_layout 'columns': give one of 'rows', 'heads'"):
        quantized_cache(model, fp16_kivi_bundle(model), cuda_layout="columns")
    assert model.config._attn_implementation == "sdpa"


def test_a_cache_handed_to_another_model_instance_is_refused():
    """Two instances of one architecture (the bundle fits both): a cache serves only its own, whether the
    other is wired for a cache of its own or not, and is left untouched by the refused call."""
    mine, other = tiny_model("llama"), tiny_model("llama", seed=1)
    bundle = fp16_kivi_bundle(mine)
    with torch.inference_mode():
        expected = mine.generate(prompt(), **GREEDY)
    with torch.inference_mode(), quantized_cache(mine, bundle) as cache:
        with pytest.raises(KvcalError, match="serves only the model instance it was made for"):
            other.generate(prompt(), **cache_argument(cache), **GREEDY)
        with quantized_cache(other, bundle) as others:
            with pytest.raises(KvcalError, match="serves only the model instance it was made for"):
                other.generate(prompt(), **cache_argument(cache), **GREEDY)
            with pytest.raises(KvcalError, match="serves only the model instance it was made for"):
                mine.generate(prompt(), **cache_argument(others), **GREEDY)
        assert cache.get_seq_length() == 0 and cache.tokens() == []
        assert torch.equal(mine.generate(prompt(), **cache_argument(cache), **GREEDY), expected)
    assert mine.config._attn_implementation == other.config._attn_implementation == "sdpa"


def test_a_wired_model_called_without_its_cache_is_refused():
    """While a cache is open the model's attention is kvcal's: called with no cache, with use_cache=False or
    with transformers' own cache it refuses (it would otherwise attend over the step's tokens alone)."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    with torch.inference_mode():
        expected = model.generate(prompt(), **GREEDY)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            for call in (lambda: model.generate(prompt(), **GREEDY), lambda: model(prompt(), use_cache=False),
                         lambda: model.generate(prompt(), **cache_argument(DynamicCache(config=model.config)), **GREEDY)):
                with pytest.raises(KvcalError, match=f"called without one: pass {CACHE_ARGUMENT}=cache"):
                    call()
            assert torch.equal(model.generate(prompt(), **cache_argument(cache), **GREEDY), expected)
        assert torch.equal(model.generate(prompt(), **GREEDY), expected)


# image tokens and side (Qwen's: image patches of 14 x 14 pixels, two frames, 2 x 2 merged into a token; Gemma 4's: 2 x 2
# patches pooled into a token), vision attention
IMAGES = {"gemma3": (4, 28, "Siglip"), "gemma4": (4, 56, "Gemma4Vision"), "gemma4_unified": (4, 56, ""), "mistral3": (4, 56, "Pixtral"), "llava": (4, 28, "CLIP"), "internvl": (1, 28, "InternVL"),
          "smolvlm": (1, 28, ""), "idefics3": (1, 28, ""), "aya_vision": (1, 28, ""), "aria": (4, 28, ""),
          "llama4": (4, 56, "Llama4Vision"), "phi4_multimodal": (5, 28, ""), "kimi_k25": (4, 56, ""),
          "llava_next": (10, 28, ""), "llava_onevision": (10, 28, ""), "idefics2": (4, 28, ""), "lfm2_vl": (1, 28, ""),
          "cohere2_vision": (1, 28, ""), "lighton_ocr": (1, 28, ""), "exaone4_5": (1, 28, ""), "lfm3_vl": (4, 56, ""),
          "vipllava": (4, 28, ""), "llava_next_video": (10, 28, ""), "video_llava": (4, 28, ""),
          **{kind: (4, 56, "VisionAttention") for kind in (*QWEN_VL, *QWEN3_5_VL, "qwen4_exp", "cohere_compass", "minimax_m3_vl", *GLM_VL, "paddleocr_vl",
                                                        "hyperclovax_vision_v2", "ernie4_5_vl_moe", *QWEN_OMNI)},
          "hunyuan_vl": (8, 56, ""), "hy_v4_vl": (6, 56, ""), "mistral_large4": (4, 56, ""),
          **{kind: (4, 56, "") for kind in MUSE}, "step3p7": (4, 112, ""),
          "deepseek_vl": (4, 28, ""), "janus": (4, 28, ""), "qianfan_ocr": (4, 56, ""), "granite_docling": (4, 56, ""),
          "ovis2": (4, 28, ""), "video_llama_3": (4, 56, ""), "cosmos3_edge": (4, 56, ""), "deepseek_ocr2": (145, 32, ""),
          **{kind: (16 if kind == "minicpm_ocr" else 4, 112, "") for kind in MINICPM_V}, "deepseek_vl_hybrid": (4, 28, ""),
          "got_ocr2": (4, 128, ""), "fuyu": (4, 28, ""), "chameleon": (16, 32, ""), "emu3": (20, 8, ""), "apertus1p5": (16, 8, ""),
          "paligemma": (4, 28, "Siglip"),
          "molmo2": (4, 28, ""), "nemotron_h_omni": (4, 56, ""), "granite4_vision": (10, 56, ""),
          "llava_onevision1_5": (4, 56, ""), "ovis2_5": (4, 56, ""), "dots3_note": (4, 56, "")}
MULTIMODAL_ROPE = (*QWEN_VL, *QWEN3_5_VL, "qwen4_exp", "cohere_compass", *GLM_VL, "paddleocr_vl", "ernie4_5_vl_moe", *QWEN_OMNI,
                   "cosmos3_edge")  # image tokens at (time, height, width) positions
# the shape of one patch of the models fed an image's patches beside their grid: Qwen-VL's of two frames (and the
# others' where they take it), one frame (PaddleOCR-VL, Kimi K2.5 unflattened; ERNIE 4.5 VL, HunyuanOCR flattened);
# 2 x 2 patches merged into a token (HunyuanOCR's rows each ending in one more)
GRID_PATCHES = {**dict.fromkeys((*MULTIMODAL_ROPE, "minimax_m3_vl", "exaone4_5", "lfm3_vl", "hyperclovax_vision_v2", *MUSE),
                                (3 * 2 * 14 * 14,)),
                "paddleocr_vl": (3, 14, 14), "kimi_k25": (3, 14, 14), "ernie4_5_vl_moe": (3 * 14 * 14,),
                "hunyuan_vl": (3 * 14 * 14,), "hy_v4_vl": (3 * 14 * 14,), "video_llama_3": (3 * 14 * 14,), "cosmos3_edge": (3 * 14 * 14,),
                "llava_onevision1_5": (3 * 14 * 14,), "ovis2_5": (3 * 14 * 14,), "dots3_note": (3 * 14 * 14,)}
# of those, the ones told which tokens are an image's by mm_token_type_ids (the Omni thinkers tell them by their id)
TOKEN_TYPED = (*(kind for kind in MULTIMODAL_ROPE if kind not in QWEN_OMNI), "hunyuan_vl", "hy_v4_vl")
IMAGES_AS_TOKENS = known(("mistral3", "llama4", "phi4_multimodal", "kimi_k25", "minimax_m3_vl", "hunyuan_vl", "hy_v4_vl",
                    "mistral_large4", *MUSE, "step3p7", "dots3_note",
                    "granite_docling", "deepseek_ocr2", "nemotron_h_omni", "granite4_vision", "fuyu", "chameleon", "emu3", "apertus1p5", *MINICPM_V,
                    *IMAGE_TOWERS,
                    *MULTIMODAL_ROPE))  # their decoders read an image's tokens causally, as text


def image_inputs(model_type: str, model, ids: torch.Tensor) -> dict:
    """A prompt with one image, as each model's processor gives it (the image's tokens from its third on)."""
    tokens, side, _ = IMAGES[model_type]
    if model_type == "phi4_multimodal":  # its encoder's view of the whole image and of one crop: 5 tokens with separators
        ids[0, 2:2 + tokens] = model.config.vision_config.image_token_id
        return dict(input_ids=ids, image_pixel_values=torch.randn(1, 2, 3, side, side), image_sizes=torch.tensor([[side, side]]),
                    image_attention_mask=torch.ones(1, 2, 2, 2, dtype=torch.bool))
    ids[0, 2:2 + tokens] = model.config.image_token_id
    if model_type == "ovis2_5":  # its image's tokens between a start and an end token
        ids[0, 1], ids[0, 2 + tokens] = model.config.image_start_token_id, model.config.image_end_token_id
    if model_type in GRID_PATCHES:  # its patches flattened beside its (time, height, width) grid of them
        grid = side // 14
        images = dict(input_ids=ids, pixel_values=torch.randn(grid * grid, *GRID_PATCHES[model_type]),
                      image_grid_thw=torch.tensor([[1, grid, grid]]))
        if model_type in TOKEN_TYPED:
            images["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        if model_type == "video_llama_3":  # 2 x 2 patches merged into a token
            images["image_merge_sizes"] = torch.tensor([2])
        return images
    if model_type in MINICPM_V:  # its 8 x 8 patches side by side in one row of pixels, beside their grid
        grid = side // 14
        return dict(input_ids=ids, pixel_values=torch.randn(1, 3, 14, 14 * grid * grid),
                    target_sizes=torch.tensor([[grid, grid]]))
    if model_type in ("llava_next", "llava_onevision", "llava_next_video", "granite4_vision"):  # the image and its one tile
        return dict(input_ids=ids, pixel_values=torch.randn(1, 2, 3, side, side), image_sizes=torch.tensor([[side, side]]))
    if model_type == "emu3":  # its VQ-VAE's 4 x 4 codes and an end-of-line token after each row
        return dict(input_ids=ids, pixel_values=torch.randn(1, 3, side, side), image_sizes=torch.tensor([[side, side]]))
    if model_type == "fuyu":  # its 2 x 2 patches' pixels, each embedded into a token (image_patches before 5.21)
        return {"input_ids": ids, "pixel_values" if transformers_from(5, 21) else "image_patches": torch.randn(1, 4, 3 * 14 * 14)}
    if model_type == "lfm2_vl":  # its patches flattened, 2 x 2 of them, every one real
        patches = (side // 14) ** 2
        return dict(input_ids=ids, pixel_values=torch.randn(1, patches, 3 * 14 * 14),
                    spatial_shapes=torch.tensor([[side // 14, side // 14]]),
                    pixel_attention_mask=torch.ones(1, patches, dtype=torch.bool))
    if model_type == "gemma4":  # its patches flattened, each with its (x, y) in the image
        grid = side // 14
        where = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), dim=-1)
        return dict(input_ids=ids, pixel_values=torch.randn(1, grid * grid, 3 * 14 * 14), image_position_ids=where.reshape(1, -1, 2))
    images = dict(input_ids=ids, pixel_values=torch.randn(1, 3, side, side))
    if model_type == "video_llava" and not transformers_from(5, 21):  # (its images' name before then)
        images["pixel_values_images"] = images.pop("pixel_values")
    if model_type in ("smolvlm", "idefics3", "idefics2", "granite_docling"):  # (batch, images, channels, height, width)
        images["pixel_values"] = images["pixel_values"][:, None]
    if model_type == "granite_docling":  # its one tile real
        images["pixel_attention_mask"] = torch.ones(1, 1, dtype=torch.bool)
    if model_type in ("mistral3", "lighton_ocr", "apertus1p5", "mistral_large4"):
        images["image_sizes"] = torch.tensor([[side, side]])
    if model_type == "nemotron_h_omni":  # its patches flattened beside their (height, width) grid
        grid = side // 14
        return dict(input_ids=ids, pixel_values=torch.randn(grid * grid, 3 * 14 * 14),
                    image_grid_hw=torch.tensor([[grid, grid]]))
    if model_type == "molmo2":  # one crop of 2 x 2 patches, each pooled into a token of its own, told by their token
        # types (which transformers' Molmo 2 mask leaves causal)
        return dict(input_ids=ids, pixel_values=torch.randn(1, 4, 3 * 14 * 14), image_token_pooling=torch.arange(4)[:, None],
                    image_grids=torch.tensor([[2, 2, 0, 0]]), mm_token_type_ids=(ids == model.config.image_token_id).long())
    if model_type == "deepseek_vl_hybrid":  # the image again, at its SAM tower's resolution
        images["high_res_pixel_values"] = torch.randn(1, 3, 64, 64)
    return images


def two_way_image_inputs(model_type: str, model, ids: torch.Tensor) -> dict:
    """A batch of prompts with an image each at the places of ids' image tokens, as Gemma 3's and Gemma 4's processors
    give them, with the token types that make their decoders attend to an image's tokens both ways (Gemma 4 Unified's
    patches come pooled already: 2 x 2 of 14 x 14 pixels each)."""
    side, images, generator = IMAGES[model_type][1], len(ids), torch.Generator().manual_seed(0)
    types = (ids == model.config.image_token_id).long()
    if model_type == "paligemma":  # the whole prompt attended both ways: token type 0 (1: text it writes, causally)
        return dict(input_ids=ids, pixel_values=torch.randn(images, 3, side, side, generator=generator),
                    token_type_ids=torch.zeros_like(ids))
    if model_type == "gemma3":
        return dict(input_ids=ids, pixel_values=torch.randn(images, 3, side, side, generator=generator), token_type_ids=types)
    patch = 28 if model_type == "gemma4_unified" else 14
    grid = side // patch
    where = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), dim=-1).reshape(1, -1, 2)
    return dict(input_ids=ids, pixel_values=torch.randn(images, grid * grid, 3 * patch * patch, generator=generator),
                image_position_ids=where.expand(images, -1, -1), mm_token_type_ids=types)


@pytest.mark.parametrize("model_type, config", [("gemma3", {}), ("gemma4", dict(use_bidirectional_attention="vision")),
                                                ("gemma4_unified", {}), ("paligemma", {})])
def test_an_image_attended_both_ways_gives_the_models_own_logits(model_type, config):
    """Gemma 3 4B-27B's decoder, and Gemma 4's where use_bidirectional_attention is "vision" (Gemma 4 Unified's by
    default), attend to an image's tokens both ways (the processor's token types), PaliGemma to its whole prompt (token
    type 0): through a cache keeping everything fp16, left-padded prompts with
    an image (the step's mask says which tokens see later ones) give the model's own prefill logits (Gemma 4's layers
    reading another's cache too) and generate its own tokens, logits equal up to the fp16 rounding of K/V, the vision
    tower on its own attention; read causally (no token types) the image's logits differ, so the two-way attention is
    what matches. The simulation, which scores text causally, refuses the image in one line."""
    from kvcal.kv import SegmentPolicy
    from kvcal.simulate import Method

    model = tiny_model(model_type, **config)
    ids, mask = left_padded((16, 12), seed=4)
    ids[0, 6:10], ids[1, 5:9] = model.config.image_token_id, model.config.image_token_id  # an image in each prompt
    images = {**two_way_image_inputs(model_type, model, ids), "attention_mask": mask}
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    bundle = fp16_kivi_bundle(model)
    real = mask.bool()
    with torch.inference_mode():
        fp, fp_prefill = model.generate(**images, **settings), model(**images).logits[real]
        with quantized_cache(model, bundle) as cache:
            ours_prefill = model(**images, **cache_argument(cache), use_cache=True).logits[real]
        with quantized_cache(model, bundle) as cache:
            ours = model.generate(**images, **settings, **cache_argument(cache))
            assert model.config.vision_config._attn_implementation == "sdpa" and cache.tokens() == [16 + 7, 12 + 7]
        causal = {name: x for name, x in images.items() if name not in ("token_type_ids", "mm_token_type_ids")}
        causal_prefill = model(**causal).logits[real]
        method = Method("fp16", 16, [bundle.layer_codecs(i) for i in range(2)], SegmentPolicy(residual=256))
        with simulated(model, adapt(model), method, StorageTally()), pytest.raises(KvcalError, match="attend to each other both ways"):
            model(**images, use_cache=False)
    # (Gemma 4's logits move 1.4e-3 with its K/V rounded to fp16, Gemma 4 Unified's 2e-3)
    atol = 2.5e-3 if model_type in GEMMA4 else 1e-3
    torch.testing.assert_close(ours_prefill, fp_prefill, rtol=0, atol=atol)
    assert (causal_prefill - fp_prefill).abs().max() > 0.05
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=atol)


def test_a_prefix_lm_reads_text_as_what_it_writes_and_refuses_a_prompt_it_would_attend_both_ways_unmasked():
    """PaliGemma attends its prompt both ways, told by token types; handed a prompt without them and without padding,
    transformers' SDPA attends it both ways too (its attention is not causal and gets no mask), where kvcal's would read
    it causally: the cache refuses that step in one line, storing nothing, and a prefill of its decoder alone (which
    cannot be told) is refused. Text of token type 1, read causally as what it writes (how kvcal calibrates and scores
    it), generates the model's own tokens through the cache."""
    model = tiny_model("paligemma")
    ids = prompt()
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            with pytest.raises(KvcalError, match="handed 12 tokens without a mask, which it attends both ways"):
                model(input_ids=ids, **cache_argument(cache), use_cache=True)
            assert cache.tokens() == []
        with pytest.raises(KvcalError, match="reads a prompt both ways where its token types say so"):
            fp_context(model, ids)
        fp = model.generate(input_ids=ids, **text_inputs(model, ids), **settings)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            ours = model.generate(input_ids=ids, **text_inputs(model, ids), **cache_argument(cache), **settings)
        both_ways = model.generate(input_ids=ids, **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)
    assert (torch.stack(both_ways.logits) - torch.stack(fp.logits)).abs().max() > 1e-3  # (the prompt read both ways)


def test_an_image_in_a_later_step_is_attended_both_ways_over_the_stored_tokens_as_the_models_cache_does(monkeypatch):
    """Gemma 3 4B-27B's decoder: a second step of 10 tokens bringing an image after 10 stored ones reads the stored
    tokens through the CPU kernel (a short step, its sliding layer's queries each in its window) and attends to the
    image's tokens both ways among its own (`ahead`), giving the logits of the model's own cache fed the same two steps (fp16 K/V: 1e-3) and those
    of the torch reference's way (1e-5)."""
    from transformers import DynamicCache

    from kvcal.runtime.layer import RuntimeLayer

    model = tiny_model("gemma3")
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 400, (1, 20), generator=generator)
    ids[0, 12:16] = model.config.image_token_id
    types, pixels = (ids == model.config.image_token_id).long(), torch.randn(1, 3, 28, 28, generator=generator)
    steps = [dict(input_ids=ids[:, :10], token_type_ids=types[:, :10]),
             dict(input_ids=ids[:, 10:], token_type_ids=types, pixel_values=pixels,  # (the sequence's: as generate does)
                  attention_mask=torch.ones(1, 20, dtype=torch.long))]
    served, short_step = [], RuntimeLayer._short_step
    monkeypatch.setattr(RuntimeLayer, "_short_step", lambda *args: served.append(short_step(*args)) or served[-1])

    def second_step(cache) -> torch.Tensor:
        model(**steps[0], **cache_argument(cache), use_cache=True)
        return model(**steps[1], **cache_argument(cache), use_cache=True).logits

    with torch.inference_mode():
        own = second_step(DynamicCache(config=model.config))
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            through_kernel = second_step(cache)
        assert [out is not None for out in served] == [False, False, True, True]  # the second step, on both layers
        monkeypatch.setattr(cpu_kernel, "library", lambda: None)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            by_reference = second_step(cache)
    torch.testing.assert_close(through_kernel, own, rtol=0, atol=1e-3)
    torch.testing.assert_close(through_kernel, by_reference, rtol=0, atol=1e-5)


def test_an_attention_outside_the_decoder_is_refused_where_it_reaches_kvcals():
    """Only the decoder's attention is kvcal's: a vision tower switched to kvcal's attention implementation by hand
    is refused in one line, naming it, and runs its own again once switched back."""
    model = tiny_model("llava")
    images = image_inputs("llava", model, prompt())
    tower = model.model.vision_tower
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)) as cache:
        tower.set_attn_implementation(ATTENTION_NAME)
        with pytest.raises(KvcalError, match="CLIPAttention is not an attention layer of the model's text decoder"):
            model(**images, **cache_argument(cache), use_cache=True)
        tower.set_attn_implementation("sdpa")
        model(**images, **cache_argument(cache), use_cache=True)


@pytest.mark.parametrize("model_type", [*IMAGES_AS_TOKENS, *known(("gemma4", "molmo2"))])
def test_a_model_reading_image_tokens_as_text_generates_its_own_fp_tokens_from_an_image(model_type):
    """Every composite whose decoder reads an image's tokens causally, as text (IMAGES_AS_TOKENS: Qwen's, GLM's, ERNIE's
    and Cosmos 3 Edge's at multimodal RoPE positions, which the model rotates keys by: KIVI stores them so), and Gemma
    4's (without use_bidirectional_attention) and Molmo 2's (whose mask stays causal) read so: kvcal wires the decoder
    alone, the vision tower runs its own attention, and through a cache keeping everything fp16 the model generates its
    own tokens from a prompt with an image, logits equal up to the fp16 rounding of K/V, the image's tokens in the
    cache; the model's attention implementations are its own after."""
    model = tiny_model(model_type)
    tokens = max(12, IMAGES[model_type][0] + 4)  # (DeepSeek-OCR 2's image: 145 tokens)
    images = image_inputs(model_type, model, prompt(tokens=tokens))
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    own = OWN_ATTENTION.get(model_type, "sdpa")
    with torch.inference_mode():
        fp = model.generate(**images, **settings)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            ours = model.generate(**images, **settings, **cache_argument(cache))
            assert cache.tokens() == [tokens + 8 - 1]
            if model_type not in ("fuyu", "chameleon", "emu3", "apertus1p5"):  # (no vision tower: Fuyu's patches' pixels embedded by a
                # linear layer, Chameleon's and Emu3's images a VQ model's codes)
                assert model.config.vision_config._attn_implementation == own
        text_only = model.generate(input_ids=images["input_ids"], **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)
    assert (torch.stack(text_only.logits) - torch.stack(fp.logits)).abs().max() > 0.05  # the image matters here
    assert {model.config._attn_implementation, model.config.get_text_config()._attn_implementation} == {own}


def test_a_model_attending_across_to_an_image_generates_its_own_fp_tokens_with_the_images_cache_its_own():
    """Llama 3.2 Vision's layers 0 and 2 attend across to an image (two tiles of 5 tokens: the vision tower's output)
    with the model's own attention over transformers' cache layers, which keep the image's keys and values; kvcal's
    layers 1 and 3 keep the text's. Through a cache keeping the text fp16 the model generates its own tokens from a
    prompt with an image, greedy and in two beams (the image's cache reordered with kvcal's), logits equal up to the
    fp16 rounding of K/V; the simulation scores the prompt with the image as the model does; the image matters."""
    from transformers.cache_utils import DynamicLayer

    from kvcal.kv import SegmentPolicy
    from kvcal.simulate import Method

    model = tiny_model("mllama")
    ids = prompt()
    ids[0, 1] = model.config.image_token_index
    images = dict(input_ids=ids, pixel_values=torch.randn(1, 1, 2, 3, 28, 28, generator=torch.Generator().manual_seed(1)),
                  aspect_ratio_ids=torch.tensor([[2]]), aspect_ratio_mask=torch.ones(1, 1, 2, dtype=torch.long),
                  cross_attention_mask=torch.ones(1, 12, 1, 2, dtype=torch.long))
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    bundle = fp16_kivi_bundle(model)
    with torch.inference_mode():
        fp, fp_beams = model.generate(**images, **settings), model.generate(**images, **settings, num_beams=2)
        with quantized_cache(model, bundle) as cache:
            ours = model.generate(**images, **settings, **cache_argument(cache))
            assert cache.tokens() == [12 + 8 - 1] and [type(cache.layers[i]) for i in (0, 2)] == [DynamicLayer] * 2
            assert [cache.layers[i].keys.shape[2] for i in (0, 2)] == [10, 10]
        with quantized_cache(model, bundle) as cache:
            beams = model.generate(**images, **settings, num_beams=2, **cache_argument(cache))
        method = Method("fp16", 16, [bundle.layer_codecs(i) for i in range(2)], SegmentPolicy(residual=256))
        with simulated(model, adapt(model), method, StorageTally()):
            simulated_logits = model(**images, use_cache=False).logits
        fp_logits = model(**images).logits
        text_only = model.generate(input_ids=ids, **settings)
    assert torch.equal(ours.sequences, fp.sequences) and torch.equal(beams.sequences, fp_beams.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)
    torch.testing.assert_close(simulated_logits, fp_logits, rtol=0, atol=1e-3)
    assert (torch.stack(text_only.logits) - torch.stack(fp.logits)).abs().max() > 0.05
    assert {model.config._attn_implementation, model.config.get_text_config()._attn_implementation} == {"sdpa"}


# a video of two frames, or 40 frames of audio: its tokens, the config's name for their token id, and its inputs as
# each model's processor gives them (Qwen2.5-VL's patches of two frames each, 2 x 2 merged into a token, at (time,
# height, width) positions; LLaVA-NeXT-Video's frames pooled into a token each; Video-LLaVA's 4 patches and a class
# token a frame; Qwen2.5-Omni's mel frames, 4 to a token, Qwen3-Omni's 8)
MEDIA = {"qwen2_5_vl": (8, "video_token_id", lambda: dict(pixel_values_videos=torch.randn(32, 3 * 2 * 14 * 14),
                                                          video_grid_thw=torch.tensor([[2, 4, 4]]))),
         "llava_next_video": (2, "video_token_index", lambda: dict(pixel_values_videos=torch.randn(1, 2, 3, 28, 28))),
         "video_llava": (10, "video_token_index", lambda: dict(pixel_values_videos=torch.randn(1, 2, 3, 28, 28))),
         **{kind: (tokens, "audio_token_id", lambda: dict(
             input_features=torch.randn(1, 16, 40), feature_attention_mask=torch.ones(1, 40, dtype=torch.long)))
            for kind, tokens in (("qwen2_5_omni_thinker", 10), ("qwen3_omni_moe_thinker", 5))},
         **known({"apertus1p5": (16, "audio_token_id", lambda: dict(  # (WavTokenizer's codes of 64 samples)
             input_values=torch.randn(1, 1, 64), padding_mask=torch.ones(1, 64, dtype=torch.long)))})}


@pytest.mark.parametrize("model_type", MEDIA)
def test_a_model_reading_video_or_audio_tokens_as_text_generates_its_own_fp_tokens(model_type):
    """A video's frames, or audio, reach the decoder as tokens read causally, as an image's: through a cache keeping
    everything fp16 the model generates its own tokens from a prompt with a video of two frames (Qwen2.5-VL's at
    multimodal RoPE positions, time advancing by frame) or with audio (the Omni thinkers', Apertus 1.5's as its
    tokenizer's codes), logits equal up to the fp16 rounding of K/V; the video or audio matters."""
    model = tiny_model(model_type)
    tokens, token_name, media = MEDIA[model_type]
    ids = prompt(tokens=12 + tokens)
    media_token = getattr(model.config, token_name)
    ids[0, 2:2 + tokens] = media_token
    inputs = dict(input_ids=ids, **media())
    if model_type in TOKEN_TYPED:
        inputs["mm_token_type_ids"] = (ids == media_token).long() * 2  # (2: a video's)
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        fp = model.generate(**inputs, **settings)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            ours = model.generate(**inputs, **settings, **cache_argument(cache))
            assert cache.tokens() == [12 + tokens + 8 - 1]
        text_only = model.generate(input_ids=ids, **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)
    assert (torch.stack(text_only.logits) - torch.stack(fp.logits)).abs().max() > 0.05


@pytest.mark.parametrize("model_type", known(("qwen2_5_vl", "qwen3_5", "qwen4_exp", "cohere_compass", "glm4v", "ernie4_5_vl_moe",
                                               "hy_v4_vl")))
def test_keys_stored_before_rope_refuse_image_tokens_at_multimodal_positions(architecture_bundles, model_type):
    """Qwen2.5-VL's, Qwen3.5's, Qwen4-Exp's, North's, GLM-4.1V's, ERNIE 4.5 VL's and Hy V4 VL's (MLA's rotated key)
    image tokens sit at (time, height, width) positions; keys stored before RoPE (the kvquant bundle) are rotated by one
    position each, so a prompt with an image is refused before anything is stored, in the cache and in the simulation;
    the prompt's text, twice in a batch, then decodes through it as through an empty cache (nothing of the refused step
    is kept: Qwen3.5's DeltaNet states did not take it, the positions Qwen4-Exp's model handed the cache are let go); a
    cache storing keys after RoPE, open beside it, serves the image."""
    model = tiny_model(model_type)
    bundle = architecture_bundles(model_type)["kvquant"]
    images = image_inputs(model_type, model, prompt())
    refusal = (r"given image or video tokens, at multimodal RoPE positions \(time, height and width\); layers \[0, 1\] "
               r"store keys before RoPE, which kvcal rotates by one position each: use a bundle or method storing keys "
               r"after RoPE \(kivi, kvmix, an engine's cache type\) for images")
    text = images["input_ids"].masked_fill(images["input_ids"] == model.config.image_token_id, 7).expand(2, -1)
    with torch.inference_mode():
        with quantized_cache(model, bundle) as cache:
            fresh = model(input_ids=text, **cache_argument(cache), use_cache=True).logits
            cache.reset()
            with pytest.raises(KvcalError, match=refusal):
                model(**images, **cache_argument(cache), use_cache=True)
            assert cache.tokens() == [] and cache.used_bytes() == 0
            assert torch.equal(model(input_ids=text, **cache_argument(cache), use_cache=True).logits, fresh)
            assert cache.tokens() == [12, 12]
            with quantized_cache(model, fp16_kivi_bundle(model)) as beside:
                model(**images, **cache_argument(beside), use_cache=True)
                assert beside.tokens() == [12]
        with simulated(model, adapt(model), artifact_method(str(bundle)), StorageTally()):
            with pytest.raises(KvcalError, match=refusal.replace(r"\[0, 1\]", r"\[0\]")):
                model(**images, use_cache=False)


@pytest.mark.parametrize("ask", [dict(softcap=30.0), dict(s_aux=torch.zeros(4)),
                                 dict(indices=torch.zeros(1, 1, 1, dtype=torch.int32))])
def test_an_attention_call_asking_for_what_kvcal_does_not_compute_is_refused(ask):
    """Score soft-capping (Gemma 2's), attention sinks (gpt-oss's) and an indexer's pick of tokens (DeepSeek Sparse
    Attention's) reach the attention implementation as keywords, which kvcal's cache and simulation would otherwise
    take and leave out, here on a model that has none of them."""
    from kvcal.kv import SegmentPolicy
    from kvcal.simulate import Method

    model = tiny_model("llama")
    bundle = fp16_kivi_bundle(model)
    method = Method("fp16", 16, [bundle.layer_codecs(i) for i in range(2)], SegmentPolicy(residual=256))
    refusal = f"LlamaAttention asks its attention for .* \\('{next(iter(ask))}'\\), which kvcal's attention does not compute"
    with torch.inference_mode():
        with quantized_cache(model, bundle) as cache, pytest.raises(KvcalError, match=refusal):
            model(prompt(), **cache_argument(cache), use_cache=True, **ask)
        with simulated(model, adapt(model), method, StorageTally()), pytest.raises(KvcalError, match=refusal):
            model(prompt(), use_cache=False, **ask)


def test_a_soft_cap_other_than_the_configs_is_refused():
    """Gemma 2's cap is what its config says, which the fits applied: a call asking for another one is refused."""
    model = tiny_model("gemma2")
    bundle = fp16_kivi_bundle(model)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 30.0
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        with pytest.raises(KvcalError, match="asks its attention to soft-cap scores at 30.0, its config at 0.05"):
            model(prompt(), **cache_argument(cache), use_cache=True)


def test_a_changed_attention_implementation_is_refused():
    model = tiny_model("llama")
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)) as cache:
        model.set_attn_implementation("sdpa")
        with pytest.raises(KvcalError, match="changed to 'sdpa'"):
            model.generate(prompt(), **cache_argument(cache), **GREEDY)


@pytest.mark.parametrize("original", ["sdpa", "eager"])
def test_nested_and_overlapping_caches_restore_the_attention_implementation_in_any_closing_order(original):
    """Caches open on one model share its wiring: each call is served by the cache it is given, and the model's
    own attention implementation comes back when the last cache closes, whichever closes first."""
    model = tiny_model("llama")
    model.set_attn_implementation(original)
    bundle = fp16_kivi_bundle(model)
    with torch.inference_mode():
        expected = model.generate(prompt(), **GREEDY)
        for order in itertools.permutations(range(3)):
            caches = [quantized_cache(model, bundle) for _ in range(3)]
            for index in order:
                assert model.config._attn_implementation == ATTENTION_NAME
                caches[index].close()
                caches[index].close()  # idempotent: a second close does not release another cache's hold
            assert model.config._attn_implementation == original
        outer = quantized_cache(model, bundle)
        with quantized_cache(model, bundle) as inner:
            assert torch.equal(model.generate(prompt(), **cache_argument(outer), **GREEDY), expected)
            outer.close()  # overlapping: the outer cache closes first
            with pytest.raises(KvcalError, match="closed"):
                model.generate(prompt(), **cache_argument(outer), **GREEDY)
            with quantized_cache(model, bundle) as nested:
                assert torch.equal(model.generate(prompt(), **cache_argument(nested), **GREEDY), expected)
            assert torch.equal(model.generate(prompt(), **cache_argument(inner), **GREEDY), expected)
            assert model.config._attn_implementation == ATTENTION_NAME
    assert model.config._attn_implementation == original


def test_a_simulation_and_a_cache_never_share_a_model():
    from kvcal.kv import SegmentPolicy
    from kvcal.simulate import Method

    model = tiny_model("llama")
    bundle = fp16_kivi_bundle(model)
    codecs = [bundle.layer_codecs(i) for i in range(len(bundle.layers))]
    method = Method("fp16", 16, codecs, SegmentPolicy(residual=256))
    with torch.inference_mode():
        with quantized_cache(model, bundle) as cache:
            with pytest.raises(KvcalError, match="wired for a kvcal quantized cache .* still open"):
                with simulated(model, adapt(model), method, StorageTally()):
                    pass
            assert model.config._attn_implementation == ATTENTION_NAME
            model.generate(prompt(), **cache_argument(cache), **GREEDY)
        with simulated(model, adapt(model), method, StorageTally()):
            with pytest.raises(KvcalError, match="wired for a kvcal simulation .* still open"):
                quantized_cache(model, bundle)
    assert model.config._attn_implementation == "sdpa"


# Sliding windows: the runtime attends over each sequence's last `window` tokens, as transformers does; attention
# chunks (Llama 4): over its chunk's, counted from its first real token.

SLIDING = known({"mistral": dict(sliding_window=8), "phi3": dict(sliding_window=8),  # every layer
           "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 0 full, layer 1 sliding
           **{kind: dict(sliding_window=8) for kind in (*ALTERNATING, "lfm3")},  # layer 0 sliding, layer 1 full
           "llama4_text": dict(attention_chunk_size=8)})  # layer 0 chunked, layer 1 full
# their caches need a window size (Gemma 3n's tiny model: 4 layers)
UNWINDOWED = {**{kind: dict(layer_types=["full_attention"] * (4 if kind in ("gemma3n_text", *GEMMA4) else 2))
                 for kind in ALTERNATING}, "llama4_text": dict(attention_chunk_size=64),
              "lfm3": dict(layer_types=["conv", "full_attention", "conv", "full_attention"])}


@pytest.mark.parametrize("model_type", SLIDING)
def test_a_sliding_window_model_generates_its_own_fp_tokens(model_type):
    """A window of 8 tokens, prompts of 24 and 17 (left-padded) and 12 new tokens: through kvcal's cache with
    a bundle that keeps everything fp16 (fp16_kivi_bundle) the model generates its own fp tokens, logits equal
    up to the fp16 rounding of K/V; the same weights without the window give other logits."""
    model = tiny_model(model_type, **SLIDING[model_type])
    ids, mask = left_padded((24, 17), seed=3)
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        fp = model.generate(input_ids=ids, attention_mask=mask, **settings)
        ours = generate(model, fp16_kivi_bundle(model), input_ids=ids, attention_mask=mask, **settings)
        full = tiny_model(model_type, **{**SLIDING[model_type], **UNWINDOWED.get(model_type, dict(sliding_window=None, use_sliding_window=False))})
        unwindowed = full.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    # Gemma 4's logits move by 1.4e-3, Gemma 4 Unified's by 2.04e-3, when their K/V alone are rounded to fp16 in
    # transformers' own cache (kvcal's are within 1e-6 of that)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0,
                               atol=2.5e-3 if model_type in GEMMA4 else 1e-3)
    assert (torch.stack(unwindowed.logits) - torch.stack(fp.logits)).abs().max() > 0.1  # the window matters here


def test_attention_chunks_decode_as_the_model_does_on_every_decode_path(decode_path):
    """Llama 4's chunks of 8 over left-padded prompts of 24 and 17 and 12 new tokens, each decode path reading only
    the sequence's chunk (the kernels: its first visible token; the reference: its mask), with every token fp16: the
    model's own tokens and logits (as test_a_sliding_window_model_generates_its_own_fp_tokens on the default path)."""
    model = tiny_model("llama4_text", attention_chunk_size=8)
    ids, mask = left_padded((24, 17), seed=3)
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        fp = model.generate(input_ids=ids, attention_mask=mask, **settings)
        ours = generate(model, fp16_kivi_bundle(model), input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)


@pytest.mark.parametrize("model_type", DSA)
def test_sparse_attention_generates_its_own_fp_tokens(model_type, decode_path):
    """DeepSeek Sparse Attention (DeepSeek-V3.2's, GLM-5's, Hy V4's indexer picking the 8 tokens each query attends to) over
    left-padded prompts of 24 and 17 and 12 new tokens, with every token fp16: the model's own tokens and logits, the
    cache keeping the indexer's keys as transformers' does (padding too), its attention over the tokens the indexer
    picked (read by the torch reference), the sequences' tokens told from padding by the mask; the same weights
    attending to 64 tokens give other logits."""
    def check(cache, fp):
        kept = [None if layer.index_keys is None else tuple(layer.index_keys.decoded().shape) for layer in cache.attention_layers]
        assert kept == [(2, 35, 80), None if model_type in HY_V4 else (2, 35, 80)]  # (Hy V4's layer 1 reads 0's pick)
        assert [layer.decode_path for layer in cache.attention_layers] == ["reference"] * 2  # (past the top 8)

    ids, mask = left_padded((24, 17), seed=3)
    assert_a_pick_generates_the_models_tokens(tiny_model(model_type), tiny_model(model_type, index_topk=64), ids, mask,
                                              check)


@pytest.mark.parametrize("model_type", MINIMAX_M3)
def test_block_sparse_attention_generates_its_own_fp_tokens(model_type, decode_path):
    """MiniMax-M3's block-sparse layer (its indexer picking, per KV head, the 2 blocks of 4 keys each query attends to)
    over two prompts of 24 tokens and 12 new ones, every token fp16: the model's own tokens and logits, the cache
    keeping the indexer's keys as transformers' does (through its cache layer's update_index), its attention over the
    blocks picked (read by the torch reference; the full layer by the default decoder); the same weights attending to
    64 blocks give other logits."""
    def check(cache, fp):
        assert [None if layer.index_keys is None else tuple(layer.index_keys.decoded().shape)
                for layer in cache.attention_layers] == [(2, 35, 16), None]
        assert [layer.decode_path for layer in cache.attention_layers] == [
            "reference", {"cpu-kernel": "cpu-kernel", "torch-reference": "reference"}[decode_path]]

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    assert_a_pick_generates_the_models_tokens(tiny_model(model_type), tiny_model(model_type, index_topk_blocks=64), ids,
                                              check=check)


@QWEN4_EXP
@pytest.mark.parametrize("lengths", [(24, 24), (24, 17)])
def test_tokens_picked_inside_the_mask_generate_their_own_fp_tokens(lengths, decode_path):
    """Qwen4-Exp's QSA layers (their indexer picks the tokens of 2 compressed blocks of 4 keys each query attends to,
    and those of its block not yet complete, and hands them to the attention inside its mask) over two prompts of 24
    tokens, or one left-padded to 24 from 17, and 12 new ones, every token fp16: the model's own tokens and logits, by
    greedy search and by beam search (which reorders the cache's sequences); the cache keeps the indexers' keys, and
    every token's positions on the first QSA layer, as transformers' does; its steps attend over the pick (read by the
    torch reference); the same weights picking 16 blocks give other logits."""
    def check(cache, fp):
        fp_cache = fp["cache"] if "cache" in fp else fp["past_key_values"]  # (its name from transformers 5.25)
        assert [tuple(layer.index_keys.decoded().shape) for layer in cache.attention_layers] == [(2, 35, 16)] * 2
        assert torch.equal(cache.attention_layers[0].indexer_position_ids, fp_cache.layers[1].indexer_position_ids)
        assert cache.attention_layers[1].indexer_position_ids is None
        assert [layer.decode_path for layer in cache.attention_layers] == ["reference"] * 2

    ids, mask = left_padded(lengths, seed=3)
    assert_a_pick_generates_the_models_tokens(tiny_model("qwen4_exp_text"), tiny_model("qwen4_exp_text", indexer_budget=64),
                                              ids, mask, check, beams=True)


@pytest.mark.parametrize("model_type", known(("qwen4_exp_text",)) + GLM5_NEXT)
def test_tokens_picked_decode_on_the_default_path_while_the_pick_is_every_token(model_type, decode_path):
    """Qwen4-Exp's QSA layers and GLM-5 Next's k-pool ones pick every token a query sees up to 11 (2 blocks or pools of
    4, and the one not yet complete): a prompt of 6 tokens and 5 new ones decode on the layers' default decoder, not
    the reference reading a pick."""
    model = tiny_model(model_type)
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)) as cache:
        model.generate(input_ids=ids, **cache_argument(cache), max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert cache.tokens() == [10]
        assert [layer.decode_path for layer in cache.attention_layers] == [
            {"cpu-kernel": "cpu-kernel", "torch-reference": "reference"}[decode_path]] * 2


@pytest.mark.parametrize("lengths", [(24, 24), (24, 17)])
@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_tokens_an_indexer_returns_generate_their_own_fp_tokens(model_type, lengths, decode_path):
    """GLM-5 Next's MLA without RoPE between KDA layers (its layer 1's k-pool indexer returns the tokens of the top 2
    pools of 4 keys and those of the pool not yet complete, which its layer 2 reuses) over two prompts of 24 tokens, or
    one left-padded to 24 from 17, and 12 new ones, every token fp16: the model's own tokens and logits, by greedy
    search and by beam search (which reorders the cache's sequences); the cache keeps layer 1's indexer states (its key,
    its pool gate's scores, whether the token is real: 2 x 16 + 1 channels a token, padding too) as transformers' does,
    layer 2 none; its steps attend over the pick (read by the torch reference); the same weights picking 64 tokens give
    other logits."""
    def check(cache, fp):
        kept = cache.attention_layers[0].index_keys.decoded()
        assert tuple(kept.shape) == (2, 35, 33) and cache.attention_layers[1].index_keys is None
        assert torch.equal(kept[..., -1], torch.cat([mask, torch.ones(2, 11, dtype=mask.dtype)], 1).to(kept.dtype))
        assert [layer.decode_path for layer in cache.attention_layers] == ["reference"] * 2

    ids, mask = left_padded(lengths, seed=3)
    assert_a_pick_generates_the_models_tokens(tiny_model(model_type), tiny_model(model_type, index_topk=64), ids, mask,
                                              check, beams=True)


@pytest.mark.parametrize("model_type", DOTS3_NOTE[:1])
def test_latent_layers_of_widths_of_their_own_generate_their_own_fp_tokens(model_type, decode_path):
    """dots.note3's MLA: layers 0 and 1 attend to the 8 tokens their indexer picks, its sliding layers 2 and 3 over
    their last 16 tokens with a latent of 64 channels and a rotated key of 32 (96 and 64 on the others), each layer's
    codecs at its own widths: over left-padded prompts of 24 and 17 and 12 new tokens, every token fp16, the model's own
    tokens and logits by greedy and by beam search; the sliding layers keep no indexer keys and decode on the layers'
    default decoder; the same weights picking 64 tokens give other logits."""
    def check(cache, fp):
        assert [layer.widths for layer in cache.attention_layers] == [(64, 96)] * 2 + [(32, 64)] * 2
        assert [None if layer.index_keys is None else tuple(layer.index_keys.decoded().shape)
                for layer in cache.attention_layers] == [(2, 35, 80)] * 2 + [None] * 2
        assert [layer.decode_path for layer in cache.attention_layers] == ["reference"] * 2 + [
            {"cpu-kernel": "cpu-kernel", "torch-reference": "reference"}[decode_path]] * 2
        assert [getattr(layer.span, "size", None) for layer in cache.attention_layers] == [None, None, 16, 16]

    ids, mask = left_padded((24, 17), seed=3)
    assert_a_pick_generates_the_models_tokens(tiny_model(model_type), tiny_model(model_type, index_topk=64), ids, mask,
                                              check, beams=True)


@pytest.mark.parametrize("model_type", DSA[:1] + HY_V4[:1] + MINIMAX_M3[:1] + known(("qwen4_exp_text",)) + GLM5_NEXT)
def test_indexer_keys_kept_in_fp8_are_what_the_indexer_reads_back(model_type, decode_path):
    """A bundle keeping indexer keys in FP8 (kvcal.indexer_keys), every other token fp16: generate() of 12 new tokens
    over prompts of 24 and 17 (MiniMax-M3, which refuses padding: of 24) stores each token's indexer keys as e4m3 codes
    and one fp32 scale (their bytes), the first indexed layer's as transformers' own cache holds them where each step's
    keys are rounded so, and gives the model's tokens and logits when its indexers read their keys so rounded."""
    model = tiny_model(model_type)
    ids, mask = left_padded((24, 24) if model_type in MINIMAX_M3 else (24, 17), seed=3)
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        with indexer_keys_kept_as(adapt(model), "fp8"):
            fp = model.generate(input_ids=ids, **settings)
        theirs = fp["cache"] if "cache" in fp else fp["past_key_values"]  # (its name from transformers 5.25)
        with quantized_cache(model, fp16_kivi_bundle(model, indexer_keys="fp8")) as cache:
            ours = model.generate(input_ids=ids, **cache_argument(cache), **settings)
            indexed = [i for i, width in enumerate(cache.adapter.index_widths) if width]
            for i in indexed:
                kept = _indexer_keys(theirs.layers[cache.adapter.model_layers[i]])
                width = cache.adapter.index_widths[i]
                assert cache.attention_layers[i].index_bytes() == 2 * 35 * token_bytes("fp8", width, 4) < kept.numel() * 4
                if i == indexed[0]:  # (from the embeddings alone: an fp16 cache's rounding reaches later layers' keys)
                    assert torch.equal(cache.attention_layers[i].index_keys.decoded(), kept)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)


@pytest.mark.parametrize("later_steps", LATER_STEPS)
@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_queries_an_indexer_picks_nothing_for_attend_to_nothing_in_a_later_step(model_type, later_steps):
    """GLM-5 Next without its tail pool picks nothing for a sequence's first 3 tokens (no complete pool of 4 yet): a
    1-token prompt, then a 5-token step (read as a prefill, or query by query as decode steps) gives transformers' own
    logits, those queries given no attention output as its SDPA gives them."""
    from transformers import DynamicCache

    model = tiny_model(model_type, index_kpool_always_select_tail=False)
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        own = DynamicCache(config=model.config)
        model(ids[:, :1], **cache_argument(own), use_cache=True)
        expected = model(ids[:, 1:], **cache_argument(own), use_cache=True).logits
        with quantized_cache(model, fp16_kivi_bundle(model), later_steps=later_steps) as cache:
            model(ids[:, :1], **cache_argument(cache), use_cache=True)
            got = model(ids[:, 1:], **cache_argument(cache), use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)


def test_block_sparse_attention_refuses_padded_sequences():
    """MiniMax-M3's indexer places key blocks by cache column and queries by position: left-padded prompts (whose
    picks transformers' own cache computes apart from each prompt's own) are refused before anything is stored; one
    prompt at a time, as the refusal says, then decodes through the same cache."""
    model = tiny_model("minimax_m3_vl_text")
    ids, mask = left_padded((24, 17), seed=3)
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)) as cache:
        with pytest.raises(KvcalError, match=r"block-sparse indexer places its key blocks by cache column and its queries "
                                             r"by position, which padding sets apart: .* give sequences of equal length"):
            model.generate(input_ids=ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=2, pad_token_id=0)
        assert cache.tokens() == [] and cache.used_bytes() == 0
        model.generate(input_ids=ids[:1], **cache_argument(cache), max_new_tokens=2, pad_token_id=0)  # (one at a time)
        assert cache.tokens() == [25]


# LongRoPE (Phi-3.5; Phi-4-mini: over 0.75 of each head, cos/sin scaled): a forward past its switch rotates every
# token by its long frequencies, and Phi-3's generate computes the sequence again when it first crosses over. The tiny
# Phi-3's switch: 16 tokens.

@pytest.mark.parametrize("model_type, partial", LONGROPE)
@pytest.mark.parametrize("recipe", RECIPES)
def test_longrope_past_its_switch_decodes_every_recipe_to_the_simulation(longrope_bundles, recipe, model_type, partial,
                                                                          decode_path):
    """A prefill of 20 tokens, past the switch, then decode steps to 40: each step's logits are the simulation's
    forward over the 40 tokens, every key rotated by the long frequencies (PhiMoE's: its short ones, scaled by its
    mscale). The first 20 tokens are kept fp16 (sink), as a prefill attends over its own tokens (the simulation:
    token by token, over them as stored)."""
    model = tiny_model(model_type, **longrope(16, partial, model_type=model_type))
    ids = torch.randint(0, 512, (2, TOKENS), generator=torch.Generator().manual_seed(5))
    bundle = load_bundle(longrope_bundles(partial, model_type)[recipe])
    bundle.layers = [dataclasses.replace(layer, sink=20) for layer in bundle.layers]
    with torch.inference_mode():
        with simulated(model, adapt(model), bundle_method(bundle), StorageTally()):
            simulated_logits = model(ids).logits
        with quantized_cache(model, bundle) as cache:
            model(ids[:, :20], **cache_argument(cache), use_cache=True)
            logits = [model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True).logits for t in range(20, TOKENS)]
    torch.testing.assert_close(torch.cat(logits, 1), simulated_logits[:, 20:], rtol=0, atol=1e-4)


def fp16_pre_rope_bundle(skvq_bundle):
    """An SKVQ bundle whose fp16 window (256 tokens) holds every token a test feeds: keys stored before RoPE, in fp16."""
    bundle = load_bundle(skvq_bundle)
    bundle.layers = [dataclasses.replace(layer, window=256) for layer in bundle.layers]
    return bundle


@pytest.mark.parametrize("model_type, partial", [case for case in LONGROPE if case[0] != "phi4_multimodal"])
@pytest.mark.parametrize("lengths", [pytest.param((10, 7), marks=LONGROPE_PREFILLED_AGAIN), (20, 5)])
def test_longrope_generates_its_own_fp_tokens_across_its_switch(longrope_bundles, lengths, model_type, partial,
                                                                decode_path):
    """12 new tokens after left-padded prompts below and past the switch: with every token fp16, keys stored after
    RoPE (fp16_kivi_bundle) or before it (fp16_pre_rope_bundle), generate gives the model's own tokens and logits (it
    empties kvcal's cache where it drops its own at the switch, and prefills the whole sequence again: Phi-3's and
    PhiMoE's generate both do)."""
    model = tiny_model(model_type, **longrope(16, partial, model_type=model_type))
    ids, mask = left_padded(lengths, seed=3)
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    bundles = (fp16_kivi_bundle(model), fp16_pre_rope_bundle(longrope_bundles(partial, model_type)["skvq"]))  # (autograd)
    with torch.inference_mode():
        fp = model.generate(input_ids=ids, attention_mask=mask, **settings)
        for bundle in bundles:
            with quantized_cache(model, bundle) as cache:
                ours = model.generate(input_ids=ids, attention_mask=mask, **cache_argument(cache), **settings)
                assert cache.long_era and cache.tokens() == [n + 11 for n in lengths]  # (not the last token)
            assert torch.equal(ours.sequences, fp.sequences)
            torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)


def test_phi4_multimodals_generate_across_longropes_switch_is_refused_and_past_it_gives_its_own_tokens():
    """Phi-4-multimodal's generate (transformers 5.23) drops the cache where the sequence first crosses the switch, as
    Phi-3's does, but goes on with the tokens it had not cached alone (its own tokens then are not its full
    forward's): kvcal refuses that call in one line, a decode step's (the last token) or a prompt's past a cached prefix.
    A prompt already past the switch never crosses it: generate gives the model's own tokens."""
    model = tiny_model("phi4_multimodal", **longrope(16, 0.75, model_type="phi4_multimodal"))
    settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        ids, mask = left_padded((10, 7), seed=3)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache, pytest.raises(
                KvcalError, match=r"without a cache on 1 token\(s\) from position 13 on, which reach past LongRoPE's "
                                  r"switch 16: Phi4MultimodalForCausalLM's generate drops the cache there"):
            model.generate(input_ids=ids, attention_mask=mask, **cache_argument(cache), **settings)
        long = torch.randint(3, 500, (1, 21), generator=torch.Generator().manual_seed(3))
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache, pytest.raises(
                KvcalError, match=r"without a cache on 18 token\(s\) from position 3 on"):
            model(long[:, :3], **cache_argument(cache), use_cache=True)
            model.generate(input_ids=long, attention_mask=torch.ones_like(long), **cache_argument(cache), **settings)
        ids, mask = left_padded((20, 5), seed=3)
        fp = model.generate(input_ids=ids, attention_mask=mask, **settings)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **cache_argument(cache), **settings), fp)


def test_a_step_past_longropes_switch_over_shorter_forwards_is_refused_until_the_cache_is_emptied(longrope_bundles):
    """Decode steps cross the switch outside generate: refused, the cache left as it was (the cached tokens'
    forwards rotated by the short frequencies); a call without the cache still is. After cache.reset(), the whole
    sequence's prefill gives a new cache's logits."""
    model = tiny_model("phi3", **longrope(16))
    ids = torch.randint(3, 512, (1, 17), generator=torch.Generator().manual_seed(0))
    pre_rope = fp16_pre_rope_bundle(longrope_bundles(1.0)["skvq"])
    with torch.inference_mode(), quantized_cache(model, pre_rope) as cache:
        model(ids[:, :16], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="positions end at 16, on the other side of LongRoPE's switch 16"):
            model(ids[:, 16:], **cache_argument(cache), use_cache=True)
        with pytest.raises(KvcalError, match="called without one"):
            model(ids)
        assert cache.tokens() == [16] and cache.lengths == [16]
        cache.reset()
        again = model(ids, **cache_argument(cache), use_cache=True).logits
        assert cache.tokens() == [17]
    with torch.inference_mode(), quantized_cache(model, pre_rope) as fresh:
        torch.testing.assert_close(again, model(ids, **cache_argument(fresh), use_cache=True).logits, rtol=0, atol=0)


@LONGROPE_PREFILLED_AGAIN
def test_generate_crossing_longropes_switch_with_two_caches_open_is_refused():
    """Generate drops the cache it was given: with two kvcal caches open on the model, which one is not known."""
    model = tiny_model("phi3", **longrope(16))
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)), \
            quantized_cache(model, fp16_kivi_bundle(model)) as second:
        with pytest.raises(KvcalError, match="other kvcal caches are open on the model"):
            model.generate(input_ids=ids, **cache_argument(second), max_new_tokens=8, do_sample=False)


# Left padding: which tokens are real is read from the 4-D mask, on every torch pyproject.toml admits.

def old_torch_sdpa_mask(*args, **kwargs):
    """transformers' SDPA mask as made for torch < 2.5: a row that sees no token is all True."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    return mask if mask is None else mask | (~mask).all(-1, keepdim=True)


def test_left_padding_on_torch_before_2_5_masks_generates_what_each_prompt_generates_alone(monkeypatch):
    from transformers import AttentionMaskInterface

    filled = []

    def mask_function(*args, **kwargs):
        mask = old_torch_sdpa_mask(*args, **kwargs)
        filled.append(mask is not None and bool(mask.all(-1).any()))
        return mask

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, ATTENTION_NAME, mask_function)
    monkeypatch.setattr(wiring, "PADDING_SEES_ALL", True)  # as on torch < 2.5, whose masks these are
    model = tiny_model("llama")
    bundle = fp16_kivi_bundle(model)
    ids, mask = left_padded((21, 9, 14), seed=6)
    settings = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        batch = generate(model, bundle, input_ids=ids, attention_mask=mask, **settings)
        for row in range(3):
            alone = generate(model, bundle, input_ids=ids[row : row + 1, mask[row].bool()], **settings)
            torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=1e-4)
    assert filled[0]  # the batch's prefill mask had rows of padding filled with True


# One plan per decode step: the torch operations of a step do not depend on the batch size.

@pytest.mark.parametrize("recipe", RECIPES)
def test_a_decode_step_runs_the_same_torch_operations_for_2_and_8_sequences(recipe_bundles, recipe, decode_path):
    """Appends write the whole batch (one encode, one store per segment), the reference (or the CPU kernel, one
    call per layer) attends over the whole batch at once and what layers share is made once per step: no
    operation per sequence. A single sequence's fp16 rows are written and taken as slices instead of indexed
    stores: no more operations than a batch's."""
    model = tiny_model("llama")
    one, two, eight = (decode_step_operations(model, recipe_bundles[recipe], batch) for batch in (1, 2, 8))
    assert two == eight, (two - eight) + (eight - two)
    assert one.total() <= eight.total(), (one - eight) + (eight - one)
    attentions = model.config.num_hidden_layers if decode_path == "torch-reference" else 0  # one SDPA per layer, or none
    assert one["aten::scaled_dot_product_attention"] == eight["aten::scaled_dot_product_attention"] == attentions
