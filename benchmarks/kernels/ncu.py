"""Where the tensor-core decode kernel's time goes on a CUDA GPU: Nsight Compute's counters of one launch per variant
at the tensor-core benchmark's shape (B = 8, 8 KV heads, GQA 4, head_dim 128, L = 32768, the launcher's split plan).

bound_decode.py bounds the kernel from its SASS as if every issue slot were usable; this script says what a real launch
spent instead: issue slots used, warps resident and eligible per scheduler, how busy DRAM, L2, L1 / shared memory and the
ALU, FMA and tensor pipes were, shared-memory wavefronts, and where the warps' stall samples fell.

Each variant runs in its own process under `ncu --set full --clock-control none` (the card's clocks are left as found),
which profiles the kernel's 4th launch (ncu flushes the caches before it); `ncu --import --page raw --csv` exports the
counters, and this script reads them.

A variant named with @heads (int2-g128@heads) is profiled with its packed bodies keeping each KV head's rows together
(the tensor-core benchmark's --layout heads): beside the same variant in the default layout, whether the L2's tag
lookups or its fabric fill up.

Usage (CUDA + CuPy, ncu on PATH): python -m benchmarks.kernels ncu [--only int2-g128,int2-g128@heads,nuq4-pre-rope]
                                                                         [--tokens 32768] [--csv-dir DIR]
    --csv-dir DIR keeps each variant's raw counters as DIR/<variant>.csv; given with --from-csv, it reads them
    instead of profiling (no GPU needed).
Writes benchmarks/results/profile_decode_tc_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import device_slug, provenance, write_markdown, write_result

DEFAULT_VARIANTS = "int2-g128,int4-g128,int2-g128-pre-rope,nuq4-pre-rope,nuq3-1%-pre-rope"
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
PERCENT = {  # column -> ncu metric (% of peak)
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "dram": "dram__bytes_read.sum.pct_of_peak_sustained_elapsed",
    "l2": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1_shared": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "alu": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
}
# added to `--set full`: the L2's throughput is the busiest of its parts (its fabric between the two partitions, tag
# lookups, data sectors), and the sectors a read request brings say whether requests or bytes fill it (a token's
# 32-byte piece of one KV head's row is a request of one sector)
EXTRA_METRICS = ("breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sectors_srcunit_tex_op_read.sum",
                 "lts__t_requests_srcunit_tex_op_read.sum")
L2_PART = re.compile(r"((?:lts|ltcfabric)__(?!throughput\.).+)\.avg\.pct_of_peak_sustained_elapsed")
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}  # to us and MB


HEADS_LAYOUT = "@heads"  # a variant name's suffix: each KV head's rows together


def launch(name: str, tokens: int) -> None:
    """The process ncu watches: 4 launches of one variant's kernel, the L2 flushed before each."""
    import torch

    from benchmarks.kernels.gpu_timing import HEADS, KV_HEADS
    from benchmarks.kernels.tensor_core import BATCH, filled_stores, inv_freq, variants
    from kvcal.runtime import tensor_core

    head_dim = 128  # the tensor-core benchmark's default shape
    codecs, rope = variants(head_dim)[name.removesuffix(HEADS_LAYOUT)]
    keys, values = filled_stores(codecs, BATCH, tokens, head_dim, rows_together=not name.endswith(HEADS_LAYOUT))
    query = torch.randn(BATCH, HEADS, head_dim, device="cuda")
    run = tensor_core.prepare_decode_tc(query, keys, values, KV_HEADS, head_dim**-0.5, inv_freq=inv_freq(head_dim) if rope else None)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(4):
        flush.zero_()
        run()
    torch.cuda.synchronize()


def profiled_csv(name: str, tokens: int, ncu: str, folder: Path) -> str:
    """ncu's raw counters of the variant's 4th decode_tc launch, as CSV text (without EXTRA_METRICS where this ncu
    does not know them: the rest of the row is still worth its GPU time)."""
    report = folder / "report"
    options = ["--clock-control", "none", "--set", "full", "-k", "regex:decode_tc", "--launch-skip", "3", "--launch-count", "1",
               "-f", "-o", str(report)]
    target = [sys.executable, __file__, "--launch", name, "--tokens", str(tokens)]
    done = subprocess.run([ncu, *options, "--metrics", ",".join(EXTRA_METRICS), *target], capture_output=True, text=True)
    if done.returncode:
        print(f"ncu refused {','.join(EXTRA_METRICS)} on {name}; profiling it without them", file=sys.stderr, flush=True)
        done = subprocess.run([ncu, *options, *target], capture_output=True, text=True)
    if done.returncode or not report.with_suffix(".ncu-rep").is_file():
        sys.exit(f"ncu failed on {name} (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return subprocess.run([ncu, "-i", str(report.with_suffix(".ncu-rep")), "--page", "raw", "--csv"],
                          capture_output=True, text=True, check=True).stdout


def listed(percentages: dict) -> str:
    """'name p%, ...' of a row's stall shares or L2 parts."""
    return ", ".join(f"{name} {share}%" for name, share in percentages.items())


