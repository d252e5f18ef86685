"""Evaluations that run the runtime cache through generate(): greedy agreement with the fp model,
passkey retrieval at several context lengths (also for engines' cache types, quantized on write), and cache memory
(live vs formula)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvcal.adapters import adapt, chunk_positions, decoder_of, index_key_bytes, kv_shapes, kv_widths, text_inputs
from kvcal.bundle import Bundle, load_bundle
from kvcal.errors import KvcalError
from kvcal.indexer_keys import token_bytes
from kvcal.model_caches import cache_argument
from kvcal.runtime import generate as quantized_generate
from kvcal.runtime import quantized_cache
from kvcal.runtime.fp_context import fp_context
from kvcal.runtime.memory import cache_bytes, fp16_bytes
from kvcal.simulate import Method, quantized_on_write

PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
DOORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")  # the multi-key variant's key names
ANSWER_TOKENS = 8  # passkey answers are this many greedy tokens


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of texts, left-padded with pad_id(tokenizer)."""
    pad = pad_id(tokenizer)
    rows = [tokenizer(text, return_tensors="pt").input_ids[0] for text in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def _greedy(model, bundle, ids, mask, new_tokens: int, pad: int) -> torch.Tensor:
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=pad, **text_inputs(model, ids))
    with torch.inference_mode():
        out = model.generate(**settings) if bundle is None else quantized_generate(model, bundle, **settings)
    return out[:, ids.shape[1]:].cpu()


@dataclass
class AgreementResult:
    method: str
    token_agreement: float  # fraction of generated positions equal to fp's
    prefix_agreement: float  # mean fraction of tokens before the first divergence from fp

    def as_dict(self) -> dict:
        return asdict(self)


def greedy_agreement(model, tokenizer, bundles: dict, prompts: list[str], new_tokens: int,
                     on_step: Callable[[], None] | None = None) -> list[AgreementResult]:
    """Greedy generation of `new_tokens` for a left-padded batch of prompts, fp first, then each bundle."""
    ids, mask = left_padded(tokenizer, prompts)
    device = model.get_input_embeddings().weight.device
    ids, mask = ids.to(device), mask.to(device)
    reference = _greedy(model, None, ids, mask, new_tokens, pad_id(tokenizer))
    results = [AgreementResult("fp", 1.0, 1.0)]
    for name, bundle in bundles.items():
        tokens = _greedy(model, bundle, ids, mask, new_tokens, pad_id(tokenizer))
        same = tokens == reference
        first_miss = torch.where(same.all(1), torch.full((len(same),), new_tokens), (~same).int().argmax(1))
        results.append(AgreementResult(name, float(same.float().mean()), float(first_miss.float().mean() / new_tokens)))
        if on_step is not None:
            on_step()
    return results


