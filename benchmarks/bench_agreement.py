"""Why greedy agreement with fp is low (issue 14, item 5c): for each bundle, greedy generation's token agreement
with fp (what `kvcal eval generate` reports), where the first divergence falls, and the teacher-forced top-1
agreement: fp's own greedy continuation fed token by token through the bundle's runtime cache, counting the steps
whose argmax is fp's next token. Greedy agreement compounds: after the first different token the two texts
differ in every later position even where each step would agree, so a recipe that disagrees on a few close calls
early reads as a low greedy agreement. Also printed: fp's top-1 minus top-2 logit at the steps a bundle's
teacher-forced argmax differs (small = a near tie that any perturbation flips) and over all steps.

Prompts: the first --prompts paragraphs of wikitext-2 test longer than 400 characters (headings skipped), cut to
--prompt-tokens tokens; --new-tokens generated greedily. Bundles: --bundle NAME=PATH, repeated.

Usage: python benchmarks/bench_agreement.py --bundle nuq3=B1 --bundle mixed=B2 --bundle kvmix=B3
Writes benchmarks/results/agreement.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, provenance, write_markdown, write_result  # noqa: E402


def prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    text = (SHARED / "data" / "wikitext-2" / "test.txt").read_text()
    paragraphs = [p.strip() for p in text.split("\n") if len(p.strip()) > 400 and not p.strip().startswith("=")]
    return [tokenizer(p, add_special_tokens=False).input_ids[:tokens] for p in paragraphs[:count]]


def greedy(model, ids: list[int], new_tokens: int, bundle=None) -> list[int]:
    from kvcal.runtime import quantized_cache

    x = torch.tensor([ids])
    settings = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        if bundle is None:
            return model.generate(**settings)[0, len(ids):].tolist()
        with quantized_cache(model, bundle) as cache:
            return model.generate(**settings, past_key_values=cache)[0, len(ids):].tolist()


def teacher_forced(model, ids: list[int], continuation: list[int], bundle) -> list[int]:
    """The bundle's argmax at each step of `continuation`, fed one token at a time through its runtime cache."""
    from kvcal.runtime import quantized_cache

    predictions = []
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        x = torch.tensor([ids])
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=cache).logits[0, -1]
        for token in continuation:
            predictions.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[0, -1]
    return predictions


def fp_margins(model, ids: list[int], continuation: list[int]) -> list[float]:
    """fp's top-1 minus top-2 logit at each step of its own continuation."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + continuation])).logits[0, len(ids) - 1:len(ids) - 1 + len(continuation)]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", action="append", required=True, metavar="NAME=PATH", help="a bundle to compare with fp (repeat)")
    parser.add_argument("--prompts", type=int, default=12, help="prompts (default 12)")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument("--model", default=None, help="model (default: the packaged SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    bundles = dict(b.split("=", 1) for b in args.bundle)
    from kvcal.models import load_model

    started = provenance()
    model, tokenizer, _ = load_model(args.model)
    cases = prompts(tokenizer, args.prompts, args.prompt_tokens)
    references = [greedy(model, ids, args.new_tokens) for ids in cases]
    margins = [fp_margins(model, ids, ref) for ids, ref in zip(cases, references)]
    rows = []
    for name, path in bundles.items():
        began = time.time()
        same = steps = diverged = forced_same = 0
        flipped = []
        for ids, ref, margin in zip(cases, references, margins):
            tokens = greedy(model, ids, args.new_tokens, path)
            equal = [a == b for a, b in zip(tokens, ref)]
            same, steps = same + sum(equal), steps + len(ref)
            diverged += equal.index(False) if False in equal else len(ref)
            forced = teacher_forced(model, ids, ref, path)
            forced_same += sum(a == b for a, b in zip(forced, ref))
            flipped += [m for m, a, b in zip(margin, forced, ref) if a != b]
        rows.append({"bundle": name, "path": path, "greedy_agreement": same / steps, "first_divergence": diverged / len(cases),
                     "teacher_forced_top1": forced_same / steps, "fp_margin_where_they_differ": median(flipped),
                     "fp_margin_all_steps": median([m for ms in margins for m in ms]), "seconds": round(time.time() - began, 1)})
        print(rows[-1], flush=True)
    settings = {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    write_result("agreement", {"settings": settings, "rows": rows, "argv": sys.argv[1:]}, started)
    lines = [f"# Greedy vs teacher-forced agreement with fp ({started['device']}, commit {started['commit']}, {started['date']})", "",
             f"{args.prompts} wikitext-2 test paragraphs cut to {args.prompt_tokens} tokens, {args.new_tokens} greedy tokens each; "
             "teacher-forced: fp's continuation fed through each bundle's runtime cache. Margin: fp's top-1 minus top-2 logit "
             "(median).", "",
             "| bundle | greedy agreement | first divergence (tokens) | teacher-forced top-1 | fp margin where they differ | fp margin, all steps |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['bundle']} | {r['greedy_agreement']:.1%} | {r['first_divergence']:.1f} of {args.new_tokens} | "
              f"{r['teacher_forced_top1']:.1%} | {r['fp_margin_where_they_differ']:.2f} | {r['fp_margin_all_steps']:.2f} |" for r in rows]
    write_markdown("agreement", lines)


if __name__ == "__main__":
    main()
