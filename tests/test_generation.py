"""kvcal.generation's prompts (the passkey and multi-key retrieval prompts) and its refusals."""

import pytest
import torch

from helpers.tiny_bundles import fp16_kivi_bundle
from helpers.tiny_models import DOTS3_NOTE, SPARSE_LATENTS, longrope, tiny_model
from kvcal.errors import KvcalError
from kvcal.generation import DOORS, measure_memory, multikey_prompt, passkey_accuracy
from kvcal.methods import baseline_method


def test_a_multikey_prompt_states_each_key_once_in_depth_order_and_asks_the_chosen_ones(tiny_tokenizer):
    filler = torch.arange(3, 403)
    context, questions = multikey_prompt(tiny_tokenizer, filler, 300, [11111, 22222, 33333], [0.9, 0.1, 0.5], [2, 0])
    text = tiny_tokenizer.decode(context)
    positions = [text.index(f"pass key of the {DOORS[i]} door is {key}") for i, key in ((0, 11111), (1, 22222), (2, 33333))]
    assert positions[1] < positions[2] < positions[0]  # depths 0.1, 0.5, 0.9
    assert all(text.count(str(key)) == 1 for key in (11111, 22222, 33333))
    for question, i in zip(questions, (2, 0)):
        assert tiny_tokenizer.decode(question).strip().startswith(f"What is the pass key of the {DOORS[i]} door?")
    assert len(context) + max(map(len, questions)) == 300
    with pytest.raises(KvcalError, match="needs .* filler tokens, the text has 10; give a longer --dataset"):
        multikey_prompt(tiny_tokenizer, filler[:10], 300, [11111, 22222], [0.2, 0.4], [0])
    with pytest.raises(KvcalError, match="no room for filler: its 8 keys and question take .* give --lengths above"):
        multikey_prompt(tiny_tokenizer, filler, 100, list(range(11111, 11119)), [0.5] * 8, [0])


def test_a_lengths_passkey_prompts_do_not_depend_on_the_other_lengths_asked(tiny_tokenizer):
    from kvcal.generation import _passkey_prompts

    filler = torch.arange(3, 403)
    for keys, asked in ((1, 1), (3, 2)):
        alone = _passkey_prompts(tiny_tokenizer, filler, [200], 2, 0, keys, asked)[200]
        among = _passkey_prompts(tiny_tokenizer, filler, [300, 200], 2, 0, keys, asked)[200]
        assert [(torch.equal(a[0], b[0]), a[2] == b[2]) for a, b in zip(alone, among)] == [(True, True)] * 2
    seeded = [_passkey_prompts(tiny_tokenizer, filler, [200], 1, seed, 1, 1)[200][0][2] for seed in (0, 1)]
    assert seeded[0] != seeded[1]


def test_a_passkey_length_too_short_for_its_keys_is_refused_before_any_prompt_runs(tiny_tokenizer):
    """The prompts of every length are made first: a short last length stops the run before the first answer."""
    model = tiny_model("llama")
    steps = []
    with pytest.raises(KvcalError, match="a 100-token multi-key prompt leaves no room for filler"):
        passkey_accuracy(model, tiny_tokenizer, {}, torch.arange(3, 403), [300, 100], samples=1, seed=0,
                         on_step=lambda: steps.append(1), keys=8)
    assert not steps


def test_passkey_baselines_whose_answers_cross_longropes_switch_are_refused(tiny_tokenizer):
    """Phi-3's generate drops the cache where an answer crosses LongRoPE's switch (99 here; the prompt's context: 99
    tokens) and goes on in fp: a baseline's cache (transformers' own, quantizing what it writes) would score fp."""
    model = tiny_model("phi3", **longrope(99))
    methods = {"int4-g16": baseline_method("int4-g16", [16, 16])}
    with pytest.raises(KvcalError, match="its answer past it, .* in fp for int4-g16"):
        passkey_accuracy(model, tiny_tokenizer, methods, torch.arange(3, 403), [100], samples=1, seed=0)


def test_a_memory_measure_prefilled_in_steps_across_longropes_switch_is_refused():
    model = tiny_model("phi3", **longrope(16))
    with pytest.raises(KvcalError, match="give a prefill chunk of more than 16 tokens"):
        measure_memory(model, fp16_kivi_bundle(model), torch.arange(3, 27), chunk=8)


@pytest.mark.skipif(not DOTS3_NOTE, reason="dots.note3 is new in transformers 5.25")
def test_a_memory_measure_counts_indexer_keys_as_the_model_hands_them_over():
    """dots.note3's indexers rotate their keys by fp32 cos/sin: in a bf16 model they come fp32 (80 channels a token on
    layers 0 and 1), 4 bytes a channel kept as computed, or FP8 codes and a scale; the live bytes are the formula's."""
    model = tiny_model("dots3_note_text").to(torch.bfloat16)
    measured = {keys: measure_memory(model, fp16_kivi_bundle(model, indexer_keys=keys), torch.arange(3, 43))
                for keys in ("model", "fp8")}
    for result in measured.values():
        assert result["live_bytes"] == result["formula_bytes"]
    assert measured["model"]["live_bytes"] - measured["fp8"]["live_bytes"] == 2 * 40 * (80 * 4 - (80 + 4))


@SPARSE_LATENTS
def test_a_memory_measure_of_sparse_attention_counts_the_indexer_keys():
    """DeepSeek-V3.2's cache holds its indexer's keys (80 channels a token and layer, fp32 here) beside the latent and
    the rotated key: the live bytes, the formula's and transformers' own fp16 cache's all count them."""
    model = tiny_model("deepseek_v32")
    measured = measure_memory(model, fp16_kivi_bundle(model), torch.arange(3, 43), chunk=16)
    index_bytes = 2 * 40 * 80 * 4
    assert measured["live_bytes"] == measured["formula_bytes"] == 2 * 40 * (96 + 64) * 2 + index_bytes
    assert measured["fp16_bytes"] == measured["live_bytes"]  # (every token fp16 here)
