"""The GPU campaign: one command to run first whenever a GPU is lent, within a budget of device seconds.

Stages, in order of what a short lease should not miss (each a subprocess with its own time limit and log; a stage
that does not fit in what is left of --budget-s is skipped and says so):
  environment  the device, driver, clocks and package versions (and whether transformers is one kvcal declares)
  layout       one side of a cache read as the decode blocks read it and nothing else, by piece size, in kvcal's layout
               (a token's pieces of every KV head together), paged (a KV head's run of 64 tokens) and per KV head
               (`benchmarks.kernels layout`): what the layout alone lets the kernels reach
  kernels      copy bandwidth, fp16 SDPA and every tensor-core variant at B=8, L=32K, checked against SDPA in fp32 on
               fresh random data (--seed) with poisoned outputs, launched again for the same bits, then timed
               (`benchmarks.kernels gpu`, launcher's plan)
  kernels-heads  the A/B variants (--ab-variants) again with the packed bodies keeping each KV head's rows together
               (`benchmarks.kernels gpu --layout heads`): the same kernel, codes and work, the other layout a CUDA
               store can take
  kernels-d256 the same at head_dim 256 (Gemma 3's; the variants the tensor-core kernel serves there)
  kernels-d256-kv1  the same with one KV head and 4 query heads (Gemma 3's whole attention shape), the launcher's
               plan (tens of splits a run to merge) beside 8 splits of 4096 tokens
  suite        the GPU suite: `pytest -m gpu` over the test modules that have GPU tests (the CUDA kernels against the
               torch reference, tiny models decoding on CUDA)
  generate     end to end: generate() on a Llama-3.1-8B-shaped random model at --generate-lengths x --generate-batches,
               StaticCache / DynamicCache / every --generate-recipes bundle (`benchmarks.end_to_end gpu`), with two
               steps of each cache of the first cell traced (the first batch, 1 by default: where the host side shows),
               then the largest batch StaticCache and each recipe decode at the longest length (--generate-largest tries);
               kvcal's CUDA stores in the layout the kernels stages timed faster (--generate-cuda-layout auto)
  ab           this tree's kernel against each --baseline-tree's, interleaved, L2 flushed (`benchmarks.kernels ab`);
               skipped without a baseline tree
  ncu          Nsight Compute on --ncu-variants (`benchmarks.kernels ncu`)
  short-steps  a step of 4 to 64 tokens over 8K and 32K stored tokens on a Llama-3.1-8B-shaped random model, its stored
               tokens read by the tensor-core kernel (the step's queries as more query heads), by the torch
               reference, and by the kernel with later_steps="decode" (the moved tokens re-read), side by side
               (`benchmarks.end_to_end short-steps`): what CUDA_SHORT_STEP_PASSES should be, what the re-read costs
  mla          generate() on a DeepSeek-V2-Lite-shaped random model (multi-head latent attention, its 27 layers) at 8K and
               32K tokens, batch 8: DynamicCache against kvcal's kivi and kvquant caches, which decode MLA on the torch
               reference (`benchmarks.end_to_end mla`)
  mla-sparse   the same with DeepSeek-V3.2's sparse attention (4 layers, 8K tokens, batch 1): DynamicCache against
               kvcal's kivi cache keeping the indexer keys as computed and in FP8 (kvcal.indexer_keys on CUDA)

Everything is written under OUTDIR: results/ (the benchmarks' JSON and Markdown, as benchmarks/results would hold
them), logs/<stage>.log, campaign.json (each stage's command, status and seconds) and summary.md, the short table that
is also printed last.

--dry-run exercises the same logic on a machine without a GPU: each GPU stage runs its CPU stand-in (the scripts'
--help, the GPU suite collected but not run, the end-to-end script on a tiny model on CPU) and the summary reads what
came out.

Usage: python -m benchmarks.gpu_campaign OUTDIR [--budget-s 420] [--baseline-tree DIR ...] [--seed N] [--dry-run]
       (see --help). On the device: PYTHONPATH=$PWD KVCAL_COMMIT=<commit> python3 -m benchmarks.gpu_campaign /tmp/c ...
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.kernels.ncu import listed

PYTHON = sys.executable
GRACE_S = 10  # seconds an interrupted stage has to write what it has before it is killed
TOLERANCE = 1e-2  # the kernels' largest |error| against SDPA in fp32 at the benchmark shape (measured: <= 1.5e-4)


@dataclass
class Stage:
    name: str
    command: list[str]
    limit_s: int  # interrupted past this
    least_s: int  # skipped when less than this is left of the budget
    dry_command: list[str] | None = None  # the CPU stand-in of --dry-run (None: the command itself)
    status: str = "not run"
    seconds: float = 0.0
    note: str = ""


@dataclass
class Campaign:
    out: Path
    budget_s: float
    dry_run: bool
    stages: list[Stage] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.began)

    def run(self, stage: Stage, env: dict) -> None:
        """Run one stage, its output to logs/<name>.log. Past its limit or the budget its process is interrupted (SIGINT:
        pytest then writes its summary and XML report of the tests that ran), and GRACE_S later its process group is
        killed."""
        command = stage.dry_command if self.dry_run and stage.dry_command is not None else stage.command
        left = self.left() - GRACE_S  # what a stage may run: its grace, if interrupted, stays inside the budget
        if left < stage.least_s:
            stage.status, stage.note = "skipped", f"{left:.0f} s of the budget left, it needs {stage.least_s}"
            print(f"[campaign] {stage.name}: skipped ({stage.note})", flush=True)
            return
        limit = min(stage.limit_s, left)
        log = self.out / "logs" / f"{stage.name}.log"
        shown = " ".join(part if "\n" not in part else "<script>" for part in command)
        print(f"[campaign] {stage.name}: {shown} (limit {limit:.0f} s)", flush=True)
        began = time.monotonic()
        with log.open("w") as sink:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=_interruptible)
            try:
                code = process.wait(timeout=limit)
                stage.status = "ok" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGINT)  # the stage's own process, as `timeout -s INT` (pytest's workers stay up)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # it, if still running, and whatever it started
                process.wait()
                stage.status = f"stopped at {limit:.0f} s"
        stage.seconds = round(time.monotonic() - began, 1)
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"[campaign] {stage.name}: {stage.status} in {stage.seconds} s  | {tail[0][:160]}", flush=True)


def _interruptible() -> None:
    """In a stage's process before it starts: SIGINT back to its default, which a campaign started with it ignored (a
    background job of a shell without job control: nohup ... &) would pass on, so that the stage's interrupt reaches it
    (Python installs its KeyboardInterrupt handler only over the default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def gpu_test_files() -> list[str]:
    """The test modules with GPU tests: collecting only these keeps a module that imports a package the GPU machine
    lacks (compressed-tensors, gguf) from stopping the suite."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "@requires_gpu" in p.read_text())


def stages(args) -> list[Stage]:
    bench = lambda harness, mode: [PYTHON, "-m", f"benchmarks.{harness}", mode]  # noqa: E731
    # the tiny-model decodes share session fixtures that profile and fit bundles: one worker per group builds each
    xdist = ["-n", "12", "--dist", "loadgroup"] if importlib.util.find_spec("xdist") else []
    suite = ["-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={args.out / 'logs' / 'suite.xml'}", *gpu_test_files()]
    generate = ["--lengths", args.generate_lengths, "--batches", args.generate_batches, "--recipes", args.generate_recipes,
                "--new-tokens", "16", "--torch-profile", "2", "--largest-batch", str(args.generate_largest), "--seed", str(args.seed),
                "--cuda-layout", args.generate_cuda_layout]
    found = [
        Stage("environment", [PYTHON, "-c", ENVIRONMENT], 30, 5),
        Stage("layout", [*bench("kernels", "layout"), "--seed", str(args.seed)], 90, 30, [*bench("kernels", "layout"), "--help"]),
        Stage("kernels", [*bench("kernels", "gpu"), "--splits", "launcher", "--iters", "30", "--seed", str(args.seed)],
              180, 60, [*bench("kernels", "gpu"), "--help"]),
        # the same work with each KV head's rows together: beside `kernels`, what the layout costs the kernel itself
        Stage("kernels-heads", [*bench("kernels", "gpu"), "--layout", "heads", "--only", args.ab_variants, "--splits",
                                "launcher", "--iters", "30", "--seed", str(args.seed)], 120, 40, [*bench("kernels", "gpu"), "--help"]),
        Stage("kernels-d256", [*bench("kernels", "gpu"), "--head-dim", "256", "--splits", "launcher", "--iters", "30",
                               "--seed", str(args.seed)], 120, 45, [*bench("kernels", "gpu"), "--help"]),
        # one KV head: 8 (sequence, KV head) runs, to which the launcher's one wave gives tens of splits each to merge;
        # splits of 4096 tokens give them 8
        Stage("kernels-d256-kv1", [*bench("kernels", "gpu"), "--head-dim", "256", "--kv-heads", "1", "--splits",
                                   "launcher,4096", "--iters", "30", "--seed", str(args.seed)], 120, 30,
              [*bench("kernels", "gpu"), "--help"]),
        Stage("suite", [PYTHON, "-m", "pytest", *xdist, *suite], 330, 60, [PYTHON, "-m", "pytest", "--collect-only", *suite]),
        Stage("generate", [*bench("end_to_end", "gpu"), *generate], 330, 90,
              [*bench("end_to_end", "gpu"), "--shape", "tiny", "--device", "cpu", "--lengths", "64,128", "--batches", "1,2",
               "--recipes", args.generate_recipes, "--new-tokens", "4", "--torch-profile", "1", "--profile-seqlen", "64",
               "--largest-batch", str(min(args.generate_largest, 2)), "--seed", str(args.seed), "--cuda-layout",
               args.generate_cuda_layout]),
    ]
    if args.baseline_tree:  # each tree compiles its variants once (the first round; 20 s allowed a variant), times them twice
        trees = [argument for tree in args.baseline_tree for argument in ("--baseline", str(tree))]
        variants = len(args.ab_variants.split(","))
        found.append(Stage("ab", [*bench("kernels", "ab"), *trees, "--only", args.ab_variants, "--rounds", "2", "--iters", "30"],
                           90 + 20 * variants * len(args.baseline_tree), 60, [*bench("kernels", "ab"), "--help"]))
    found.append(Stage("ncu", [*bench("kernels", "ncu"), "--only", args.ncu_variants,
                               "--csv-dir", str(args.out / "results" / "ncu")], 120, 45, [*bench("kernels", "ncu"), "--help"]))
    found.append(Stage("short-steps", [*bench("end_to_end", "short-steps"), "--shape", "llama-8b", "--device", "cuda",
                                       "--contexts", "8192,32768", "--steps", "4,16,64", "--rounds", "3"], 150, 60,
                       [*bench("end_to_end", "short-steps"), "--shape", "tiny", "--device", "cpu", "--contexts", "64",
                        "--steps", "4,16", "--rounds", "1"]))
    mla = ["--recipes", "kivi,kvquant", "--new-tokens", "8", "--rounds", "2", "--seed", str(args.seed)]
    found.append(Stage("mla", [*bench("end_to_end", "mla"), "--device", "cuda", "--lengths", "8192,32768", "--batch", "8",
                               "--layers", "27", *mla], 150, 60,
                       [*bench("end_to_end", "mla"), "--shape", "tiny", "--lengths", "64", "--layers", "2",
                        "--profile-seqlen", "32", *mla]))
    sparse = ["--recipes", "kivi", "--indexer-keys", "model,fp8", "--new-tokens", "8", "--rounds", "2", "--seed", str(args.seed)]
    found.append(Stage("mla-sparse", [*bench("end_to_end", "mla"), "--shape", "deepseek-v2-lite-sparse", "--device", "cuda",
                                      "--lengths", "8192", *sparse], 120, 60,
                       [*bench("end_to_end", "mla"), "--shape", "tiny-sparse", "--lengths", "80", "--layers", "2",
                        "--profile-seqlen", "32", *sparse]))
    return [s for s in found if not args.only or s.name in args.only.split(",")]


ENVIRONMENT = """
import platform, shutil, subprocess, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("cupy", "transformers", "triton"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1))
else:
    print("device: no CUDA GPU")