def _tokens(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def multikey_prompt(tokenizer, filler_ids: torch.Tensor, length: int, keys: list[int], depths: list[float],
                    asked: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(context, questions) of about `length` tokens: filler text with key i stated as the pass key of door DOORS[i] at
    depths[i] (0..1), and a question for each key index in `asked`."""
    needles = [_tokens(tokenizer, f" The pass key of the {DOORS[i]} door is {key}. Remember it. ") for i, key in enumerate(keys)]
    questions = [_tokens(tokenizer, f"\nWhat is the pass key of the {DOORS[i]} door? The pass key of the {DOORS[i]} door is")
                 for i in asked]
    budget = _filler_budget(length, sum(map(len, needles)) + max(map(len, questions)), f"its {len(keys)} keys and question",
                            filler_ids, "multi-key")
    cuts = sorted((int(depth * budget), i) for i, depth in enumerate(depths))
    pieces, start = [], 0
    for at, i in cuts:
        pieces += [filler_ids[start:at], needles[i]]
        start = at
    return torch.cat([*pieces, filler_ids[start:budget]]), questions


def _filler_budget(length: int, fixed: int, fixed_part: str, filler_ids: torch.Tensor, variant: str) -> int:
    """The filler tokens a `length`-token prompt takes beside `fixed` tokens of needles and question; refused where
    that is none, or more than the text holds."""
    budget = length - fixed
    if budget < 1:
        raise KvcalError(f"a {length}-token {variant} prompt leaves no room for filler: {fixed_part} take {fixed} tokens; "
                         f"give --lengths above {fixed}")
    if len(filler_ids) < budget:
        raise KvcalError(f"a {length}-token {variant} prompt needs {budget} filler tokens, the text has {len(filler_ids)}; "
                         "give a longer --dataset or shorter --lengths")
    return budget


def passkey_prompt(tokenizer, filler_ids: torch.Tensor, length: int, key: int, depth: float) -> torch.Tensor:
    """A prompt of about `length` tokens: filler text with the pass key stated at `depth` (0..1), then the question."""
    needle = _tokens(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = _tokens(tokenizer, PASSKEY_QUESTION)
    budget = _filler_budget(length, len(needle) + len(question), "its key and question", filler_ids, "passkey")
    filler = filler_ids[:budget]
    at = int(depth * budget)
    return torch.cat([filler[:at], needle, filler[at:], question])


@dataclass
class PasskeyResult:
    method: str
    length: int
    correct: int
    samples: int  # questions asked
    keys: int = 1  # keys in each prompt

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples

    def as_dict(self) -> dict:
        return {**asdict(self), "accuracy": self.accuracy}


def _answer(model, ids: torch.Tensor, cache, new_tokens: int, pad: int) -> torch.Tensor:
    """Greedy tokens after ids (1, n) with a cache that already holds a prefix of them."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(cache),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                         **text_inputs(model, ids))
    return out[0, ids.shape[1]:].cpu()


def empty_cache(model, method: Bundle | Method):
    """A context manager giving an empty cache for `model`: a bundle's quantized runtime cache, or for a baseline
    Method (an engine's cache type) transformers' cache quantizing each token on write (kvcal.simulate)."""
    if isinstance(method, Method):
        return contextlib.nullcontext(quantized_on_write(model, method))
    return quantized_cache(model, method)


def _passkey_prompts(tokenizer, filler_ids: torch.Tensor, lengths: list[int], samples: int, seed: int, keys: int,
                     asked: int) -> dict[int, list[tuple[torch.Tensor, list[torch.Tensor], list[int]]]]:
    """{length: `samples` prompts}, each (context ids, question ids, the keys asked), drawn from a generator seeded with
    `seed` and the length, so that a length's prompts are the same whatever other lengths are asked: with keys = 1 the
    context is all but the prompt's last token and that token the question."""
    prompts = {}
    for length in lengths:
        rng = random.Random(f"passkey {seed} {length}")  # (a str seed is hashed by sha512: the same in every process)
        prompts[length] = []
        for _ in range(samples):
            if keys == 1:
                key = rng.randrange(10000, 100000)
                prompt = passkey_prompt(tokenizer, filler_ids, length, key, rng.random())
                prompts[length].append((prompt[:-1], [prompt[-1:]], [key]))
            else:
                values = rng.sample(range(10000, 100000), keys)
                chosen = rng.sample(range(keys), asked)
                context_ids, questions = multikey_prompt(tokenizer, filler_ids, length, values, [rng.random() for _ in values], chosen)
                prompts[length].append((context_ids, questions, [values[i] for i in chosen]))
    return prompts


def passkey_accuracy(model, tokenizer, methods: dict, filler_ids: torch.Tensor, lengths: list[int], samples: int,
                     seed: int, on_step: Callable[[], None] | None = None, keys: int = 1, asked: int = 2,
                     chunk: int | None = None) -> list[PasskeyResult]:
    """Passkey retrieval: for every length, `samples` prompts (seeded); correct when the asked key appears in the
    greedy answer (8 tokens). With keys = 1, one random 5-digit key at a random depth, asked once; with keys > 1
    (the multi-key variant), that many keys of named doors at random depths, `asked` of them asked one question
    each. Per prompt, one fp prefill (in steps of `chunk` tokens; see fp_context) of its context, all but the last
    token (keys = 1) or all but the questions, is loaded into every method's cache (fp's own, and for each of
    `methods`, {name: Bundle or baseline Method}, its empty_cache); the rest of the prompt and the answer are decoded
    by each method, so every answer token reads that method's cache. fp first, then each method; on_step after each
    (question, method)."""
    device = model.get_input_embeddings().weight.device
    pad = tokenizer.eos_token_id
    long_rope = adapt(model).long_rope
    baselines = [name for name, method in methods.items() if isinstance(method, Method)]
    prompts = _passkey_prompts(tokenizer, filler_ids, lengths, samples, seed, keys, asked)
    for length in lengths:  # every prompt checked before the first runs
        for context_ids, questions, _ in prompts[length]:
            last = len(context_ids) + max(len(question) for question in questions) + ANSWER_TOKENS
            if long_rope is not None and baselines and len(context_ids) <= long_rope.switch < last:
                raise KvcalError(f"a passkey prompt of {length} tokens has its context end within LongRoPE's switch "
                                 f"({long_rope.switch}) and its answer past it, where generate drops the cache to compute "
                                 f"the sequence again, and would go on in fp for {', '.join(baselines)} (transformers' own "
                                 f"cache, quantizing each token it writes); give lengths above {long_rope.switch + 1}, or "
                                 "far enough below it that the answers end within it")
    results = []
    for length in lengths:
        correct = {name: 0 for name in ["fp", *methods]}
        for context_ids, questions, wanted in prompts[length]:
            with torch.inference_mode():
                context = fp_context(model, context_ids[None].to(device), chunk)
                for question, key in zip(questions, wanted):
                    ids = torch.cat([context_ids, question])[None].to(device)
                    for name in correct:
                        if name == "fp":
                            with context.continued() as cache:
                                answer = _answer(model, ids, cache, ANSWER_TOKENS, pad)
                        else:
                            with empty_cache(model, methods[name]) as cache:
                                cache.load(context)
                                answer = _answer(model, ids, cache, ANSWER_TOKENS, pad)
                        correct[name] += str(key) in tokenizer.decode(answer)
                        if on_step is not None:
                            on_step()
        results.extend(PasskeyResult(name, length, hits, samples * len(wanted), keys) for name, hits in correct.items())
    return results


def measure_memory(model, bundle, context_ids: torch.Tensor, chunk: int | None = None) -> dict:
    """Prefill `context_ids` (1-D) into a quantized cache, in steps of `chunk` tokens (None: one step; a chunked
    prefill keeps the attention of a long context within memory); its live bytes, the formula's, and those of
    transformers' own fp16 cache for the model."""
    bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    fingerprint = bundle.fingerprint
    widths, value_widths = kv_widths(fingerprint), kv_widths(fingerprint, "v")
    kv_heads = [heads for heads, _ in kv_shapes(fingerprint)]
    tokens = len(context_ids)
    ids = context_ids[None].to(model.get_input_embeddings().weight.device)
    step = chunk or tokens
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        if cache.adapter.long_rope is not None:
            cache.adapter.long_rope.check_prefill_steps(tokens, step)
        for start in range(0, tokens, step):
            piece = ids[:, start : start + step]
            decoder_of(model)(piece, **cache_argument(cache), use_cache=True, position_ids=chunk_positions(start, piece))
    outliers = cache.outliers()
    spans = cache.adapter.spans
    key_bytes = index_key_bytes(cache.adapter.model_type, model.dtype.itemsize)
    stored_index = [token_bytes(bundle.indexer_keys, width, key_bytes) for width in cache.adapter.index_widths]
    return {"recipe": bundle.recipe_name, "tokens": tokens, "live_bytes": cache.used_bytes(),
            "formula_bytes": cache_bytes(bundle.layers, widths, tokens, outliers, chunk, kv_heads=kv_heads,
                                         spans=spans, value_width=value_widths, index_bytes=stored_index),
            "fp16_bytes": fp16_bytes(fingerprint["num_layers"], widths, tokens, spans, value_widths,
                                     cache.adapter.index_bytes(model.dtype)),
            "outliers": outliers}
