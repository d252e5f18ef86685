"""The CPU decode kernel on MLA's cache (multi-head latent attention, kvcal.adapters.LatentAttention) against the torch
reference the runtime falls back to: one layer's decode attention for one query token per sequence over L cached
tokens of a rotated key (64 channels) and a latent (512), DeepSeek-V2/V3's widths, with as many query heads as
--heads gives (DeepSeek-V2-Lite's 16, DeepSeek-V3's 128).

kernel: kvcal.runtime.cpu_kernel.decode_attention over the packed stores, the query's latent part scoring the
latent beside its rotated part scoring the key. reference: what kvcal.runtime.backends.ReferenceDecoder does, each
store dequantized whole into floats (pre-RoPE keys rotated), keys and latents side by side in one attention
(kvcal.runtime.reference.decode_attention). Each cell calls both in turn --rounds times after one untimed call each;
its time is the median of a side's calls, and the two outputs must agree (float32, two summation orders). GFMA/s: the
multiply-adds the attention needs (heads x tokens x (64 + 2 x 512) a sequence) over the kernel's time.

Variants: the tensor-core benchmark's codecs (benchmarks/kernels/tensor_core.py) made for the key's and the
latent's widths; keys of the pre-RoPE ones are rotated by Llama's frequencies from position 0.

Usage: python -m benchmarks.kernels cpu-latent [--variants int2-g32,nuq3-1%-pre-rope] [--heads 16,128]
       [--lengths 4096,32768] [--batch 1] [--threads N] [--rounds 9]
Writes benchmarks/results/cpu_latent_<cpu>.{json,md}.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import device_slug, provenance, timed_in_turn, write_markdown, write_result
from benchmarks.kernels.tensor_core import inv_freq, packed_variant_refusal, variants

ROPE_DIM, LATENT_DIM = 64, 512  # DeepSeek-V2/V3's qk_rope_head_dim and kv_lora_rank
DEFAULT_VARIANTS = "int2-g32,int4-g32,nuq3-1%-pre-rope,skvq2-pre-rope"
KEY_BLOCK = 128  # tokens a per-channel key block of every variant divides


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels cpu-latent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated tensor-core benchmark variants (packed ones)")
    parser.add_argument("--heads", default="16,128", help="query heads over the one latent, comma-separated")
    parser.add_argument("--lengths", default="4096,32768", help="cached tokens per sequence, comma-separated")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the kernel's and torch's threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=9, help="timed calls per side and cell, taken in turn")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cached tokens and the query")
    parser.add_argument("--name", default=None, help="results file name (default cpu_latent_<cpu>)")
    args = parser.parse_args(argv)
    refused = packed_variant_refusal(args.variants, ROPE_DIM, 1)
    if refused:
        parser.error(refused)
    try:
        args.heads = [int(n) for n in args.heads.split(",")]
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error("--heads and --lengths take comma-separated whole numbers")
    if min(args.heads + args.lengths) < 1 or args.batch < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--heads, --lengths, --batch, --threads and --rounds take positive numbers")
    if any(n % KEY_BLOCK for n in args.lengths):
        parser.error(f"--lengths are multiples of {KEY_BLOCK} tokens (the variants' per-channel key blocks are whole)")
    return args


def stores(name: str, batch: int, length: int, seed: int):
    """The rotated keys' and the latents' stores (kvcal.runtime.store.PackedRows, a CPU store's layout) of `length`
    random tokens per sequence in variant `name`, and whether the keys are stored before RoPE."""
    from kvcal.runtime.store import PackedRows

    (key_codec, _), pre_rope = variants(ROPE_DIM, 1)[name]
    (_, latent_codec), _ = variants(LATENT_DIM, 1)[name]
    made = tuple(PackedRows(codec, batch, width, "cpu", head_dim=width) for codec, width in
                 ((key_codec, ROPE_DIM), (latent_codec, LATENT_DIM)))
    generator = torch.Generator().manual_seed(seed)
    for b in range(batch):
        for store in made:
            store.append(b, torch.randn(length, store.width, generator=generator).half())
    return made, pre_rope


def measure(name: str, heads: int, length: int, args) -> dict:
    """One cell: the kernel's and the reference's median ms a call, and how far their outputs are apart."""
    from kvcal.runtime import cpu_kernel, kernels, reference

    (keys, latents), pre_rope = stores(name, args.batch, length, args.seed)
    query = torch.randn(args.batch, heads, ROPE_DIM + LATENT_DIM, generator=torch.Generator().manual_seed(args.seed + 1))
    scaling = 192**-0.5  # DeepSeek's (qk_nope_head_dim + qk_rope_head_dim)^-0.5
    cos, sin = reference.rope_tables(torch.arange(length)[None], inv_freq(ROPE_DIM), 1.0)
    tables = cpu_kernel.half_rope_tables(cos, sin) if pre_rope else None
    launch = [kernels.Segments((None, keys, None), (None, latents, None))]
    visible = torch.ones(args.batch, length, dtype=torch.bool)

    def kernel():
        return cpu_kernel.decode_attention(query, launch, 1, scaling, tables, value_dim=LATENT_DIM, values_scored=True)

    def torch_reference():
        key_rows = torch.stack([keys.read(b) for b in range(args.batch)])[:, None]
        if pre_rope:
            key_rows = reference.rotate(key_rows, cos, sin)
        latent_rows = torch.stack([latents.read(b) for b in range(args.batch)])[:, None]
        return reference.decode_attention(query[:, :, None], torch.cat([key_rows, latent_rows], -1), latent_rows, visible,
                                          scaling)[:, :, 0]

    outputs, ms = timed_in_turn({"kernel": kernel, "reference": torch_reference}, args.rounds)
    multiply_adds = args.batch * heads * length * (ROPE_DIM + 2 * LATENT_DIM)
    return {"variant": name, "heads": heads, "batch": args.batch, "tokens": length, "kernel_ms": round(ms["kernel"], 3),
            "reference_ms": round(ms["reference"], 3), "speedup": round(ms["reference"] / ms["kernel"], 2),
            "kernel_gfma_per_s": round(multiply_adds / ms["kernel"] / 1e6, 1),
            "max_abs_difference": float((outputs["kernel"] - outputs["reference"]).abs().max())}


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvcal.runtime import cpu_kernel

    torch.set_num_threads(args.threads)
    started = provenance()
    rows = []
    for name in args.variants.split(","):
        for heads in args.heads:
            for length in args.lengths:
                rows.append(measure(name, heads, length, args))
                print(rows[-1], flush=True)
    name = args.name or "cpu_latent_" + device_slug(started["device"])
    settings = {"batch": args.batch, "rope_dim": ROPE_DIM, "latent_dim": LATENT_DIM, "threads": args.threads,
                "rounds": args.rounds, "seed": args.seed, "kernel": cpu_kernel.describe()}
    write_result(name, {"settings": settings, "results": rows}, started)
    lines = [f"# CPU decode kernel on MLA's latent, {started['device']} (commit {started['commit']}, {started['date']})", "",
             f"`python -m benchmarks.kernels cpu-latent`: {settings['kernel']}; B={args.batch}, one rotated key of "
             f"{ROPE_DIM} and one latent of {LATENT_DIM} channels a token, the query's heads over both; the median of "
             f"{args.rounds} calls a side, taken in turn. reference: the stores dequantized whole, one attention over keys "
             "and latents side by side (the runtime's fallback).", "",
             "| variant | query heads | tokens | kernel ms | reference ms | speedup | kernel GFMA/s | max abs difference |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['heads']} | {r['tokens']} | {r['kernel_ms']} | {r['reference_ms']} | {r['speedup']}x | "
              f"{r['kernel_gfma_per_s']} | {r['max_abs_difference']:.1e} |" for r in rows]
    write_markdown(name, lines)
    if max(r["max_abs_difference"] for r in rows) > 1e-3:
        raise SystemExit("the kernel and the reference disagree beyond float32 rounding")


if __name__ == "__main__":
    main()
