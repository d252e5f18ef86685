"""What the GPU benchmarks share: their shapes, the timing of a launch (CUDA events, L2 flushed before every timed
launch, medians that settle), the device-to-device copy bandwidth they are measured against, fp16 SDPA at the same
shapes, and the per-device results file."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import device_slug, write_result

KV_HEADS, GROUP = 8, 4  # the default shape's KV heads (--kv-heads gives others) and query heads per KV head
HEADS = KV_HEADS * GROUP
HEAD_DIMS = (128, 256)  # Llama's, Gemma 3's
FLUSH_BYTES = 512 * 2**20  # more than any GPU's L2


def write_device_result(prefix: str, bandwidth: float, iterations: int, rows: list[dict], started: dict, head_dim: int,
                        kv_heads: int = KV_HEADS, layout: str = "rows") -> str:
    """Write benchmarks/results/<prefix>_<this GPU's name>[_d<head_dim> past 128][_kv<kv_heads> but 8][_<layout> but
    rows].json with the shapes and constants of the run; the name. layout: the packed bodies' (benchmarks/kernels/
    tensor_core.py --layout)."""
    name = (f"{prefix}_{device_slug(torch.cuda.get_device_name())}" + (f"_d{head_dim}" if head_dim != 128 else "")
            + (f"_kv{kv_heads}" if kv_heads != KV_HEADS else "") + (f"_{layout}" if layout != "rows" else ""))
    write_result(name, {"copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "kv_heads": kv_heads, "heads": kv_heads * GROUP,
                        "head_dim": head_dim, "layout": layout, "iterations": iterations,
                        "results": rows}, started)
    return name


def timed(run, iterations: int, warmup_seconds: float = 0.5, rounds: int = 5) -> float:
    """Median seconds of run(), L2 flushed before each, after at least warmup_seconds of untimed runs: the first
    timed launches after seconds of host work (a compile) ran slow on the H100 (the first two rows of three runs of
    the tensor-core benchmark, 15-20% above the same launches timed later), as the GPU's clocks come back up. The median is
    taken again until two in a row agree within 5% (at most `rounds`), and the lower of those two is returned: once
    in each of three H100 runs of the tensor-core benchmark (2026-11-23) one variant's whole timing ran 3-5x slow while the
    same kernel timed at its usual latency before and after, as if the clocks stayed low throughout."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        flush.zero_()
        run()
        torch.cuda.synchronize()

    def median() -> float:
        times = []
        for _ in range(iterations + 2):
            flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(times[2:])

    return settled(median, rounds)


def settled(measure, rounds: int, tolerance: float = 0.05) -> float:
    """measure() again until two results in a row agree within `tolerance` (at most `rounds` calls): the lower of the
    two; the last result if none agree."""
    last = measure()
    for _ in range(rounds - 1):
        now = measure()
        if abs(now - last) <= tolerance * min(now, last):
            return min(now, last)
        last = now
    return last


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / timed(lambda: target.copy_(source), 10)


def sdpa_seconds(batch: int, length: int, iterations: int, head_dim: int, kv_heads: int = KV_HEADS) -> float:
    query = torch.randn(batch, kv_heads * GROUP, 1, head_dim, device="cuda", dtype=torch.float16)
    keys = torch.randn(batch, kv_heads, length, head_dim, device="cuda", dtype=torch.float16)
    values = torch.randn_like(keys)
    attention = torch.nn.functional.scaled_dot_product_attention
    return timed(lambda: attention(query, keys, values, enable_gqa=True), iterations)
