"""The documentation's results, generated from benchmarks/results: docs/results.md (every results table, each with the
script that wrote it and its commit) and the README's summary table (between its results-table markers).

Usage: python -m benchmarks.report [--check]
    --check writes nothing and exits 1 if either file differs from what benchmarks/results gives (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULTS_DOC = REPO / "docs" / "results.md"
README = REPO / "README.md"
BEGIN, END = "<!-- results-table: begin (benchmarks/report.py) -->", "<!-- results-table: end -->"
# the README's CPU column: an AVX2 machine (no AVX-512, as most CPUs users decode on), the native build at torch's default
# threads, batch 1 and batch 8
CPU_RESULTS = ("decode_step_cpu_avx2_native_2t_batch1", "decode_step_cpu_avx2_native_2t_batch8")
GPU_RESULT = "generate_nvidia-h200"
LONG_MEMORY, LONG_PASSKEY = "long_context_memory_gemma3-270m", "long_context_passkey_gemma3-270m"

# results file (by its name's prefix) -> the command that writes it; the sections of docs/results.md in order. A file a
# retired script wrote names that script and the commit before it went (RETIRED_AT), and what reproduces it now.
RETIRED_AT = "7f81ddf"
SECTIONS = [
    ("Accuracy at real bits", [
        ("pareto", "python -m benchmarks.accuracy", ""),
        ("nuq_ablation", "benchmarks/bench_nuq_ablation.py", "python -m benchmarks.accuracy --methods nuq-ablation"),
        ("mixed_widths", "benchmarks/bench_mixed_widths.py", "python -m benchmarks.accuracy --methods mixed-widths"),
        ("skvq_", "benchmarks/bench_skvq_ablation.py", "python -m benchmarks.accuracy --methods skvq-ablation"),
        ("fp8_kv_ppl", "benchmarks/bench_fp8_kv.py", "python -m benchmarks.accuracy --methods fp8"),
        ("engine_layers", "python -m benchmarks.accuracy --methods engine-layers", ""),
        ("engine_types", "python -m benchmarks.accuracy --methods engine-types", ""),
        ("nvfp4_scales", "python -m benchmarks.nvfp4_scales", ""),
        ("llama_cpp_types", "python -m benchmarks.llama_cpp_types", ""),
        ("ik_llama_cpp_types", "python -m benchmarks.llama_cpp_types --engine ik_llama.cpp", ""),
        ("rotation", "benchmarks/bench_rotation.py", "not kept: docs/experiments.md"),
        ("agreement", "benchmarks/bench_agreement.py", "not kept: docs/experiments.md")]),
    ("Decode on CPU", [("decode_step_cpu", "python -m benchmarks.kernels cpu", ""),
                       ("memory_cpu", "python -m benchmarks.kernels cpu-memory", ""),
                       ("cpu_append", "python -m benchmarks.kernels cpu-append", ""),
                       ("cpu_layout_", "python -m benchmarks.kernels cpu-layout", "")]),
    ("Decode on GPU", [("decode_plan", "python -m benchmarks.kernels plan", ""),
                       ("gpu_campaign_", "python -m benchmarks.gpu_campaign", ""),
                       ("generate_", "python -m benchmarks.end_to_end gpu", ""),
                       ("host_step_", "python -m benchmarks.end_to_end host", ""),
                       ("decode_tc_", "python -m benchmarks.kernels gpu", ""),
                       ("decode_nvidia", "python -m benchmarks.kernels runtime", ""),
                       ("profile_decode_tc_", "python -m benchmarks.kernels ncu", ""),
                       ("layout_read_", "python -m benchmarks.kernels layout", ""),
                       ("bound_decode", "python -m tools.bound_decode", "")]),
    ("The runtime cache on SmolLM2", [("runtime_", "python -m benchmarks.end_to_end cpu", ""),
                                      ("speculative_", "python -m benchmarks.end_to_end speculative", ""),
                                      ("short_steps_", "python -m benchmarks.end_to_end short-steps", "")]),
    ("Long context", [("long_context_", "python -m benchmarks.end_to_end long-context", "")]),
    ("Multi-head latent attention", [("mla_generate_", "python -m benchmarks.end_to_end mla", ""),
                                     ("mla_sparse_generate_", "python -m benchmarks.end_to_end mla --shape "
                                                              "deepseek-v2-lite-sparse", ""),
                                     ("mla_glm5_next_generate_", "python -m benchmarks.end_to_end mla --shape glm5-next",
                                      ""),
                                     ("cpu_latent_", "python -m benchmarks.kernels cpu-latent", "")]),
]
# README rows: (recipe or baseline, its row in pareto.json, what it is)
RECIPE_ROWS = [
    ("kvquant", "nuq3-1%", "KVQuant: 3-bit Fisher-weighted codebooks, pre-RoPE per-channel keys, 1% outliers, 1 fp16 sink"),
    ("mixed", "mixed", "KVQuant codebooks at per-layer widths 2-4 from the Fisher knapsack, 3.0 real bits"),
    ("skvq", "skvq-K2V2-fp8-w128", "SKVQ: 2-bit reordered channel groups, clipping, 128-token fp16 window, 5 sinks"),
    ("kivi", "kivi2-g32-r128", "KIVI: 2-bit keys per channel, values per token, 128-token fp16 residual"),
    ("kvmix", "kvmix", "KVmix: per-layer 2-4-bit widths from gradient importance, recent pivotal context"),
]
BASELINE_ROWS = [("hadamard-int3", "rotated int3 per token-head"), ("turbo3", "TurboQuant-style, 3 bits"),
                 ("q4_0", "llama.cpp q4_0 (with its Hadamard rotation)"), ("fp8-absmax", "vLLM fp8 (e4m3), absmax scales")]


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def results_doc() -> str:
    files = sorted(p.stem for p in RESULTS.glob("*.md"))
    lines = ["# Results", "", "Generated by `python -m benchmarks.report` from `benchmarks/results/`: every results table, with the "
             "command that wrote it and the commit it measured (`+dirty`: uncommitted changes beside that commit). Do not edit; "
             "rerun the script.", ""]
    placed = set()
    for title, kinds in SECTIONS:
        lines += [f"- [{title}](#{slug(title)})"]
    for title, kinds in SECTIONS:
        lines += ["", f"## {title}"]
        for prefix, script, now in kinds:
            for stem in (f for f in files if f.startswith(prefix) and f not in placed):
                placed.add(stem)
                record = load(stem) or {}
                made = f"`{script}`" + (f" at commit {record['commit']}, {record['date']}" if record.get("commit") else "")
                if now:
                    made += f" (retired after {RETIRED_AT}; the same comparison now: `{now}`, on that harness's profile)" if now.startswith("python") else \
                        f" (retired after {RETIRED_AT}, {now})"
                body = (RESULTS / f"{stem}.md").read_text().strip().splitlines()
                body = [("##" + line) if line.startswith("#") else line for line in body]  # its headings under this one
                lines += ["", f"### {stem}", "", f"`benchmarks/results/{stem}.md`, written by {made}.", "", *body]
    missing = sorted(set(files) - placed)
    if missing:
        raise SystemExit(f"report.py: no section names the results {', '.join(missing)}; add their prefix to SECTIONS")
    return "\n".join(lines) + "\n"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def readme_table() -> str:
    pareto, gpu = load("pareto"), load(GPU_RESULT)
    cpus = [load(name) for name in CPU_RESULTS]
    cpu = cpus[0]
    rows = {domain: {r["name"]: r for r in pareto["domains"][domain]["rows"]} for domain in ("wikitext2", "code")}
    cpu_rows = {(r["cache"], r["length"], r["batch"]): r for result in cpus for r in result["results"]}
    longest = max(r["length"] for r in gpu["results"])
    widest = max(r["batch"] for r in gpu["results"] if r["length"] == longest)
    gpu_rows = {r["cache"]: r for r in gpu["results"] if r["length"] == longest and r["batch"] == widest}
    cpu_cells = [(2048, 1), (8000, 1), (8000, 8)]
    fastest_fp = min(gpu_rows[c]["ms_per_step"] for c in ("StaticCache", "DynamicCache") if c in gpu_rows)

    def quality(name: str) -> tuple[str, str, str]:
        wiki, code = rows["wikitext2"][name], rows["code"][name]
        return f"{wiki['effective_bits']:.2f}", f"{wiki['delta_pct']:+.1f}%", f"{code['delta_pct']:+.1f}%"

    def cpu_speed(recipe: str) -> str:
        rows = [cpu_rows.get((f"kvcal {recipe}", *cell)) for cell in cpu_cells]
        return " / ".join("-" if row is None else f"{row['ratio_to_dynamic']:.2f}" for row in rows)

    def gpu_speed(recipe: str) -> str:
        row = gpu_rows.get(f"kvcal {recipe}")
        return "-" if row is None else f"{fastest_fp / row['ms_per_step']:.2f}x"

    cells = " / ".join(f"{n} x {b}" for n, b in cpu_cells)
    lines = [f"| recipe | real bits | ppl wikitext-2 | ppl code | CPU time vs DynamicCache ({cells}) | "
             f"GPU speed vs fp ({longest // 1024}K x {widest}) | what it is |", "|---|---|---|---|---|---|---|"]
    for recipe, name, what in RECIPE_ROWS:
        lines.append(f"| **{recipe}** | " + " | ".join(quality(name)) + f" | {cpu_speed(recipe)} | {gpu_speed(recipe)} | {what} |")
    for name, what in BASELINE_ROWS:
        lines.append(f"| {name} | " + " | ".join(quality(name)) + f" | - | - | baseline: {what} |")
    wiki_fp, code_fp = pareto["domains"]["wikitext2"]["fp_ppl"], pareto["domains"]["code"]["fp_ppl"]
    lines += ["", f"SmolLM2-135M-Instruct. Accuracy: `python -m benchmarks.accuracy` at {pareto['commit']}, perplexity change against "
              f"fp ({wiki_fp:.2f} on wikitext-2 test, {code_fp:.2f} on held-out Python code), 40 windows of 512 tokens, real bits as "
              "the runtime stores them at 512 tokens (the skvq row is its fp8-parameter variant). CPU: `python -m benchmarks.kernels cpu` "
              f"at {' / '.join(dict.fromkeys(c['commit'] for c in cpus))} ({cpu['cpu']}, {cpu['settings']['threads']} threads, the kernels built for "
              f"-march={cpu['settings']['march']}), generate() time per token over DynamicCache's, lower is better. GPU: "
              f"`python -m benchmarks.end_to_end gpu` at {gpu['commit']} on an {gpu['device']}, a Llama-3.1-8B-shaped random model, "
              "decode tokens/s against the faster of StaticCache and DynamicCache (eager). Every table: [docs/results.md](docs/results.md)."]
    return "\n".join(lines + long_context_lines())


def long_context_lines() -> list[str]:
    """The README's long-context paragraph: the Gemma 3 cache at its longest measured context, and passkey retrieval."""
    memory = load(LONG_MEMORY)
    if memory is None:
        return []
    longest = max(r["context"] for r in memory["results"])
    at_longest = [r for r in memory["results"] if r["context"] == longest]
    rows = sorted((r for r in at_longest if "live_bytes" in r), key=lambda r: r["live_bytes"])
    fp16 = rows[0]["fp16_bytes"]
    cells = ", ".join(f"{r['method']} {r['live_bytes'] / 2**20:.1f} MiB ({r['live_bytes'] / fp16:.1%})" for r in rows)
    refused = " (transformers' QuantizedCache refuses the model: its sliding layers)" if any("refused" in r for r in at_longest) else ""
    lines = ["", f"Long context, Gemma 3 270M (15 of its 18 layers slide over 512 tokens, and kvcal's cache keeps only their "
             f"window): at {longest // 1024}K tokens transformers' own fp16 cache holds {fp16 / 2**20:.1f} MiB{refused}, kvcal's {cells}; "
             f"`python -m benchmarks.end_to_end long-context` at {', '.join(sorted({r['commit'] for r in at_longest}))}."]
    passkey = load(LONG_PASSKEY)
    if passkey is not None:
        points = sorted({(r["keys"], r["length"]) for r in passkey["results"]})
        methods = list(dict.fromkeys(r["method"] for r in passkey["results"]))
        score = {(r["method"], r["keys"], r["length"]): f"{r['correct']}/{r['samples']}" for r in passkey["results"]}
        header = " / ".join(f"{'passkey' if keys == 1 else f'{keys} keys'} {round(length / 1024)}K" for keys, length in points)
        lines[-1] += (f" Retrieval ({header}): " + "; ".join(f"{m} " + " / ".join(score.get((m, *p), "-") for p in points)
                                                             for m in methods) + ".")
    return lines


def with_readme_table(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"report.py: README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{readme_table()}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is out of date")
    args = parser.parse_args(argv)
    wanted = {RESULTS_DOC: results_doc(), README: with_readme_table(README.read_text())}
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is out of date: run python -m benchmarks.report", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
