"""The tensor-core decode kernel (kernels/decode_attention_tc.cu, kvcal.runtime.tensor_core) on a CUDA GPU, at
the GPU benchmarks' shapes and with their method (benchmarks/kernels/gpu_timing.py): latency (median of CUDA-event timings, L2 flushed before every timed
launch, host preparation outside), bytes read, bandwidth as a fraction of the measured device-to-device copy
bandwidth, speedup over torch SDPA in fp16.

Shapes: B = 8, 8 KV heads (--kv-heads: Gemma 3 has one), GQA 4, head_dim 128 (or 256, --head-dim: Gemma 3's), L = 32768
(--tokens). Variants: fp16 rows, KIVI-style
uniform int4 / int2 (keys per channel over blocks of G tokens, values per token over groups of G channels), the
same with pre-RoPE keys (rotated in the kernel; Llama's frequencies, positions 0..L-1), KVQuant nuq4 / nuq3
with pre-RoPE keys (NormalFloat codebooks; key thresholds +-3 per channel and no outliers, or +-2.5 with 1% of the
values and the keys beyond kept exact; a variant the kernel does not serve at the head_dim, at 256 pre-RoPE uniform
keys, is skipped and says why), and keys and values of two widths (KVmix's int2 or int3 keys
with int4 values in groups of 32, mixed's nuq3 / nuq4 with pre-RoPE keys), mixed's commonest layer (nuq2, 1% outliers), SKVQ's default
(2 bits, 16 groups permuted across the KV width, fp16 parameters, pre-RoPE keys), each with the launcher's split plan (one wave of resident blocks:
kvcal.runtime.tensor_core.split_plan) and fixed split sizes (--splits). Each row gives the blocks launched and the
blocks the device holds at once (the occupancy API's count x SMs). Before timing, every variant's output is checked against torch SDPA
(float32) over the stores' decoded rows (pre-RoPE keys rotated by kvcal.rope) at the benchmark shape, its outputs (the
partial splits and the merged rows) poisoned with NaN before the checked launch, so that an unwritten element fails,
and launched once more, poisoned again, for the same bits (same_bits_twice: no result may depend on the GPU's schedule);
--seed draws other random data (the campaign passes a fresh one). At the bound's shapes (B = 8, L = 32K, D = 128 or 256)
each variant's predictions by the written bound (benchmarks/results/bound_decode.json: tools/bound_decode.py's
calibrated model, on this device's copy bandwidth and the variant's bytes, KV heads and layout, its constant paid per
token and per 128-byte line a token's codes touch) are printed before it is timed and kept in its row.

--layout heads times the same work with the packed bodies keeping each KV head's rows together (kvcal.runtime.store.
PackedRows with rows_together=False, as kvcal.runtime.kernels.AppendKernels(rows_together=False) lays a CUDA store
out): a block's tokens are then one run of its KV head's codes instead of a piece of every token's row of all KV heads
(the CUDA stores' default, --layout rows). The kernel, its variant, the codes and the split plan are the same: what
the two runs' latencies differ by is the layout's (benchmarks.kernels layout times the reads alone). The bound
predicts the same either way with its constant paid per token, and fewer slots with it paid per line (a token's
codes touch fewer lines): the two runs tell the readings apart. fp16 rows have one layout and are skipped there.

Usage (CUDA + CuPy): python -m benchmarks.kernels gpu [--iters 20] [--only fp16,int2-g128] [--splits launcher,2048,4096]
                                                          [--tokens 32768] [--kernel-dir DIR] [--seed 0] [--head-dim 256]
                                                          [--kv-heads 1] [--layout heads]
Writes benchmarks/results/decode_tc_<device>.{json,md} (decode_tc_<device>_d256 at head_dim 256, _kv1 at one KV head,
_heads with --layout heads). --kernel-dir DIR times the kernels in DIR (a changed copy of
kernels/) instead: an A/B of two kernel sources is two runs on one machine, one with it and one without; such a run
prints its rows and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.kernels.gpu_timing import GROUP, HEAD_DIMS, KV_HEADS, copy_bandwidth, sdpa_seconds, timed, write_device_result
from benchmarks.common import provenance, write_markdown
from kvcal.runtime.store import STORE_LAYOUTS
from tools import bound_decode, decode_model

BATCH = 8


def variants(head_dim: int, kv_heads: int = KV_HEADS) -> dict:
    """name -> (K and V codecs of kv_heads heads or None for fp16 rows, pre-RoPE keys)."""
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook

    table = {"fp16": (None, False)}
    for bits, group in ((4, 128), (4, 32), (2, 128), (2, 64), (2, 32)):
        table[f"int{bits}-g{group}"] = ((ChannelBlockUniform(bits, group), TokenUniform(bits, group)), False)
    for bits in (4, 2):
        table[f"int{bits}-g128-pre-rope"] = ((ChannelBlockUniform(bits, 128), TokenUniform(bits, 128)), True)
    for bits in (4, 3):
        lo, hi = torch.full((kv_heads * head_dim,), -3.0), torch.full((kv_heads * head_dim,), 3.0)
        codebook = normal_float_codebook(bits)
        table[f"nuq{bits}-pre-rope"] = ((CodebookCodec(codebook, lo, hi), CodebookCodec(codebook)), True)
        keys = CodebookCodec(codebook, lo + 0.5, hi - 0.5, outlier_fraction=0.01)  # ~1.2% of N(0, 1) beyond 2.5
        table[f"nuq{bits}-1%-pre-rope"] = ((keys, CodebookCodec(codebook, outlier_fraction=0.01)), True)
    # keys and values of two widths: KVmix's int2 keys with int4 values (groups of 32), mixed's nuq3 keys with nuq4 values
    table["int2k-int4v-g32"] = ((ChannelBlockUniform(2, 32), TokenUniform(4, 32)), False)
    table["int3k-int4v-g32"] = ((ChannelBlockUniform(3, 32), TokenUniform(4, 32)), False)  # KVmix's 3-bit keys (planes3)
    table["int3-g32"] = ((ChannelBlockUniform(3, 32), TokenUniform(3, 32)), False)  # KIVI-3: planes3 values too
    lo, hi = torch.full((kv_heads * head_dim,), -3.0), torch.full((kv_heads * head_dim,), 3.0)
    table["nuq3k-nuq4v-pre-rope"] = ((CodebookCodec(normal_float_codebook(3), lo, hi), CodebookCodec(normal_float_codebook(4))), True)
    # mixed's commonest layer: nuq2 with 1% outliers
    keys = CodebookCodec(normal_float_codebook(2), lo + 0.5, hi - 0.5, outlier_fraction=0.01)
    table["nuq2-1%-pre-rope"] = ((keys, CodebookCodec(normal_float_codebook(2), outlier_fraction=0.01)), True)
    # SKVQ's default: 2-bit codes, 16 groups permuted across the KV width (of 64 channels at head_dim 128), fp16 parameters
    table["skvq2-pre-rope"] = (tuple(skvq_codec(kv_heads * head_dim, seed) for seed in (0, 1)), True)
    table["skvq3-pre-rope"] = (tuple(skvq_codec(kv_heads * head_dim, seed, bits=3) for seed in (0, 1)), True)  # planes3
    return table


def packed_variant_refusal(names: str, head_dim: int, kv_heads: int = KV_HEADS) -> str | None:
    """Why a benchmark of packed stores refuses `names` (comma-separated variants): the first that is not a packed
    variant (fp16's has no codecs), naming those that are; None where every one is."""
    known = variants(head_dim, kv_heads)
    unknown = [name for name in names.split(",") if known.get(name, (None,))[0] is None]
    if not unknown:
        return None
    return (f"--variants: {unknown[0]} is not a packed variant of the tensor-core benchmark; choose from "
            + ", ".join(name for name, (codecs, _) in known.items() if codecs is not None))


def skvq_codec(width: int, seed: int, groups: int = 16, bits: int = 2):
    """SKVQ's codec (kvcal.fit.skvq.SkvqTensor) of `bits`-bit codes over `width` channels in `groups` equal groups, a
    seeded permutation (16 groups: as many as the tensor-core kernel reads in a KV head)."""
    from kvcal.fit.skvq import SkvqTensor

    permutation = torch.randperm(width, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    starts = torch.arange(0, width + 1, width // groups, dtype=torch.int32)
    return SkvqTensor(permutation, starts, torch.ones(groups), bits, fp8=False)


def inv_freq(head_dim: int) -> torch.Tensor:
    """Llama's RoPE frequencies (base 10000)."""
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def filled_stores(codecs, batch: int, length: int, head_dim: int, seed: int = 0, device: str = "cuda", kv_heads: int = KV_HEADS,
                  rows_together: bool = True):
    """K and V stores of `length` random N(0, 1) tokens per sequence, every KV head's head_dim channels a row (torch
    codecs on `device`; packed bodies keep each row whole, or each KV head's rows together), drawn under `seed`."""
    from kvcal.runtime.store import Fp16Rows, PackedRows

    width = kv_heads * head_dim
    stores = []
    for side in range(2):
        store = (Fp16Rows(batch, width, device) if codecs is None
                 else PackedRows(codecs[side], batch, width, device, head_dim=head_dim, rows_together=rows_together))
        generator = torch.Generator(device=device).manual_seed(2 * seed + side)
        for b in range(batch):
            store.append(b, torch.randn(length, width, device=device, dtype=torch.float16, generator=generator))
        stores.append(store)
    return stores


def poisoned_run(run) -> torch.Tensor:
    """run()'s output after its buffers were filled with NaN: an element the launch leaves unwritten stays NaN."""
    for buffer in run.outputs:
        buffer.fill_(float("nan"))
    return run().clone()


def checked(out: torch.Tensor, query: torch.Tensor, keys, values, length: int, rope: bool, head_dim: int) -> float:
    """Largest |out - SDPA over the decoded rows| (float32), inf where out has a NaN; rope: the keys are rotated first
    (positions 0..)."""
    from kvcal.rope import apply_rope

    if hasattr(keys, "words"):
        k, v = keys.decoded(length), values.decoded(length)
    else:
        k, v = keys.data[:, :length].float(), values.data[:, :length].float()
    k = k.view(query.shape[0], length, -1, head_dim)
    if rope:
        k = apply_rope(k, torch.arange(length, device=k.device), inv_freq(head_dim))
    k = k.transpose(1, 2)
    v = v.view(query.shape[0], length, -1, head_dim).transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(query[:, :, None].float(), k, v, scale=head_dim**-0.5, enable_gqa=True)
    del k, v
    if out.isnan().any():
        return float("inf")
    return (out - want[:, :, 0]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed launches per measurement (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cache and queries (default: %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--splits", default="launcher,512,2048,4096",
                        help="tokens per split to time, comma-separated multiples of 64 (a variant whose stages hold 128 "
                             "tokens skips the others); 'launcher': the launcher's plan")
    parser.add_argument("--tokens", type=int, default=32768, help="cached tokens per sequence")
    parser.add_argument("--kernel-dir", type=Path, default=None,
                        help="time the kernels of this folder (a changed copy of kernels/); prints, writes nothing")
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=128, help="channels per head (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS,
                        help=f"KV heads, each with {GROUP} query heads (default: %(default)s; Gemma 3's: 1)")
    parser.add_argument("--layout", choices=STORE_LAYOUTS, default="rows",
                        help="how packed bodies keep their codes: each token's row whole (a CUDA store's default) or each "
                             "KV head's rows together (default: %(default)s; see above)")
    args = parser.parse_args()
    head_dim, kv_heads, batch = args.head_dim, args.kv_heads, BATCH
    if kv_heads <= 0:
        parser.error(f"--kv-heads {kv_heads}: a positive number of KV heads")
    if args.layout == "heads" and kv_heads == 1:
        parser.error("--layout heads with --kv-heads 1: a row of one KV head is that head's piece already")
    if args.tokens <= 0:
        parser.error(f"--tokens {args.tokens}: a positive number of tokens")
    if args.kernel_dir is not None and not (args.kernel_dir / "decode_attention_tc.cu").is_file():
        parser.error(f"--kernel-dir {args.kernel_dir}: no decode_attention_tc.cu there (give a copy of kernels/)")
    try:
        splits = [None if s == "launcher" else int(s) for s in args.splits.split(",")]
    except ValueError:
        parser.error(f"--splits {args.splits}: 'launcher' or whole numbers of tokens, comma-separated")
    if any(s is not None and (s <= 0 or s % 64) for s in splits):
        parser.error(f"--splits {args.splits}: tokens per split are positive multiples of 64 (whole stages)")
    if not torch.cuda.is_available():
        sys.exit("the tensor-core benchmark needs a CUDA GPU; nothing was measured")
    from kvcal.errors import KvcalError
    from kvcal.runtime import kernel_source, tensor_core

    if args.kernel_dir is not None:  # before the first compile: the modules are built from this folder
        kernel_source.KERNEL_DIR = args.kernel_dir.resolve()
    started = provenance()
    bandwidth = copy_bandwidth()
    length = args.tokens
    sdpa = sdpa_seconds(batch, length, args.iters, head_dim, kv_heads)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, SDPA fp16 {sdpa * 1e6:.1f} us", flush=True)
    # the written bound's prediction, printed before each variant is timed (its shapes only: B = 8, L = 32K, D = 128 or
    # 256, at any number of KV heads, in either layout)
    shape = {"batch": batch, "kv_heads": kv_heads, "group": GROUP, "head_dim": head_dim, "tokens": length}
    predicted = bound_decode.committed_predictions(shape=shape)
    rows = []
    for name, (codecs, rope) in variants(head_dim, kv_heads).items():
        if args.only and name not in args.only.split(","):
            continue
        if codecs is None and args.layout == "heads":
            print(f"{name}: skipped with --layout heads: fp16 rows are kept whole", flush=True)
            continue
        if codecs is not None:
            try:
                tensor_core.variant_for_codecs(*codecs, head_dim, GROUP, rope=rope)
            except KvcalError as refused:
                print(f"{name}: skipped at head_dim {head_dim}: {refused}", flush=True)
                continue
        keys, values = filled_stores(codecs, batch, length, head_dim, seed=args.seed, kv_heads=kv_heads,
                                     rows_together=STORE_LAYOUTS[args.layout])
        query = torch.randn(batch, kv_heads * GROUP, head_dim, device="cuda", generator=torch.Generator(device="cuda").manual_seed(args.seed))
        read = sum(s.used_bytes(b) for s in (keys, values) for b in range(batch)) + 2 * query.numel() * 4
        error = repeats = None
        variant = tensor_core.variant_for(keys, values, head_dim, GROUP, rope=rope)
        resident = tensor_core.resident_blocks(variant.name, variant.shared_bytes(), 0)
        walk = predicted["walks"].get(name) if predicted else None
        prediction = ({reading: round(bound_decode.predicted_us(walk, predicted["calibration"], bandwidth, read, batch * kv_heads * length,
                                                                reading, kv_heads, args.layout), 2)
                       for reading in decode_model.READINGS} if walk else None)
        if prediction is not None:
            print(f"{name}: predicted {prediction['token']} us with the constant paid per token, {prediction['line']} us per "
                  f"line (the calibrated bound at {predicted['commit']})", flush=True)
        for per_split in splits:
            if per_split is not None and per_split % variant.stage_tokens:
                print(f"{name}: {per_split} tokens per split skipped (stages of {variant.stage_tokens} tokens)", flush=True)
                continue
            run = tensor_core.prepare_decode_tc(query, keys, values, kv_heads, head_dim**-0.5, per_split=per_split,
                                                inv_freq=inv_freq(head_dim) if rope else None)
            if error is None:
                first = poisoned_run(run)
                error = checked(first, query, keys, values, length, rope, head_dim)
                repeats = torch.equal(first, poisoned_run(run))  # the same bits on a second launch
                del first
                torch.cuda.empty_cache()
            seconds = timed(run, args.iters)
            rows.append({"variant": name, "batch": batch, "tokens": length, "per_split": run.per_split, "splits": run.splits,
                         "blocks": run.splits * batch * kv_heads, "resident_blocks": resident,
                         "plan": "launcher" if per_split is None else "fixed",
                         "latency_us": round(seconds * 1e6, 2), "bytes_read": read, "bandwidth_gbps": round(read / seconds / 1e9, 1),
                         "fraction_of_copy_bandwidth": round(read / seconds / bandwidth, 3),
                         "sdpa_fp16_latency_us": round(sdpa * 1e6, 2), "speedup_vs_sdpa_fp16": round(sdpa / seconds, 2),
                         "max_abs_error_vs_sdpa_fp32": round(error, 6), "same_bits_twice": repeats, "predicted_us": prediction})
            print(rows[-1], flush=True)
        del keys, values
        torch.cuda.empty_cache()
    if args.kernel_dir is not None:
        return
    name = write_device_result("decode_tc", bandwidth, args.iters, rows, started, head_dim, kv_heads, args.layout)
    laid_out = ", each KV head's rows together" if args.layout == "heads" else ""
    lines = [f"# Tensor-core decode attention, {started['device']} (commit {started['commit']}, {started['date']})", "",
             f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s; {kv_heads} KV heads{laid_out}, {kv_heads * GROUP} query heads, "
             f"head_dim {head_dim}; L2 flushed; kernels/decode_attention_tc.cu via kvcal.runtime.tensor_core.", "",
             "| variant | B | L | tokens/split (plan) | blocks / resident | latency us | predicted us (per token / per line) "
             "| MB read | GB/s | of copy bw "
             "| SDPA fp16 us | speedup | max err | same bits twice |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['tokens']} | {r['per_split']} ({r['plan']}) | {r['blocks']} / {r['resident_blocks']} | {r['latency_us']} | "
              f"{'{token} / {line}'.format(**r['predicted_us']) if r['predicted_us'] is not None else '-'} | {r['bytes_read'] / 1e6:.1f} | "
              f"{r['bandwidth_gbps']} | {r['fraction_of_copy_bandwidth']:.0%} | {r['sdpa_fp16_latency_us']} | "
              f"{r['speedup_vs_sdpa_fp16']}x | {r['max_abs_error_vs_sdpa_fp32']:.1e} | {'yes' if r['same_bits_twice'] else 'NO'} |"
              for r in rows]
    write_markdown(name, lines)


if __name__ == "__main__":
    main()
