"""The decode step of one layer as the runtime cache launches it on a CUDA GPU (kvcal.runtime.kernels.prepare_decode
over stores the append kernels filled: one tensor-core launch, its segment blocks and fused merge included): latency,
bytes read, bandwidth as a fraction of the measured device-to-device copy bandwidth, and speedup over torch SDPA in
fp16 at the same shapes, L2 flushed before every timed launch (CUDA events; the host-side preparation is outside the
timed region). benchmarks/kernels/tensor_core.py times the kernel alone over every variant.

Shapes: B in {1, 8}, 8 KV heads, 32 query heads, head_dim 128 (Llama's) or 256 (Gemma 3's; --head-dim), L in
{4K, 32K, 128K}. Variants: uniform 4/3/2-bit with groups of 128 and 32 (keys per channel over token blocks, values
per token, as KIVI/KVmix store them), nuq3 (KVQuant codebooks) post-RoPE, pre-RoPE, and pre-RoPE with 1% outliers.
Bytes read = the cache's stored bytes (codes, parameters, outliers, fp16 segments) + query + output.

Usage (needs CUDA and CuPy: pip install -e ".[gpu]"):
    python -m benchmarks.kernels runtime [--batches 1,8] [--lengths 4096,32768,131072] [--iters 20] [--head-dim 256]
Writes benchmarks/results/decode_<device>.{json,md} (decode_<device>_d256 at head_dim 256).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import provenance, write_markdown
from benchmarks.kernels.gpu_timing import HEAD_DIMS, HEADS, KV_HEADS, copy_bandwidth, sdpa_seconds, timed, write_device_result


def variants(head_dim: int) -> dict:
    """name -> (key codec, value codec, pre-RoPE keys)."""
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook

    table = {}
    for bits in (4, 3, 2):
        for group in (128, 32):
            table[f"int{bits}-g{group}"] = (ChannelBlockUniform(bits, group), TokenUniform(bits, group), False)
    codebook = normal_float_codebook(3)
    lo, hi = -torch.full((KV_HEADS * head_dim,), 2.5), torch.full((KV_HEADS * head_dim,), 2.5)  # N(0, 1) data: about 1% outside, both sides
    table["nuq3"] = (CodebookCodec(codebook, lo, hi), CodebookCodec(codebook), False)
    table["nuq3-prerope"] = (CodebookCodec(codebook, lo, hi), CodebookCodec(codebook), True)
    table["nuq3-prerope-1%outliers"] = (CodebookCodec(codebook, lo, hi, 0.01), CodebookCodec(codebook, None, None, 0.01), True)
    return table


def filled_stores(key_codec, value_codec, batch: int, length: int, head_dim: int):
    """K and V stores holding `length` random N(0, 1) tokens per sequence, appended with the kernels."""
    from kvcal.kv import SegmentPolicy
    from kvcal.runtime.kernels import append_encoder
    from kvcal.runtime.segments import SegmentedStore

    width = KV_HEADS * head_dim
    stores = []
    for codec, keys in ((key_codec, True), (value_codec, False)):
        store = SegmentedStore(codec, SegmentPolicy(key_block=codec.block_tokens if keys else 0), keys, 0.0, batch, width, "cuda",
                               encoder_for=append_encoder, head_dim=head_dim)
        generator = torch.Generator(device="cuda").manual_seed(int(keys))
        for b in range(batch):
            store.append(b, torch.randn(length, width, device="cuda", dtype=torch.float16, generator=generator))
        stores.append(store)
    return stores


def stored_bytes(stores, batch: int) -> int:
    return sum(store.used_bytes(b) for store in stores for b in range(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--lengths", default="4096,32768,131072", help="cached tokens per sequence, comma-separated")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per measurement (median reported)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=128, help="channels per head (default: %(default)s)")
    args = parser.parse_args()
    head_dim = args.head_dim
    if not torch.cuda.is_available():
        sys.exit("the runtime decode benchmark needs a CUDA GPU; nothing was measured")
    from kvcal.runtime import kernels, tensor_core
    from kvcal.runtime.kernels import Segments, prepare_decode

    if not kernels.cuda_ready("cuda"):
        sys.exit("the runtime decode benchmark needs CuPy: pip install -e '.[gpu]'")
    started = provenance()
    bandwidth = copy_bandwidth()
    inv_freq = (1.0 / 1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).cuda()
    chosen = {name: v for name, v in variants(head_dim).items() if not args.only or name in args.only.split(",")}
    rows = []
    for batch in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            sdpa = sdpa_seconds(batch, length, args.iters, head_dim)
            for name, (key_codec, value_codec, pre_rope) in chosen.items():
                keys, values = filled_stores(key_codec, value_codec, batch, length, head_dim)
                query = torch.randn(batch, HEADS, head_dim, device="cuda")
                launches = [Segments(k, v) for k, v in zip(keys.kernel_segments(), values.kernel_segments())]
                served = [tensor_core.serve(segments, HEADS, KV_HEADS, head_dim, inv_freq if pre_rope else None) for segments in launches]
                run = prepare_decode(query, launches, KV_HEADS, head_dim**-0.5, [0] * batch, served)
                seconds = timed(run, args.iters)
                read = stored_bytes((keys, values), batch) + 2 * query.numel() * 4
                rows.append({"variant": name, "batch": batch,
                             "tokens": length, "latency_us": round(seconds * 1e6, 2),
                             "bytes_read": read, "bandwidth_gbps": round(read / seconds / 1e9, 1),
                             "fraction_of_copy_bandwidth": round(read / seconds / bandwidth, 3),
                             "sdpa_fp16_latency_us": round(sdpa * 1e6, 2), "speedup_vs_sdpa_fp16": round(sdpa / seconds, 2),
                             "outliers": keys.body.outliers[0] + values.body.outliers[0]})
                print(rows[-1], flush=True)
                del keys, values, launches, run
                torch.cuda.empty_cache()
    name = write_device_result("decode", bandwidth, args.iters, rows, started, head_dim)
    lines = [f"# Decode attention as the runtime launches it, {started['device']} (commit {started['commit']}, {started['date']})", "",
             f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s; {KV_HEADS} KV heads, {HEADS} query heads, head_dim {head_dim}; L2 flushed.", "",
             "| variant | B | L | latency us | MB read | GB/s | of copy bw | SDPA fp16 us | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['tokens']} | {r['latency_us']} | {r['bytes_read'] / 1e6:.1f} | {r['bandwidth_gbps']} | "
              f"{r['fraction_of_copy_bandwidth']:.0%} | {r['sdpa_fp16_latency_us']} | {r['speedup_vs_sdpa_fp16']}x |" for r in rows]
    write_markdown(name, lines)


if __name__ == "__main__":
    main()
