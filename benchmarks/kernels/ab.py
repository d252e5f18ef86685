"""A/B of the tensor-core decode kernel: this checkout against others (the baselines: other commits' trees, e.g.
`git worktree add /tmp/base <commit>`), side by side on one GPU. The tensor-core benchmark runs in each tree in turn, with
that tree's kvcal package and kernels, alternating (this tree, each baseline, this tree, ...) for --rounds rounds, at the
launcher's split plan. The table gives each variant's median latency per side and this tree's ratio to each baseline.
Several baselines (the commits between which kernel changes landed, oldest first) time each change's step in one run,
to set beside the prediction written for it. Timings from two runs on different machines or sessions are not
comparable; two sides of one run are.

The tensor-core benchmark's --kernel-dir swaps kernels/ alone; a change that also moves the host side (shared memory,
stage sizes, split plans in kvcal.runtime.tensor_core) needs both trees whole, which this script runs.

Usage (CUDA + CuPy): python -m benchmarks.kernels ab --baseline DIR [--baseline DIR2 ...] [--only int2-g128,int4-g128]
                                                       [--rounds 2] [--tokens 32768] [--iters 20]
Prints; writes nothing (each run is the tensor-core benchmark's print-only mode).
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[2]
# the tensor-core benchmark's command in a tree: this layout, or the script it was before benchmarks/ became a package
LAYOUTS = ((Path("benchmarks/kernels/tensor_core.py"), ["-m", "benchmarks.kernels", "gpu"]),
           (Path("benchmarks/bench_decode_tc.py"), ["benchmarks/bench_decode_tc.py"]))


def benchmark_command(tree: Path) -> list[str] | None:
    return next((command for path, command in LAYOUTS if (tree / path).is_file()), None)


def latencies(tree: Path, args) -> dict[str, float]:
    """One tensor-core benchmark run in `tree` (its own package first on the path): variant -> latency in us."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, *benchmark_command(tree), "--splits", "launcher", "--only", args.only, "--tokens",
                           str(args.tokens), "--iters", str(args.iters), "--kernel-dir", "kernels"],
                          cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the tensor-core benchmark failed in {tree}: {(done.stderr.strip().splitlines() or ['no message'])[-1]}")
    rows = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'variant'")]
    return {row["variant"]: row["latency_us"] for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, action="append",
                        help="another kvcal checkout (an A side); repeat it for several, named by their folders")
    parser.add_argument("--only", default="int2-g128,int4-g128", help="comma-separated variant names of the tensor-core benchmark")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--tokens", type=int, default=32768, help="cached tokens per sequence")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per measurement (median reported)")
    args = parser.parse_args()
    baselines = {}
    for given in args.baseline:
        tree = given.resolve()
        if benchmark_command(tree) is None or not (tree / "kernels" / "decode_attention_tc.cu").is_file():
            parser.error(f"--baseline {given}: not a kvcal checkout (no tensor-core benchmark and kernels/ there)")
        if tree == HERE:
            parser.error(f"--baseline {given}: this checkout itself; give another commit's tree (git worktree add)")
        if tree.name in baselines or tree.name == "this tree":
            parser.error(f"--baseline {given}: a second baseline named {tree.name}; give each tree a folder name of its own")
        baselines[tree.name] = tree
    if args.rounds <= 0 or args.tokens <= 0 or args.iters <= 0:
        parser.error("--rounds, --tokens and --iters are positive numbers")
    if not torch.cuda.is_available():
        sys.exit("the A/B benchmark needs a CUDA GPU; nothing was measured")
    sides = {"this tree": HERE, **baselines}
    measured = {side: {} for side in sides}
    for round_ in range(args.rounds):
        for side, tree in sides.items():
            for variant, us in latencies(tree, args).items():
                measured[side].setdefault(variant, []).append(us)
                print(f"round {round_ + 1} {side}: {variant} {us:.2f} us", flush=True)
    print(f"\nbaselines: {', '.join(f'{name} = {tree}' for name, tree in baselines.items())}")
    print("\n| variant | this tree us | " + " | ".join(f"{name} us" for name in baselines) + " | "
          + " | ".join(f"this / {name}" for name in baselines) + " |")
    print("|---" * (2 + 2 * len(baselines)) + "|")
    for variant in measured["this tree"]:
        this = statistics.median(measured["this tree"][variant])
        other = [statistics.median(measured[name].get(variant, [float("nan")])) for name in baselines]
        print(f"| {variant} | {this:.2f} | " + " | ".join(f"{us:.2f}" for us in other) + " | "
              + " | ".join(f"{this / us:.3f}" for us in other) + " |")


if __name__ == "__main__":
    main()
