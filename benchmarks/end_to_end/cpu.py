"""The runtime cache on SmolLM2-135M with every recipe's bundle: cache memory at a context length (live vs
formula vs fp16), passkey retrieval per context length, and Cocktail vs uniform int2 on questions about
one paragraph of a long wikitext context (agreement of the answer's tokens with fp).

Bundles: artifacts/runtime/{kvquant,mixed,skvq,kivi,kvmix}.safetensors (see the README for the commands).
Usage: python -m benchmarks.end_to_end cpu [--lengths 1024,2048,4096,8184] [--samples 20] [--memory-context 4096]
       [--cocktail-questions 5]
Writes benchmarks/results/runtime_{memory,passkey,cocktail}.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import REPO, SHARED, provenance, write_markdown, write_result

BUNDLES = {name: REPO / "artifacts" / "runtime" / f"{name}.safetensors" for name in ("kvquant", "mixed", "skvq", "kivi", "kvmix")}
MIB = 2**20


def memory(model, ids, context: int, started: dict) -> None:
    from kvcal.generation import measure_memory

    rows = [{"method": name, **measure_memory(model, path, ids[:context])} for name, path in BUNDLES.items()]
    write_result("runtime_memory", {"model": "SmolLM2-135M-Instruct", "context": context, "results": rows}, started)
    lines = [f"# KV cache memory at {context} tokens (SmolLM2-135M, one sequence, prefill in one step)", "",
             "| recipe | live MiB | formula MiB | fp16 MiB | vs fp16 | outliers |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['live_bytes'] / MIB:.3f} | {r['formula_bytes'] / MIB:.3f} | {r['fp16_bytes'] / MIB:.3f} | "
              f"{r['live_bytes'] / r['fp16_bytes']:.1%} | {r['outliers']} |" for r in rows]
    write_markdown("runtime_memory", lines)


def passkey(model, tokenizer, ids, lengths: list[int], samples: int, started: dict) -> None:
    from kvcal.bundle import load_bundle
    from kvcal.generation import passkey_accuracy

    began = time.perf_counter()
    bundles = {name: load_bundle(path, model=model) for name, path in BUNDLES.items()}
    results = passkey_accuracy(model, tokenizer, bundles, ids, lengths, samples, seed=0)
    write_result("runtime_passkey", {"model": "SmolLM2-135M-Instruct", "filler": "wikitext-2 test", "samples": samples,
                                     "seconds": round(time.perf_counter() - began, 1),
                                     "results": [r.as_dict() for r in results]}, started)
    lines = [f"# Passkey retrieval, {samples} samples per length (SmolLM2-135M, wikitext-2 test filler)", "",
             "One fp prefill of each prompt but its last token is loaded into every method's cache; the last prompt token",
             "and the 8 answer tokens are decoded by each method. Correct = the 5-digit key appears in the answer.", "",
             "| method | " + " | ".join(map(str, lengths)) + " |", "|---" * (len(lengths) + 1) + "|"]
    for method in ["fp", *BUNDLES]:
        lines.append(f"| {method} | " + " | ".join(f"{r.correct}/{r.samples}" for r in results if r.method == method) + " |")
    write_markdown("runtime_passkey", lines)


def answer_nll(model, tokenizer, context: str, query: str, answer: torch.Tensor, widths: list[int]) -> float:
    """Mean NLL of fp's answer tokens, teacher-forced after the query, with the context cached at `widths`."""
    from kvcal.model_caches import cache_argument
    from kvcal.policy.cocktail import compressed_cache

    context_ids = tokenizer(context, return_tensors="pt").input_ids
    query_ids = tokenizer(query, add_special_tokens=False, return_tensors="pt").input_ids
    with compressed_cache(model, context_ids, widths) as cache:
        logits = model(torch.cat([query_ids, answer[None]], dim=1), **cache_argument(cache), use_cache=True).logits
    predicted = logits[0, query_ids.shape[1] - 1 : -1]
    return torch.nn.functional.cross_entropy(predicted.float(), answer).item()