def summary(name: str, text: str) -> dict:
    """One row of the table from ncu's raw CSV (a header row, a units row, one row per profiled kernel)."""
    rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    header, units, values = rows[0], rows[1], rows[2]
    unit, field = dict(zip(header, units)), dict(zip(header, values))

    def value(metric: str) -> float:
        return float(field[metric].replace(",", "")) * SCALE.get(unit[metric], 1.0)

    stalls = {key[len(STALL_PREFIX):]: value(key) for key in header  # every sample once: not the *_not_issued subsets
              if key.startswith(STALL_PREFIX) and not key.endswith("_not_issued")}
    samples = value("smsp__pcsamp_sample_count")
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:5]
    limits = [value(k) for k in header if k.startswith("launch__occupancy_limit_")]
    l2_parts = sorted(((m.group(1), round(value(k), 1)) for k in header if (m := L2_PART.fullmatch(k))), key=lambda kv: -kv[1])
    requests = value("lts__t_requests_srcunit_tex_op_read.sum") if "lts__t_requests_srcunit_tex_op_read.sum" in field else 0
    return {
        "variant": name,
        "device": field["device__attribute_display_name"],
        "kernel": re.sub(r"\(.*", "", field["Kernel Name"]),
        "duration_us": round(value("gpu__time_duration.sum"), 2),
        "dram_read_mb": round(value("dram__bytes_read.sum"), 1),
        "registers": int(value("launch__registers_per_thread")),
        "blocks_per_sm": int(min(limits)),
        "warps_per_scheduler": round(value("smsp__warps_active.avg.per_cycle_active"), 2),
        "eligible_per_scheduler": round(value("smsp__warps_eligible.avg.per_cycle_active"), 2),
        "instructions": int(value("smsp__inst_executed.sum")),
        "shared_wavefronts": int(value("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum")),
        **{f"{column}_pct": round(value(metric), 1) for column, metric in PERCENT.items()},
        "stall_samples_pct": {reason: round(100 * count / samples, 1) for reason, count in top},
        # (EXTRA_METRICS: empty and None where the CSV lacks them)
        "l2_parts_pct": dict(l2_parts[:3]),
        "l2_sectors_per_read_request": round(value("lts__t_sectors_srcunit_tex_op_read.sum") / requests, 2) if requests else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=DEFAULT_VARIANTS, help="comma-separated variant names of the tensor-core benchmark")
    parser.add_argument("--tokens", type=int, default=32768, help="cached tokens per sequence")
    parser.add_argument("--csv-dir", type=Path, default=None, help="keep (or, with --from-csv, read) DIR/<variant>.csv")
    parser.add_argument("--from-csv", action="store_true", help="summarise the CSV files in --csv-dir; profile nothing")
    parser.add_argument("--launch", default=None, help=argparse.SUPPRESS)  # the child process ncu profiles
    args = parser.parse_args()
    if args.launch:
        return launch(args.launch, args.tokens)
    names = args.only.split(",")
    started = provenance()
    if args.from_csv:
        if args.csv_dir is None:
            parser.error("--from-csv reads --csv-dir DIR: give the folder of <variant>.csv files")
        missing = [n for n in names if not (args.csv_dir / f"{n}.csv").is_file()]
        if missing:
            parser.error(f"--csv-dir {args.csv_dir}: no {missing[0]}.csv there (profile it first, or leave it out of --only)")
        rows = [summary(n, (args.csv_dir / f"{n}.csv").read_text()) for n in names]
        # the counters' device; the commit is this checkout's unless KVCAL_COMMIT names the one profiled
        started = {**started, "device": rows[0]["device"], "source": f"ncu CSV files ({args.csv_dir.name})"}
    else:
        from benchmarks.kernels.tensor_core import variants

        unknown = [n for n in names if n.removesuffix(HEADS_LAYOUT) not in variants(128)]
        if unknown:
            parser.error(f"--only {unknown[0]}: not a variant of the tensor-core benchmark (python -m benchmarks.kernels "
                         f"gpu --help), optionally with {HEADS_LAYOUT}")
        ncu = shutil.which("ncu")
        if ncu is None:
            sys.exit("the ncu benchmark needs Nsight Compute's ncu on PATH; nothing was profiled")
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                text = profiled_csv(name, args.tokens, ncu, Path(tmp))
                if args.csv_dir is not None:
                    args.csv_dir.mkdir(parents=True, exist_ok=True)
                    (args.csv_dir / f"{name}.csv").write_text(text)
                rows.append(summary(name, text))
                print(rows[-1], flush=True)
    name = "profile_decode_tc_" + device_slug(started["device"])
    write_result(name, {"tokens": args.tokens, "results": rows}, started)
    lines = [f"# Tensor-core decode attention under Nsight Compute, {started['device']} "
             f"(commit {started['commit']}, {started['date']})", "",
             f"`python -m benchmarks.kernels ncu`: one launch per variant (B = 8, L = {args.tokens}, the launcher's plan), "
             "`ncu --set full --clock-control none`. Percentages are of each unit's peak; stalls are the share of the warps' "
             "stall samples (selected = issuing). L2 is the busiest of its parts, the three busiest named (ltcfabric: the "
             "link between the L2's two partitions; lts__t_tag_requests: tag lookups; lts__t_sectors / lts__d_sectors: "
             "data); sectors/request: what the L1's read requests brought from it, 32 bytes a sector.", "",
             "| variant | us | regs | blocks/SM | warps / eligible per scheduler | issue | DRAM | L2 | L2's busiest parts | "
             "sectors/request | L1+shared | ALU | FMA | tensor | shared wavefronts | top stalls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['duration_us']} | {r['registers']} | {r['blocks_per_sm']} | {r['warps_per_scheduler']} / "
              f"{r['eligible_per_scheduler']} | {r['issue_pct']}% | {r['dram_pct']}% | {r['l2_pct']}% | "
              f"{listed(r['l2_parts_pct']) or '-'} | "
              f"{r['l2_sectors_per_read_request'] or '-'} | {r['l1_shared_pct']}% | "
              f"{r['alu_pct']}% | {r['fma_pct']}% | {r['tensor_pct']}% | {r['shared_wavefronts'] / 1e6:.1f}M | "
              f"{listed(r['stall_samples_pct'])} |" for r in rows]
    write_markdown(name, lines)


if __name__ == "__main__":
    main()
