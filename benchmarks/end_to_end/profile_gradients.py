"""Wall time and peak RSS of `kvcal profile-gradients` on SmolLM2-135M, wikitext-2 valid, 16 x 512.

Usage: python -m benchmarks.end_to_end profile [--nsamples 16] [--seqlen 512]
Targets (issue 2): at most 180 s and 4 GB on the 2-core CPU machine. Writes
benchmarks/results/profile_gradients_cpu.json.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import SHARED, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.safetensors"
        command = ["kvcal", "profile-gradients", "--dataset", str(SHARED / "data/wikitext-2/valid.txt"),
                   "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--seed", "0", "--out", str(out)]
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
        size_mib = out.stat().st_size / 2**20
    result = {"command": " ".join(command[:-2] + ["--out", "<tmp>/profile.safetensors"]), "wall_s": round(wall, 1),
              "peak_rss_gib": round(peak_gib, 2), "profile_mib": round(size_mib, 1),
              "targets": {"wall_s": 180, "peak_rss_gib": 4}}
    print(f"{'wall time':>12}: {wall:7.1f} s   (target <= 180 s)")
    print(f"{'peak RSS':>12}: {peak_gib:7.2f} GiB (target <= 4 GiB)")
    print(f"{'profile':>12}: {size_mib:7.1f} MiB")
    print(f"wrote {write_result('profile_gradients_cpu', result)}")


if __name__ == "__main__":
    main()