def cocktail(model, tokenizer, questions: int, started: dict) -> None:
    """Contexts of 12 wikitext paragraphs; the query is the first sentence of one of them, asking the model
    to continue it; Cocktail's widths vs every chunk int2: 32 greedy tokens compared with fp's, and the NLL of
    fp's answer teacher-forced under each cache (smooth where token agreement collapses at one divergence)."""
    from kvcal.policy.cocktail import CHUNK, ChunkEncoder, generate, plan

    encoder = ChunkEncoder()
    paragraphs = [p.strip() for p in (SHARED / "data" / "wikitext-2" / "test.txt").read_text().split("\n") if len(p.strip()) > 600]
    rng = random.Random(0)
    rows = []
    for _ in range(questions):
        chosen = rng.sample(paragraphs, 12)
        target = rng.randrange(12)
        context = "\n".join(chosen)
        query = f"\nQuestion: continue this passage: \"{chosen[target].split(' . ')[0]}\"\nAnswer:"
        context_ids = tokenizer(context, return_tensors="pt").input_ids[0]
        widths = plan(context_ids, query, tokenizer, encoder)
        # the chunks that hold the target paragraph: token span of its characters
        start_char = context.index(chosen[target])
        prefix = len(tokenizer(context[:start_char], return_tensors="pt").input_ids[0])
        span = len(tokenizer(chosen[target], add_special_tokens=False).input_ids)
        target_chunks = range(prefix // CHUNK, min(len(widths), (prefix + span) // CHUNK))
        settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        fp, _ = generate(model, tokenizer, context, query, widths=[16] * len(widths), **settings)
        mixed, _ = generate(model, tokenizer, context, query, widths=widths, **settings)
        int2, _ = generate(model, tokenizer, context, query, widths=[2] * len(widths), **settings)
        nll = {name: answer_nll(model, tokenizer, context, query, fp, w) for name, w in (("cocktail", widths), ("int2", [2] * len(widths)))}
        rows.append({"context_tokens": len(context_ids), "chunks": len(widths),
                     "fp_answer_nll_cocktail": round(nll["cocktail"], 4), "fp_answer_nll_int2": round(nll["int2"], 4),
                     "widths": {w: widths.count(w) for w in (16, 4, 2)},
                     "target_chunks_at_16_or_4": sum(widths[i] in (16, 4) for i in target_chunks), "target_chunks": len(target_chunks),
                     "cocktail_agreement": float((mixed == fp).float().mean()), "int2_agreement": float((int2 == fp).float().mean())})
    write_result("runtime_cocktail", {"model": "SmolLM2-135M-Instruct", "questions": rows}, started)
    lines = ["# Cocktail vs uniform int2 (SmolLM2-135M, 12 wikitext-2 test paragraphs per context, 32 answer tokens)", "",
             "| context tokens | chunks fp16/int4/int2 | target chunks kept fp16 or int4 | Cocktail = fp | int2 = fp | "
             "fp answer NLL, Cocktail | fp answer NLL, int2 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context_tokens']} | {r['widths'][16]}/{r['widths'][4]}/{r['widths'][2]} | "
              f"{r['target_chunks_at_16_or_4']}/{r['target_chunks']} | {r['cocktail_agreement']:.1%} | {r['int2_agreement']:.1%} | "
              f"{r['fp_answer_nll_cocktail']:.3f} | {r['fp_answer_nll_int2']:.3f} |" for r in rows]
    write_markdown("runtime_cocktail", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 8184 = SmolLM2's 8192 positions less the 8 answer tokens
    parser.add_argument("--lengths", default="1024,2048,4096,8184")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--memory-context", type=int, default=4096)
    parser.add_argument("--cocktail-questions", type=int, default=5)
    parser.add_argument("--only", default="memory,passkey,cocktail")
    args = parser.parse_args()
    from kvcal.data import tokenize
    from kvcal.models import load_model

    started = provenance()
    model, tokenizer, _ = load_model(None, "auto", "cuda" if torch.cuda.is_available() else "cpu")
    ids = tokenize((SHARED / "data" / "wikitext-2" / "test.txt").read_text(), tokenizer)
    only = args.only.split(",")
    with torch.inference_mode():
        if "memory" in only:
            memory(model, ids, args.memory_context, started)
        if "passkey" in only:
            passkey(model, tokenizer, ids, [int(x) for x in args.lengths.split(",")], args.samples, started)
        if "cocktail" in only:
            cocktail(model, tokenizer, args.cocktail_questions, started)


if __name__ == "__main__":
    main()