for tool in ("nvidia-smi", "ncu", "nvcc"):
    print(tool, shutil.which(tool) or "not on PATH")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                          "--format=csv"], capture_output=True, text=True).stdout)
# last, so that the campaign's line for this stage shows it: the suite's results hold for kvcal's releases alone
import tomllib
from packaging.requirements import Requirement
import transformers
requirements = map(Requirement, tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"])
declared = next(requirement for requirement in requirements if requirement.name == "transformers")
within = declared.specifier.contains(transformers.__version__, prereleases=True)
print("transformers", transformers.__version__, "is" if within else "is NOT", "in kvcal's range", declared.specifier)
"""


# ------------------------------------------------------------------------------------------------ the summary


def _load(folder: Path, prefix: str) -> dict | None:
    """The results file <prefix>_<device>.json."""
    found = sorted(folder.glob(f"{prefix}_*.json"))
    return json.loads(found[0].read_text()) if found else None


def kernel_table(kernels: dict) -> list[str]:
    """The tensor-core benchmark's launcher-plan rows, each checked against SDPA in fp32 and for the same bits on a
    second launch (results written before that check say '-'), beside the written bound's predictions where it has
    them, its constant paid per token and per line (each one's error: predicted over measured)."""
    kv_heads, first = kernels["kv_heads"], kernels["results"][0]
    lines = ["", f"Kernels on {kernels['device']} (commit {kernels['commit']}): copy {kernels['copy_bandwidth_gbps']:.0f} GB/s, "
             f"B={first['batch']}, L={first['tokens']}, head_dim {kernels['head_dim']}, "
             f"{kv_heads} KV head{'s' * (kv_heads != 1)}"
             + (", each KV head's rows together" if kernels.get("layout") == "heads" else ""), "",
             "| variant | us | predicted us, per token / per line | of copy bw | x SDPA fp16 | max err | same bits twice | check |",
             "|---|---|---|---|---|---|---|---|"]

    def predicted(r: dict) -> str:
        us = r.get("predicted_us")
        return "-" if us is None else " / ".join(f"{u} ({u / r['latency_us'] - 1:+.0%})" for u in us.values())

    def check(r: dict) -> str:
        return "ok" if r["max_abs_error_vs_sdpa_fp32"] <= TOLERANCE and r.get("same_bits_twice") is not False else "FAIL"

    repeats = {True: "yes", False: "NO", None: "-"}
    return lines + [f"| {r['variant']} | {r['latency_us']} | {predicted(r)} | {r['fraction_of_copy_bandwidth']:.0%} | "
                    f"{r['speedup_vs_sdpa_fp16']}x | {r['max_abs_error_vs_sdpa_fp32']:.1e} | {repeats[r.get('same_bits_twice')]} | "
                    f"{check(r)} |" for r in kernels["results"] if r["plan"] == "launcher"]


def layout_table(layout: dict) -> list[str]:
    """The layout benchmark's rows, a piece size a row: each layout's share of copy bandwidth, and kvcal's time over
    the per-head one's."""
    by = {(r["piece_bytes"], r["layout"]): r for r in layout["results"]}
    lines = ["", f"One side of a cache read alone on {layout['device']}: {layout['heads']} KV heads, {layout['tokens']} tokens, "
             f"copy {layout['copy_bandwidth_gbps']:.0f} GB/s", "",
             f"| piece bytes | kvcal's (tokens) | paged ({layout['block_tokens']}-token blocks) | per KV head | tokens / heads time "
             "| checked |", "|---|---|---|---|---|---|"]
    for piece in sorted({r["piece_bytes"] for r in layout["results"]}):
        t, b, h = by[piece, "tokens"], by[piece, "blocks"], by[piece, "heads"]
        lines.append(f"| {piece} | {t['fraction_of_copy_bandwidth']:.0%} | {b['fraction_of_copy_bandwidth']:.0%} | "
                     f"{h['fraction_of_copy_bandwidth']:.0%} | {t['latency_us'] / h['latency_us']:.2f}x | "
                     f"{'ok' if t['checked'] and b['checked'] and h['checked'] else 'FAIL'} |")
    return lines


def launcher_ratios(rows: dict, heads: dict) -> dict[str, float]:
    """Per variant both tensor-core runs timed (launcher's plan): the heads-together latency over the rows-whole one."""
    whole = {r["variant"]: r["latency_us"] for r in rows["results"] if r["plan"] == "launcher"}
    return {r["variant"]: r["latency_us"] / whole[r["variant"]] for r in heads["results"]
            if r["plan"] == "launcher" and r["variant"] in whole}


def faster_layout(results: Path) -> tuple[str, str]:
    """The store layout the generate stage takes with --generate-cuda-layout auto, and why: "heads" where the
    kernels-heads stage timed the variants it shares with the kernels stage faster (the geometric mean of their
    latency ratios under 1), else "rows" (the CUDA stores' default)."""
    for together in sorted(results.glob("decode_tc_*_heads.json")):
        whole = together.with_name(together.name.replace("_heads.json", ".json"))
        ratios = launcher_ratios(json.loads(whole.read_text()), json.loads(together.read_text())) if whole.is_file() else {}
        if ratios:
            mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
            return "heads" if mean < 1 else "rows", f"heads together / rows whole {mean:.2f}x over {len(ratios)} variants"
    return "rows", "no kernels-heads timing beside the kernels stage's"


def choose_generate_layout(stage: Stage, results: Path) -> None:
    """Put faster_layout's choice in the generate stage's commands (--cuda-layout auto there) and say so in its note."""
    layout, why = faster_layout(results)
    for command in (stage.command, stage.dry_command):
        command[command.index("--cuda-layout") + 1] = layout
    stage.note = f"kvcal's CUDA stores: {layout} ({why})"


def layouts_table(rows: dict, heads: dict) -> list[str]:
    """The variants both tensor-core runs timed (launcher's plan): each store layout's latency and the heads-together
    one's over the rows-whole one's (below 1: the other layout is faster), beside that ratio as the written bound
    predicts it with its constant paid per line (paid per token, it predicts 1.00x)."""
    whole = {r["variant"]: r for r in rows["results"] if r["plan"] == "launcher"}
    ratios = launcher_ratios(rows, heads)
    together = [r for r in heads["results"] if r["plan"] == "launcher" and r["variant"] in ratios]
    if not together:
        return []
    lines = ["", f"Store layouts on {heads['device']} (the kernels and kernels-heads stages, head_dim {heads['head_dim']}):", "",
             "| variant | rows whole us | of copy bw | KV heads' rows together us | of copy bw | together / whole "
             "| predicted, per line |", "|---|---|---|---|---|---|---|"]
    for r in together:
        w = whole[r["variant"]]
        both = (w.get("predicted_us"), r.get("predicted_us"))
        predicted = f"{both[1]['line'] / both[0]['line']:.2f}x" if all(both) else "-"
        lines.append(f"| {r['variant']} | {w['latency_us']} | {w['fraction_of_copy_bandwidth']:.0%} | {r['latency_us']} | "
                     f"{r['fraction_of_copy_bandwidth']:.0%} | {ratios[r['variant']]:.2f}x | {predicted} |")
    return lines


def summary(out: Path, campaign: list[Stage]) -> list[str]:
    """The short table printed last: each stage's status, then the figures each stage's results hold."""
    results = out / "results"
    lines = ["# GPU campaign", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.note} |" for s in campaign]
    layout = _load(results, "layout_read")
    if layout:
        lines += layout_table(layout)
    runs = {path.name: json.loads(path.read_text()) for path in sorted(results.glob("decode_tc_*.json"))}
    for run in runs.values():  # head_dim 128, 256, 256 at one KV head, then 128 heads together
        lines += kernel_table(run)
    for name, run in runs.items():
        whole = runs.get(name.replace("_heads.json", ".json"))
        if name.endswith("_heads.json") and whole:
            lines += layouts_table(whole, run)
    suite = out / "logs" / "suite.xml"
    if suite.is_file():
        lines += ["", "GPU suite: " + suite_counts(suite.read_text())]
    ab = out / "logs" / "ab.log"
    if ab.is_file():
        log = ab.read_text().splitlines()
        named, table = [line for line in log if line.startswith("baselines:")], [line for line in log if line.startswith("|")]
        lines += ["", "A/B (this tree against the baselines, interleaved):", *named, "", *table] if table else []
    generate = _load(results, "generate")
    if generate:
        longest = max(r["length"] for r in generate["results"])
        widest = max(r["batch"] for r in generate["results"] if r["length"] == longest)
        lines += ["", f"generate() on {generate['device']}, random {generate['settings']['shape']}, L={longest}, B={widest}:", "",
                  "| cache | ms/step | tokens/s | x Static | cache GiB | max batch (predicted) |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['ms_per_step'] or 'out of memory'} | {r['tokens_per_s']} | {r['speedup_vs_static']} | "
                  f"{r['cache_gib']} | {r['max_batch_predicted']} |"
                  for r in generate["results"] if r["length"] == longest and r["batch"] == widest]
        if generate.get("largest"):
            lines += ["", f"The largest batch at L={longest}, tried:", "",
                      "| cache | predicted | largest that ran | smallest that failed | tokens/s there | tokens/s x Static |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r['cache']} | {r['predicted']} | {r['largest_batch']} | {r['first_failed']} | {r['tokens_per_s']} | "
                      f"{r['tokens_per_s_vs_static']} |" for r in generate["largest"]]
    short = _load(results, "short_steps")
    if short:
        lines += ["", f"A step of several tokens on {short['device']}, {short['model']} (ms):", "",
                  "| cache | context | step | kernel | reference | kernel / reference | as decode steps | runtime |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['context']} | {r['step']} | {r['ms_kernel']} | {r['ms_reference']} | "
                  f"{r['kernel_vs_reference']} | {r['ms_decode_steps']} | {r['runtime']} |" for r in short["results"]]
    profile = _load(results, "profile_decode_tc")
    if profile:
        lines += ["", "Nsight Compute:", "", "| variant | us | issue | DRAM | L2 (its busiest parts) | sectors/request | tensor | "
                  "shared wavefronts | top stalls |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['duration_us']} | {r['issue_pct']}% | {r['dram_pct']}% | {r['l2_pct']}% "
                  f"({listed(r['l2_parts_pct']) or '-'}) | {r['l2_sectors_per_read_request'] or '-'} | "
                  f"{r['tensor_pct']}% | {r['shared_wavefronts'] / 1e6:.1f}M | "
                  f"{listed(r['stall_samples_pct'])} |" for r in profile["results"]]
    return lines


def suite_counts(junit_xml: str) -> str:
    """'N passed, F failed, E errors, S skipped' from pytest's JUnit XML (a collect-only run counts collected tests)."""
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.fromstring(junit_xml)
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    failed = [case.get("classname", "") + "::" + case.get("name", "") for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    text = f"{passed} passed, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"
    return text + ("; failed: " + ", ".join(failed[:10]) if failed else "")


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("out", type=Path, help="output folder (created; must be empty or absent)")
    parser.add_argument("--budget-s", type=float, default=420, help="seconds the whole campaign may take (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random data (default: from the clock; recorded)")
    parser.add_argument("--baseline-tree", type=Path, default=[], action="append",
                        help="another kvcal tree for the A/B stage (e.g. `git archive <commit> kvcal kernels benchmarks`); "
                             "repeat it for several, each in a folder of its own name")
    parser.add_argument("--ab-variants", default="int2-g128,int4-g128,nuq3-pre-rope,nuq3-1%-pre-rope",
                        help="tensor-core variants of the A/B (default: %(default)s)")
    parser.add_argument("--ncu-variants", default="int2-g128,int2-g128@heads,nuq3-1%-pre-rope",
                        help="variants profiled with Nsight Compute (default: %(default)s)")
    parser.add_argument("--generate-lengths", default="8192,32768", help="prompt lengths of the end-to-end stage (default: %(default)s)")
    parser.add_argument("--generate-batches", default="1,8", help="batches of the end-to-end stage (default: %(default)s)")
    parser.add_argument("--generate-recipes", default="kvquant,kivi,kvmix", help="kvcal recipes of the end-to-end stage (default: %(default)s)")
    parser.add_argument("--generate-cuda-layout", choices=("auto", "rows", "heads"), default="auto",
                        help="the end-to-end stage's kvcal CUDA stores: rows whole, each KV head's rows together "
                             "(benchmarks.end_to_end gpu --cuda-layout), or auto: the one the kernels and kernels-heads "
                             "stages timed faster, rows where they did not both run (default: %(default)s)")
    parser.add_argument("--generate-largest", type=int, default=3, metavar="TRIES",
                        help="largest-batch tries per cache at the longest generate length (0: none; default: %(default)s)")
    parser.add_argument("--only", default="", help="run only these stages, comma-separated (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="CPU stand-ins for the GPU stages (see above)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out}: exists and is not an empty folder; give a new one (nothing is written over)")
    for tree in args.baseline_tree:
        if not (tree / "kernels" / "decode_attention_tc.cu").is_file():
            parser.error(f"--baseline-tree {tree}: no kernels/decode_attention_tc.cu there; give a kvcal tree")
    if len({tree.resolve().name for tree in args.baseline_tree}) < len(args.baseline_tree):
        parser.error("--baseline-tree: two trees in folders of one name; the A/B names each by its folder")
    if args.budget_s <= 0:
        parser.error("--budget-s is a positive number of seconds")
    if args.generate_largest < 0:
        parser.error("--generate-largest is 0 or more tries")
    known = {"environment", "layout", "kernels", "kernels-heads", "kernels-d256", "kernels-d256-kv1", "suite", "generate", "ab", "ncu",
             "short-steps", "mla", "mla-sparse"}
    if args.only and not set(args.only.split(",")) <= known:
        parser.error(f"--only {args.only}: stages are {', '.join(sorted(known))}")
    args.seed = int(time.time()) % 100_000 if args.seed is None else args.seed
    args.out = args.out.resolve()
    args.baseline_tree = [tree.resolve() for tree in args.baseline_tree]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    (args.out / "logs").mkdir(parents=True)
    (args.out / "results").mkdir()
    campaign = Campaign(args.out, args.budget_s, args.dry_run, stages(args))
    env = {**os.environ, "KVCAL_RESULTS_DIR": str(args.out / "results"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    print(f"[campaign] seed {args.seed}, budget {args.budget_s:.0f} s{', dry run' if args.dry_run else ''}", flush=True)
    for stage in campaign.stages:
        if stage.name == "generate" and args.generate_cuda_layout == "auto":
            choose_generate_layout(stage, args.out / "results")
        campaign.run(stage, env)
    record = {"seed": args.seed, "budget_s": args.budget_s, "dry_run": args.dry_run, "commit": os.environ.get("KVCAL_COMMIT"),
              "seconds": round(time.monotonic() - campaign.began, 1), "stages": [asdict(s) for s in campaign.stages]}
    (args.out / "campaign.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = summary(args.out, campaign.stages)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if all(s.status in ("ok", "skipped") for s in campaign.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
