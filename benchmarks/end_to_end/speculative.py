"""Prompt lookup decoding (transformers' `generate(..., prompt_lookup_num_tokens=n)`: candidates copied from the prompt,
checked in one step, the rejected ones taken back with `crop`) through kvcal's cache: ms per new token of greedy
generate() and of prompt lookup, with transformers' DynamicCache and with kvcal's caches, side by side in one run.

Prompts ask the model to repeat a wikitext-2 test passage (its chat template where it has one), the case prompt lookup
serves: its candidates come from the prompt. Caches: DynamicCache, 2-bit KIVI (G = 32, an fp16 residual of 128: made
in memory, no calibration) and each --bundles path. Per cache and prompt the runs go in turn --rounds times (the
median kept); a row gives the mean over the prompts of ms per new token, its ratio to DynamicCache's greedy, the
forwards per new token (one a token for greedy; fewer where candidates are accepted) and how many new tokens equal
greedy's on the same cache (a step of several tokens attends to its own in fp16, a decode step to what it stored: on
a quantized cache the two may part). kvcal's caches also run prompt lookup with later_steps="decode" (each checked
candidate read as its decode step would: greedy's logits up to float rounding).

Usage: python -m benchmarks.end_to_end speculative [--model SPEC] [--samples 3] [--passage-tokens 256]
       [--new-tokens 64] [--lookup 10] [--bundles PATH,...] [--rounds 2] [--out NAME]      (see --help)
Writes benchmarks/results/speculative_<device>.{json,md} (--out).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.common import (SHARED, device_slug, kivi2_bundle, provenance, timed_in_turn, write_markdown,
                               write_result)

BASELINE = "DynamicCache"
# decoding -> (looking up candidates, the cache's later_steps); DynamicCache runs the first two
WAYS = {"greedy": (False, "prefill"), "lookup": (True, "prefill"), "lookup, later_steps=decode": (True, "decode")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="A model spec as kvcal takes it (default: the packaged SmolLM2).")
    parser.add_argument("--samples", type=int, default=3, help="Prompts, each a different passage.")
    parser.add_argument("--passage-tokens", type=int, default=256, help="Tokens of each passage to repeat.")
    parser.add_argument("--new-tokens", type=int, default=64, help="Tokens generated per prompt (no early stop).")
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens: candidates per check.")
    parser.add_argument("--bundles", default="", help="Comma-separated bundle paths for this model, beside KIVI-2.")
    parser.add_argument("--rounds", type=int, default=2, help="Timed runs of each configuration per prompt.")
    parser.add_argument("--out", default=None, help="Result name (default speculative_<device>).")
    args = parser.parse_args(argv)
    for name in ("samples", "passage_tokens", "new_tokens", "lookup", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    missing = [path for path in filter(None, args.bundles.split(",")) if not Path(path).is_file()]
    if missing:
        parser.error(f"--bundles: no bundle at {', '.join(missing)}; make one with kvcal calibrate")
    return args


def prompts(tokenizer, samples: int, passage_tokens: int) -> list[torch.Tensor]:
    """(1, tokens) ids of each prompt: a request to repeat a passage of the wikitext-2 test split."""
    paragraphs = [p.strip() for p in (SHARED / "data" / "wikitext-2" / "test.txt").read_text().split("\n") if len(p.strip()) > 600]
    made = []
    for paragraph in paragraphs[:samples]:
        passage = tokenizer.decode(tokenizer(paragraph).input_ids[:passage_tokens])
        request = f"Repeat the following text exactly.\n\n{passage}"
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = f"{request}\n\n"
        made.append(tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids)
    return made


def caches(model, bundle_paths: list[str]) -> dict:
    """name -> the bundle a cache is made of (None: DynamicCache)."""
    from kvcal.bundle import load_bundle

    return {BASELINE: None, "kvcal kivi2-g32": kivi2_bundle(model),
            **{f"kvcal {Path(path).stem}": load_bundle(path, model=model) for path in bundle_paths}}


def run(model, bundle, ids: torch.Tensor, new_tokens: int, lookup: int | None, pad: int,
        later_steps: str = "prefill") -> tuple[torch.Tensor, int]:
    """(the new tokens, forwards of the model) of one greedy generate(), with prompt lookup where `lookup`, on a cache
    with `later_steps` (kvcal.runtime.quantized_cache's)."""
    from kvcal.runtime import generate

    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    settings = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    if lookup:
        settings["prompt_lookup_num_tokens"] = lookup
    try:
        out = model.generate(**settings) if bundle is None else generate(model, bundle, later_steps, **settings)
    finally:
        hook.remove()
    return out[0, ids.shape[1]:], len(forwards)


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvcal.models import load_model

    started = provenance()
    model, tokenizer, source = load_model(args.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    made = caches(model, list(filter(None, args.bundles.split(","))))
    per_prompt = {(name, way): [] for name, bundle in made.items() for way in WAYS
                  if bundle is not None or WAYS[way][1] == "prefill"}
    with torch.inference_mode():
        for i, ids in enumerate(prompts(tokenizer, args.samples, args.passage_tokens)):
            calls = {(name, way): (lambda bundle=made[name], way=way: run(model, bundle, ids, args.new_tokens,
                                                                            args.lookup if WAYS[way][0] else None, pad,
                                                                            WAYS[way][1]))
                     for name, way in per_prompt}
            outputs, ms = timed_in_turn(calls, args.rounds)
            for (name, way), (tokens, forwards) in outputs.items():
                greedy = outputs[name, "greedy"][0]
                per_prompt[name, way].append({"ms_per_token": ms[name, way] / args.new_tokens,
                                              "forwards_per_token": forwards / args.new_tokens,
                                              "same_as_greedy": float((tokens == greedy).float().mean())})
            print(f"prompt {i + 1}/{args.samples}: {ids.shape[1]} tokens", flush=True)
    mean = lambda rows, key: statistics.fmean(row[key] for row in rows)
    baseline = mean(per_prompt[BASELINE, "greedy"], "ms_per_token")
    rows = [{"cache": name, "decoding": way, "ms_per_token": round(mean(found, "ms_per_token"), 2),
             "vs_dynamic_greedy": round(mean(found, "ms_per_token") / baseline, 3),
             "forwards_per_token": round(mean(found, "forwards_per_token"), 3),
             "same_as_greedy": round(mean(found, "same_as_greedy"), 3)} for (name, way), found in per_prompt.items()]
    name = args.out or f"speculative_{device_slug(started['device'])}"
    settings = {key: getattr(args, key) for key in ("samples", "passage_tokens", "new_tokens", "lookup", "rounds")}
    write_result(name, {"model": source.name, **settings, "results": rows}, started)
    lines = [f"# Prompt lookup decoding through the cache ({source.name}, {started['device']}, {started['commit']})", "",
             f"{args.samples} prompts asking to repeat a {args.passage_tokens}-token wikitext-2 passage, {args.new_tokens} new "
             f"tokens each, {args.lookup} candidates a check; ms per new token, mean over the prompts of the median of "
             f"{args.rounds} runs.", "",
             "| cache | decoding | ms / token | vs DynamicCache greedy | forwards / token | tokens = greedy's |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['decoding']} | {r['ms_per_token']:.2f} | {r['vs_dynamic_greedy']:.2f}x | "
              f"{r['forwards_per_token']:.2f} | {r['same_as_greedy']:.1%} |" for r in rows]
    write_markdown(name, lines)


if __name__ == "__main__":
    main()
