"""kernels/decode_attention_tc.cu (the tensor-core decode kernel, launched by kvcal.runtime.tensor_core):

- the CPU emulator (tests/kernel_emulation: fibers, and the PTX models of mma / ldmatrix / cp.async / lop3 / prmt)
  runs the .cu unchanged on stores filled by kvcal.runtime.store with the torch codecs, against softmax attention
  in float64 over the stores' decoded rows: fp16 rows, uniform int4 / int2 (KIVI: keys per channel over blocks of
  tokens, values per token), head_dim 64 / 128 / 256, GQA 1 / 2 / 4 / 8, batches of 1 and 3 with ragged lengths
  (0, 1, G - 1, G, G + 1 and a length over several splits), within 2e-3; KVQuant's nuq4, nuq3 and nuq2 (codebook
  keys with per-channel thresholds, values with per-token thresholds; random non-uniform codebooks; nuq3 in
  planes3, at head_dim 64 and 256 too; nuq2 by a nibble table), with 1% and crowded outliers kept exact (pre-RoPE keys, at head_dim 256 too;
  post-RoPE keys on the same variants, rotated by angle 0), within 4e-3 (nuq4 with outliers at 256 in 2 stages); pre-RoPE keys
  rotated at float64 angles in the reference, sequences starting at positions past 100K and past 2^24, and one split
  of 65 stages; uniform int3 (planes3) on either side, values in groups of 32, 64 and 128 channels; keys and values
  of two widths (KVmix's int4 / int3 / int2 keys with int4 / int3 / int2 values; mixed's nuq2 / nuq3 / nuq4); SKVQ's
  channel groups (1- to 4-bit codes on either side, fp16 and fp8 parameters, uneven groups across the KV heads, up to
  16 in a head) at head_dim 64, 128 and 256, within 2e-3, and the bodies it does not serve refused;
- the comparison can fail: a kernel with a planted mapping bug is built and must be caught;
- NVRTC compiles every variant for sm_80 and sm_90 without spills;
- where CUDA and CuPy are present, the kernel runs on the GPU against the same reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import requires_gpu
from helpers.tensor_core_emulation import build, decode, schedule_in_reverse, symbol

from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform
from kvcal.rope import padded_inv_freq
from kvcal.runtime import kernel_source, tensor_core
from kvcal.runtime.store import Fp16Rows, PackedRows
from kvcal.runtime.tensor_core import Variant

KERNEL = kernel_source.KERNEL_DIR / tensor_core.MODULE
TOLERANCE = 2e-3
# nuq values: the per-token scale (hi - lo) / 2 is not an fp16 number, so P * scale (an fp16 operand) rounds by up
# to 2^-11 of the token's half range (here up to ~7): a one-token sequence's output is off by up to ~3.4e-3
NUQ_TOLERANCE = 4e-3
# SKVQ's channel groups: the values' (code + zero) * scale in fp16 pairs rounds the sum (where it leaves zero's binade)
# and then the product, up to 1.5 ulp of the value where one rounding is half an ulp: a one-token sequence's output is
# that value
GROUPS_TOLERANCE = 4e-3
G = 128  # the key block of the int4 / int2 cases (KIVI's group); lengths around it
LENGTHS = {"1": [700], "3": [0, 129, 700], "3-edges": [1, G - 1, G]}  # 700: six splits of 128 tokens
PER_SPLIT = 128
KV_HEADS = 2
CODECS = {"fp16": (16, 0, 0), "int4": (4, G, G), "int2": (2, G, G), "int4-g32": (4, 32, 32), "int2-g32": (2, 32, 32), "int2-g64": (2, 64, 64),
          "int2-g256": (2, 256, 256),
          "nuq4": (4, 0, 0), "nuq3": (3, 0, 0), "nuq4-out": (4, 0, 0), "nuq3-out": (3, 0, 0),
          "nuq4-crowded": (4, 0, 0), "nuq3-crowded": (3, 0, 0),  # nuq: CodebookCodec (bits, -, -)
          # keys and values of two widths (KVmix's layers, mixed's): (key bits, key group, value group, value bits)
          "int4-int2v": (4, 32, 32, 2), "int2-int4v": (2, 32, 32, 4), "int4-int2v-g128": (4, 128, 128, 2),
          "int3-int4v": (3, 32, 32, 4), "int3-int2v": (3, 32, 32, 2), "int3-int4v-g128": (3, 128, 128, 4),
          # uniform 3-bit values (KIVI-3's, KVmix's) in planes3: an eighth (groups of 32), a quarter or a half of a unit a lane
          "int3-g32": (3, 32, 32), "int3-g64": (3, 64, 64), "int3": (3, G, G), "int4-int3v": (4, 32, 32, 3), "int2-int3v-g128": (2, 128, 128, 3),
          "nuq3-nuq4v": (3, 0, 0, 4), "nuq4-nuq3v": (4, 0, 0, 3), "nuq3-nuq4v-out": (3, 0, 0, 4), "nuq4-nuq3v-out": (4, 0, 0, 3),
          # mixed's 2-bit codebooks, alone and beside 3- and 4-bit ones
          "nuq2": (2, 0, 0), "nuq2-out": (2, 0, 0), "nuq2-crowded": (2, 0, 0), "nuq2-nuq4v": (2, 0, 0, 4),
          "nuq3-nuq2v-out": (3, 0, 0, 2), "nuq2-nuq3v-out": (2, 0, 0, 3), "nuq4-nuq2v-out": (4, 0, 0, 2)}
ROPE = {"int4-rope": "int4", "int2-rope": "int2", "int4-g32-rope": "int4-g32", "int4-int3v-rope": "int4-int3v", "nuq4-rope": "nuq4", "nuq3-rope": "nuq3",
        "nuq4-out-rope": "nuq4-out", "nuq3-out-rope": "nuq3-out", "nuq4-crowded-rope": "nuq4-crowded",
        "nuq3-crowded-rope": "nuq3-crowded", "nuq3-nuq4v-out-rope": "nuq3-nuq4v-out", "nuq4-nuq3v-out-rope": "nuq4-nuq3v-out",
        "nuq3-nuq4v-rope": "nuq3-nuq4v", "nuq2-rope": "nuq2", "nuq2-out-rope": "nuq2-out", "nuq2-crowded-rope": "nuq2-crowded",
        "nuq3-nuq2v-out-rope": "nuq3-nuq2v-out", "nuq2-nuq3v-out-rope": "nuq2-nuq3v-out", "nuq4-nuq2v-out-rope": "nuq4-nuq2v-out"}
# nuq with outliers: (fraction kept exact of the per-token value thresholds, half range of the key thresholds): ~1%
# of N(0, 1) keys beyond 2.5; crowded: ~13% of keys beyond 1.5 and 30% of values, past a stage's copies (OUTLIER_SLOTS)
OUTLIERS = {"nuq4-out": (0.01, 2.5), "nuq3-out": (0.01, 2.5), "nuq4-crowded": (0.3, 1.5), "nuq3-crowded": (0.3, 1.5),
            "nuq3-nuq4v-out": (0.01, 2.5), "nuq4-nuq3v-out": (0.01, 2.5), "nuq2-out": (0.01, 2.5), "nuq2-crowded": (0.3, 1.5),
            "nuq3-nuq2v-out": (0.01, 2.5), "nuq2-nuq3v-out": (0.01, 2.5), "nuq4-nuq2v-out": (0.01, 2.5)}
POSITIONS = [0, 100_003, 2**24 + 5]  # of each sequence's first row (pre-RoPE cases)
# SKVQ's channel groups (always pre-RoPE keys): (key bits, value bits, fp8 parameters, groups over the KV width)
GROUPS = {"skvq2": (2, 2, False, 5), "skvq4": (4, 4, False, 5), "skvq2-fp8": (2, 2, True, 5), "skvq4-skvq2v-fp8": (4, 2, True, 3),
          "skvq2-skvq4v": (2, 4, False, 5), "skvq2-fp8-16g": (2, 2, True, 16), "skvq3": (3, 3, False, 5),
          "skvq3-skvq1v-fp8": (3, 1, True, 5), "skvq1-skvq4v": (1, 4, False, 16), "skvq2-skvq3v": (2, 3, False, 5)}

# the variants the emulation runs: (codec, head_dim, gqa, batch)
CASES = ([("fp16", d, gqa, "3") for d in (64, 128) for gqa in (1, 2, 4, 8)]
         + [(c, d, gqa, "3") for c in ("int4", "int2") for d, gqa in ((128, 1), (128, 2), (128, 4), (128, 8), (64, 4))]
         + [(c, 128, 4, batch) for c in ("fp16", "int4", "int2") for batch in ("1", "3-edges")]
         + [("fp16", 64, 2, "3-edges"), ("int4", 64, 8, "3-edges"), ("int2", 64, 1, "3-edges"),
            ("int4-g32", 128, 4, "3"), ("int2-g64", 64, 4, "3"), ("int2-g256", 128, 4, "3")]
         + [(c, 128, gqa, "3") for c in ("int4-rope", "int2-rope") for gqa in (1, 3, 4, 8)]
         + [("int4-rope", 64, 4, "3"), ("int4-rope", 64, 2, "3-edges"), ("int2-rope", 128, 4, "3-edges"),
            ("int4-g32-rope", 128, 4, "3")]
         # int2 g32 (KIVI's defaults): a lane's byte of each value row, keys in blocks of 32 tokens
         + [("int2-g32", 128, gqa, "3") for gqa in (1, 4, 8)] + [("int2-g32", 64, 4, "3-edges"), ("int2-g32", 128, 2, "1")]
         + [(c, d, gqa, "3") for c in ("nuq4", "nuq4-rope") for d, gqa in ((128, 1), (128, 4), (128, 8), (64, 3))]
         + [("nuq4", 128, 4, "3-edges"), ("nuq4-rope", 64, 4, "3-edges"), ("nuq4-rope", 128, 2, "1")]
         + [(c, 128, gqa, "3") for c in ("nuq3", "nuq3-rope") for gqa in (1, 4, 8)] + [("nuq3-rope", 128, 3, "3-edges")]
         + [(c, 128, gqa, "3") for c in ("nuq4-out-rope", "nuq3-out-rope") for gqa in (1, 4, 8)]
         # 6 query heads a KV head: Laguna's full layers (48 over 8 KV heads)
         + [("nuq3-out-rope", 128, 6, "3"), ("int2", 128, 6, "3-edges")]
         + [("nuq4-out-rope", 64, 3, "3"), ("nuq4-out-rope", 64, 8, "3-edges"), ("nuq3-out-rope", 128, 2, "3-edges"),
            ("nuq4-crowded-rope", 128, 4, "3"), ("nuq4-crowded-rope", 64, 2, "1")]
         # post-RoPE keys with outliers: the pre-RoPE variants, every rotation by angle 0
         + [("nuq3-out", 128, 4, "3"), ("nuq4-out", 64, 3, "3-edges")]
         # nuq3 at head_dim 64: 24-byte rows (8-byte copies), 8 codes a lane (planes3 quarters)
         + [("nuq3", 64, 4, "3"), ("nuq3-rope", 64, 2, "3"), ("nuq3-rope", 64, 1, "3-edges"), ("nuq3-out-rope", 64, 4, "3"),
            ("nuq3-out-rope", 64, 8, "1")]
         # head_dim 256 (Gemma 2 / 3), post-RoPE keys: fp16 in 2 stages, 64 channels a lane, nuq3 in whole planes3 units
         + [("fp16", 256, 4, "3"), ("fp16", 256, 1, "3-edges"), ("int4", 256, 8, "3"), ("int2", 256, 4, "3-edges"),
            ("int4-g32", 256, 4, "3"), ("int2-g32", 256, 4, "3"), ("int2-g64", 256, 2, "3"), ("nuq4", 256, 4, "3"), ("nuq3", 256, 8, "3"),
            ("nuq3", 256, 1, "3-edges")]
         # head_dim 256, pre-RoPE codebook keys (Gemma 3's kvquant: nuq3, 1% outliers, GQA 4): the key pairs and the
         # query fragments in shared memory, the rotation in parts of 4 pairs
         + [("nuq3-out-rope", 256, 4, "3"), ("nuq3-out-rope", 256, 1, "3-edges"), ("nuq3-rope", 256, 8, "3"),
            ("nuq4-rope", 256, 4, "3-edges"), ("nuq3-out-rope", 256, 2, "3"), ("nuq3-crowded-rope", 256, 4, "1")]
         # head_dim 256 with outliers and a nuq4 side (mixed's Gemma 3 layers): 2 stages, value parameters stored at the
         # end of the iteration that loaded them, before the barrier behind which their stage is read
         + [("nuq4-out-rope", 256, 4, "3"), ("nuq4-out-rope", 256, 1, "3-edges"), ("nuq4-crowded-rope", 256, 2, "1"),
            ("nuq3-nuq4v-out-rope", 256, 4, "3"), ("nuq4-nuq3v-out-rope", 256, 8, "3-edges")]
         # keys and values of two widths: KVmix's int2 / int4 layers (groups of 32), mixed's nuq3 / nuq4 ones
         + [("int4-int2v", 128, 4, "3"), ("int2-int4v", 128, 4, "3-edges"), ("int2-int4v", 64, 2, "3"), ("int4-int2v", 256, 4, "3"),
            ("int4-int2v-g128", 128, 8, "3"), ("nuq4-nuq3v", 128, 4, "3"), ("nuq3-nuq4v-rope", 256, 4, "3-edges"),
            ("nuq3-nuq4v-out-rope", 128, 4, "3"), ("nuq4-nuq3v-out-rope", 64, 2, "3-edges"), ("nuq4-nuq3v", 256, 2, "1")]
         # KVmix's 3-bit keys (planes3, code values from a table) with 4- or 2-bit values
         + [("int3-int4v", 128, 4, "3"), ("int3-int2v", 128, 8, "3-edges"), ("int3-int4v", 64, 2, "3"), ("int3-int2v", 256, 4, "3"),
            ("int3-int4v", 256, 1, "1"), ("int3-int4v-g128", 128, 4, "3")]
         # uniform 3-bit values (planes3, code values from the values' table), with 3-, 4- and 2-bit keys
         + [("int3-g32", 128, 4, "3"), ("int3-g32", 64, 2, "3-edges"), ("int3-g32", 256, 8, "3"), ("int3-g64", 64, 4, "3"),
            ("int3", 128, 1, "3-edges"), ("int3", 256, 4, "1"), ("int4-int3v", 128, 8, "3"), ("int4-int3v-rope", 64, 4, "3"),
            ("int2-int3v-g128", 128, 4, "3-edges")]
         # mixed's 2-bit codebooks: a nibble table; pre-RoPE keys at 64 and 256 and values at 64 in half-words
         + [("nuq2", 64, 4, "3"), ("nuq2", 128, 1, "3-edges"), ("nuq2", 256, 4, "3"), ("nuq2-rope", 64, 3, "3"),
            ("nuq2-rope", 128, 4, "3-edges"), ("nuq2-rope", 256, 2, "3"), ("nuq2-out-rope", 64, 3, "3"),
            ("nuq2-out-rope", 64, 8, "3-edges"), ("nuq2-out-rope", 128, 4, "3"), ("nuq2-out-rope", 256, 4, "3"),
            ("nuq2-out-rope", 256, 1, "3-edges"), ("nuq2-crowded-rope", 64, 4, "1"), ("nuq3-nuq2v-out-rope", 64, 3, "3"),
            ("nuq2-nuq3v-out-rope", 64, 3, "3-edges"), ("nuq4-nuq2v-out-rope", 64, 3, "3"), ("nuq2-nuq4v", 128, 4, "3"),
            ("nuq3-nuq2v-out-rope", 256, 4, "3")]
         # SKVQ's channel groups: every stage dequantized into fp16 rows, keys rotated there; fp16 and fp8 parameters,
         # uneven groups that cross the KV heads, up to 16 of them in a head (16 over two heads)
         + [("skvq2", d, gqa, "3") for d, gqa in ((64, 3), (128, 4), (256, 2))]
         + [("skvq2-fp8", 128, 8, "3-edges"), ("skvq2-fp8", 64, 1, "1"), ("skvq4", 128, 4, "3"), ("skvq4", 256, 4, "3-edges"),
            ("skvq4-skvq2v-fp8", 64, 4, "3"), ("skvq2-skvq4v", 128, 2, "3"), ("skvq2-fp8-16g", 128, 4, "3"),
            ("skvq2-fp8-16g", 256, 1, "3")]
         # 3-bit codes in planes3 (a pair's low bits and high bits from two words of their unit), 1-bit ones in lsb words
         + [("skvq3", 64, 2, "3"), ("skvq3", 128, 4, "3-edges"), ("skvq3", 256, 1, "3"), ("skvq3-skvq1v-fp8", 128, 4, "3"),
            ("skvq1-skvq4v", 64, 4, "3-edges"), ("skvq2-skvq3v", 256, 2, "3")])


def tolerance(codec: str) -> float:
    return NUQ_TOLERANCE if codec.startswith("nuq") else GROUPS_TOLERANCE if codec in GROUPS else TOLERANCE


def variant_of(codec: str, head_dim: int, gqa: int) -> Variant:
    if codec in GROUPS:
        bits, vbits, fp8, _ = GROUPS[codec]
        return Variant(head_dim, bits, 0, head_dim, gqa, True, value_bits=vbits if vbits != bits else 0, channel_groups=2 if fp8 else 1)
    store_codec = ROPE.get(codec, codec)
    bits, kg, vg, *value_bits = CODECS[store_codec]
    vb = value_bits[0] if value_bits else 0
    if store_codec.startswith("nuq"):
        outliers = store_codec in OUTLIERS  # (with post-RoPE keys too: the pre-RoPE variant rotates them by angle 0)
        return Variant(head_dim, bits, 0, head_dim, gqa, codec in ROPE or outliers, codebook=True, outliers=outliers, value_bits=vb)
    return Variant(head_dim, bits, kg, vg, gqa, codec in ROPE, value_bits=vb)


def nuq_codecs(bits: int, width: int, seed: int = 7, outliers: tuple[float, float] = (0.0, 2.5),
               value_bits: int | None = None) -> tuple[CodebookCodec, CodebookCodec]:
    """Keys with per-channel thresholds (the channels with an offset in `filled` shifted with it), values with
    per-token ones; each a random sorted codebook in [-1, 1] (non-uniform: a wrong entry or order shows), of `bits`
    entries' width (the values' of value_bits where given).
    outliers: (the values' fraction kept exact, the keys' half range; with a fraction > 0 keys beyond it are kept too)."""
    g = torch.Generator().manual_seed(seed)

    def codebook(bits=bits):
        inner = torch.rand(2**bits - 2, generator=g) * 2 - 1
        return torch.cat((torch.tensor([-1.0]), inner, torch.tensor([1.0]))).sort().values

    offset = torch.zeros(width)
    offset[::7] = 2.0
    fraction, half_range = outliers
    return (CodebookCodec(codebook(), lo=offset - half_range, hi=offset + half_range, outlier_fraction=fraction),
            CodebookCodec(codebook(value_bits or bits), outlier_fraction=fraction))


def skvq_codecs(codec: str, width: int) -> tuple:
    """SKVQ's keys and values (kvcal.fit.skvq.SkvqTensor) of a GROUPS case: a seeded permutation of the KV width per
    side, split into groups of uneven sizes."""
    from kvcal.fit.skvq import SkvqTensor

    bits, vbits, fp8, groups = GROUPS[codec]

    def side(b, seed):
        g = torch.Generator().manual_seed(seed)
        inner = (torch.randperm(width - 1, generator=g)[: groups - 1] + 1).sort().values.tolist()
        starts = torch.tensor([0, *inner, width], dtype=torch.int32)
        return SkvqTensor(torch.randperm(width, generator=g).to(torch.int32), starts, torch.linspace(1.0, 0.8, groups), b, fp8)

    return side(bits, 11), side(vbits, 12)


def llama_inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


EMULATED = sorted({variant_of(c, d, q) for c, d, q, _ in CASES}, key=lambda v: v.name)


@pytest.fixture(scope="module")
def emulator():
    return build(EMULATED)


# ------------------------------------------------------------------------------------------------ stores and reference

def filled(codec: str, lengths: list[int], head_dim: int, device="cpu", seed: int = 0, fifo_offset: int = 0,
           rows_together: bool = True):
    """K and V stores of `lengths` random N(0, 1) tokens per sequence (quantized bodies: rounded up to whole key
    blocks; the kernel is then told the exact lengths). fifo_offset: fp16 rows start that many rows into the buffer.
    rows_together: the packed bodies keep each token's row whole (a CUDA store's default), else each KV head's rows
    together."""
    store_codec = ROPE.get(codec, codec)
    bits, kg, vg, *value_bits = CODECS.get(store_codec, (0, 0, 0))
    width = KV_HEADS * head_dim
    g = torch.Generator().manual_seed(seed)
    if codec in GROUPS:
        codecs = skvq_codecs(codec, width)
    elif store_codec.startswith("nuq"):
        codecs = nuq_codecs(bits, width, outliers=OUTLIERS.get(store_codec, (0.0, 2.5)), value_bits=value_bits[0] if value_bits else bits)
    else:
        codecs = (ChannelBlockUniform(bits, kg), TokenUniform(value_bits[0] if value_bits else bits, vg))
    if bits == 16 and codec not in GROUPS:
        stores = (Fp16Rows(len(lengths), width, device), Fp16Rows(len(lengths), width, device))
    else:
        stores = tuple(PackedRows(c, len(lengths), width, device, head_dim=head_dim, rows_together=rows_together) for c in codecs)
    block = getattr(stores[0], "block", 1)  # both sides hold the same tokens: whole key blocks
    for side, store in enumerate(stores):
        for b, n in enumerate(lengths):
            stored = -(-n // block) * block
            x = torch.randn(stored + fifo_offset, width, generator=g) * (1.0 + side)
            x[:, ::7] += 2.0 * (side == 0)  # some channels with an offset, as real keys have
            store.append(b, x.to(torch.float16).to(device))
            if fifo_offset:
                store.pop_front(b, fifo_offset)
    return stores


def rotated(k: torch.Tensor, first_position: int, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """Rows (tokens, kv_heads * d) of pre-RoPE keys rotated (rotate-half) at positions first_position + row, with
    float64 angles."""
    tokens, width = k.shape
    d = inv_freq.numel() * 2
    angles = (first_position + torch.arange(tokens, dtype=torch.float64))[:, None] * inv_freq.double()[None]
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    x = k.view(tokens, width // d, d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]), -1).reshape(tokens, width)


def reference(query: torch.Tensor, keys, values, lengths: list[int], scaling: float, rope=None, visible=None,
              row_first=None) -> torch.Tensor:
    """Softmax attention in float64 over each sequence's first lengths[b] decoded rows (from row visible[b] on: a
    sliding window; row_first[b, h] for query head h where given); zeros without tokens. rope: (inv_freq,
    attention_scaling, positions): the keys are pre-RoPE."""
    batch, heads, d = query.shape
    gqa = heads // KV_HEADS
    out = torch.zeros(batch, heads, d, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k, v = keys.read(b)[:n].double().cpu(), values.read(b)[:n].double().cpu()
        if rope is not None:
            inv_freq, attention_scaling, positions = rope
            k = rotated(k, positions[b], inv_freq, attention_scaling)
        for h in range(heads):
            kvh, first = h // gqa, visible[b] if visible else 0
            first = int(row_first[b, h]) if row_first is not None else first
            if first < n:
                scores = (k[first:, kvh * d:(kvh + 1) * d] @ query[b, h].double().cpu()) * scaling
                out[b, h] = torch.softmax(scores, 0) @ v[first:, kvh * d:(kvh + 1) * d]
    return out


def run_emulated(lib, v: Variant, query, keys, values, lengths, scaling, per_split=PER_SPLIT, rope=None, visible=None,
                 row_first=None) -> torch.Tensor:
    """rope: as `reference`'s; visible: each sequence's first token the query sees (default 0); row_first (batch,
    heads): each query row's (default its sequence's)."""
    assert per_split % v.stage_tokens == 0, "splits hold whole stages (the launcher refuses others)"
    assert tensor_core.variant_for(keys, values, query.shape[2], query.shape[1] // KV_HEADS, rope=rope is not None) == v
    inv_freq, attention_scaling, positions = rope if rope is not None else (None, 1.0, None)
    out, arrivals = decode(lib, v, query, keys, values, KV_HEADS, lengths, scaling, per_split, inv_freq, attention_scaling,
                           positions, visible, row_first)
    assert not arrivals.any(), "the merging block sets its counter back to zero"
    return out


def rope_of(codec: str, head_dim: int, batch: int):
    """(inv_freq, attention_scaling, positions) for a pre-RoPE codec, else None."""
    return (llama_inv_freq(head_dim), 0.9, POSITIONS[:batch]) if codec in ROPE or codec in GROUPS else None


def max_error(codec, head_dim, gqa, batch, lib, fifo_offset=0, per_split=PER_SPLIT) -> float:
    lengths = LENGTHS[batch]
    keys, values = filled(codec, lengths, head_dim, fifo_offset=fifo_offset)
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(1))
    scaling = head_dim**-0.5
    rope = rope_of(codec, head_dim, len(lengths))
    got = run_emulated(lib, variant_of(codec, head_dim, gqa), query, keys, values, lengths, scaling, per_split, rope=rope)
    want = reference(query, keys, values, lengths, scaling, rope)
    # a non-finite output is wrong by any margin (NaN compares false either way)
    return (got.double() - want).abs().nan_to_num(nan=math.inf).max().item()


# ------------------------------------------------------------------------------------------------ emulation

@pytest.mark.emulation
@pytest.mark.parametrize("codec,head_dim,gqa,batch", CASES)
def test_emulated_kernel_matches_softmax_attention_over_the_decoded_stores(emulator, codec, head_dim, gqa, batch):
    assert max_error(codec, head_dim, gqa, batch, emulator) < tolerance(codec)


@pytest.mark.emulation
@pytest.mark.parametrize("codec,head_dim,gqa", (("int2", 128, 4), ("int4-g32", 128, 4), ("int2-g32", 64, 4), ("int4-rope", 128, 4),
                                                ("nuq3-out-rope", 128, 4), ("nuq3-rope", 64, 2), ("nuq3-nuq4v-out-rope", 128, 4),
                                                ("int3-int4v", 128, 4), ("skvq2", 128, 4), ("int2", 256, 4),
                                                ("nuq3-out-rope", 256, 4)))
def test_emulated_kernel_reads_each_kv_heads_rows_together_as_rows_whole(emulator, codec, head_dim, gqa):
    """The same codes kept with each KV head's rows together (a KV head's piece of every row, then the next head's)
    give the same bits as kept with each row whole: the kernel reads a KV head's piece of a row by its strides."""
    lengths = LENGTHS["3"]
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(1))
    v, rope = variant_of(codec, head_dim, gqa), rope_of(codec, head_dim, len(lengths))
    outputs = []
    for together in (True, False):
        keys, values = filled(codec, lengths, head_dim, rows_together=together)
        assert keys.rows_together == values.rows_together == together
        outputs.append(run_emulated(emulator, v, query, keys, values, lengths, head_dim**-0.5, rope=rope))
    assert torch.equal(*outputs)


@pytest.mark.emulation
@pytest.mark.parametrize("codec,head_dim,gqa", (("nuq3-out-rope", 128, 4), ("int4-rope", 64, 4), ("nuq3-out-rope", 128, 6)))
@pytest.mark.parametrize("rotated_pairs", (16, 0))
def test_emulated_kernel_leaves_channels_of_zero_frequency_unrotated(emulator, codec, head_dim, gqa, rotated_pairs):
    """RoPE over the first pairs of each half only (kvcal.rope.rotate_half_order: partial_rotary_factor 0.5 at head_dim
    64, 0.25 at 128; the other frequencies zero) and over none (a NoPE layer): the kernel's rotation by a frequency of
    zero is the identity, as the reference's. Also at 6 query heads a KV head, as Laguna's full layers read (48 over
    8)."""
    lengths = LENGTHS["3"]
    keys, values = filled(codec, lengths, head_dim)
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(4))
    inv_freq = padded_inv_freq(llama_inv_freq(2 * rotated_pairs), head_dim)
    rope = (inv_freq, 0.9, POSITIONS[: len(lengths)])
    got = run_emulated(emulator, variant_of(codec, head_dim, gqa), query, keys, values, lengths, head_dim**-0.5, rope=rope)
    assert (got.double() - reference(query, keys, values, lengths, head_dim**-0.5, rope)).abs().max() < tolerance(codec)


@pytest.mark.emulation
def test_emulated_fp16_kernel_reads_rows_from_the_fifo_head(emulator):
    """Fp16Rows whose live rows start past row 0 (take_front / pop_front moved the head)."""
    assert max_error("fp16", 128, 4, "3", emulator, fifo_offset=5) < TOLERANCE


@pytest.mark.emulation
@pytest.mark.parametrize("codec", ("int4-rope", "nuq3-rope", "nuq3-out-rope", "int2", "int4-g32", "int2-g256"))
def test_emulated_kernel_stays_accurate_over_a_long_split(emulator, codec):
    """One split of all 4096 + 13 tokens (65 stages of 64, or 33 of 128: the pipelines' buffers wrap around many
    times, and a warp's own quarter of the split crosses key blocks, whose Q' it makes from the parameters the block's
    first stage copied; with outliers, a warp's ring of tile areas wraps around too), past position 100K for pre-RoPE
    keys: a warp's query angle advances 64 tokens at a time between exact anchors every 16 rotations
    (tc::rotate_query), so an error that grew with the steps would show here."""
    lengths = [4096 + 13]
    v = variant_of(codec, 128, 4)
    keys, values = filled(codec, lengths, 128)
    query = torch.randn(1, KV_HEADS * 4, 128, generator=torch.Generator().manual_seed(3))
    rope = (llama_inv_freq(128), 1.0, [100_003]) if codec in ROPE else None
    per_split = -(-lengths[0] // v.stage_tokens) * v.stage_tokens
    got = run_emulated(emulator, v, query, keys, values, lengths, 128**-0.5, per_split=per_split, rope=rope)
    assert (got.double() - reference(query, keys, values, lengths, 128**-0.5, rope)).abs().max() < tolerance(codec)


@pytest.mark.emulation
@pytest.mark.parametrize("codec,head_dim,gqa", (("fp16", 64, 1), ("nuq4-out-rope", 64, 3), ("int2", 128, 2), ("int2", 128, 8)))
def test_emulated_kernel_merges_many_splits_and_empty_ones(emulator, codec, head_dim, gqa):
    """Splits of one stage each: 40 of the longest sequence, whose merge takes several rounds of merge::UNROLL
    splits and a part-filled last one, 5 of a shorter one and only empty ones of the empty sequence (its output 0).
    The run's rows hold fewer float4 columns than the block has threads at head_dim 64 with GQA 1 (8 threads a
    column, each over every 8th split) and 3 (2 a column, 32 threads idle) and at 128 with GQA 2 (2 a column);
    GQA 8 at 128 gives each thread two columns."""
    v = variant_of(codec, head_dim, gqa)
    lengths = [40 * v.stage_tokens - 5, 0, 5 * v.stage_tokens]
    keys, values = filled(codec, lengths, head_dim)
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(4))
    rope = rope_of(codec, head_dim, len(lengths))
    got = run_emulated(emulator, v, query, keys, values, lengths, head_dim**-0.5, per_split=v.stage_tokens, rope=rope)
    assert got[1].abs().max() == 0
    assert (got.double() - reference(query, keys, values, lengths, head_dim**-0.5, rope)).abs().max() < tolerance(codec)


@pytest.mark.emulation
@pytest.mark.parametrize("codec,head_dim,gqa", (("nuq4-crowded-rope", 128, 4), ("nuq3-out-rope", 128, 4), ("nuq4-out-rope", 64, 3),
                                                ("int2", 128, 4), ("fp16", 128, 4), ("nuq3-rope", 128, 4), ("skvq2", 128, 4)))
def test_emulated_kernel_gives_the_same_bits_whatever_order_the_threads_run_in(emulator, codec, head_dim, gqa):
    """The GPU promises no order among a block's threads between two synchronization points, so no result may depend
    on it: the emulator's reversed schedule gives the same bits. Where it could: several outliers correcting one
    token's scores or one channel of a warp's output (crowded outliers meet in most tokens and channels), the block's
    shared passes (the rotated query, SKVQ's dequantized rows), the warp-private pipelines, the fused merge."""
    lengths = LENGTHS["3"]
    keys, values = filled(codec, lengths, head_dim)
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(1))
    v, rope = variant_of(codec, head_dim, gqa), rope_of(codec, head_dim, len(lengths))
    forward = run_emulated(emulator, v, query, keys, values, lengths, head_dim**-0.5, rope=rope)
    schedule_in_reverse(emulator, True)
    try:
        backward = run_emulated(emulator, v, query, keys, values, lengths, head_dim**-0.5, rope=rope)
    finally:
        schedule_in_reverse(emulator, False)
    assert torch.equal(forward, backward)


@pytest.mark.emulation
@pytest.mark.parametrize("codec", ("fp16", "int4", "int2-g256", "nuq3-out-rope"))
def test_emulated_kernel_gives_the_tokens_before_a_sliding_window_no_weight(emulator, codec):
    """Each sequence's first visible token (a sliding window): past two whole splits (which then count for nothing),
    inside a stage, and 0; pre-RoPE keys past position 100K."""
    lengths, visible = [700, 129, 64], [300, 70, 0]
    v = variant_of(codec, 128, 4)
    keys, values = filled(codec, lengths, 128)
    query = torch.randn(3, KV_HEADS * 4, 128, generator=torch.Generator().manual_seed(2))
    rope = rope_of(codec, 128, 3)
    got = run_emulated(emulator, v, query, keys, values, lengths, 128**-0.5, rope=rope, visible=visible)
    want = reference(query, keys, values, lengths, 128**-0.5, rope, visible)
    assert (got.double() - want).abs().max() < tolerance(codec)


@pytest.mark.emulation
@pytest.mark.parametrize("codec,gqa", (("fp16", 4), ("int4", 4), ("int2-g256", 4), ("nuq3-out-rope", 4), ("int2", 8)))
def test_emulated_kernel_gives_each_query_row_the_tokens_from_its_own_first_one(emulator, codec, gqa):
    """A first token per query row (a step's queries as more query heads under a sliding window): rows of one KV
    head whose first tokens lie in different splits, inside a stage, one past a split that holds its sequence's first
    (that split counts nothing for it, the next ones do), and one past the sequence's last token (zeros)."""
    lengths, visible = [700, 129, 64], [250, 70, 0]
    v = variant_of(codec, 128, gqa)
    keys, values = filled(codec, lengths, 128)
    query = torch.randn(3, KV_HEADS * gqa, 128, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([[250, 300, 380, 699], [70, 71, 128, 129], [0, 5, 63, 64]])
    row_first = torch.cat([rows, rows.flip(1)], 1).repeat_interleave(gqa // 4, 1)  # both KV heads', in other orders
    rope = rope_of(codec, 128, 3)
    got = run_emulated(emulator, v, query, keys, values, lengths, 128**-0.5, rope=rope, visible=visible,
                       row_first=row_first)
    want = reference(query, keys, values, lengths, 128**-0.5, rope, row_first=row_first)
    assert (got.double() - want).abs().nan_to_num(nan=math.inf).max() < tolerance(codec)
    past = row_first >= torch.tensor(lengths)[:, None]
    assert past.any() and (got[past] == 0).all()


def test_codecs_the_kernel_does_not_serve_are_refused_not_misread():
    """Per-token key thresholds, outliers stored per KV head of another head_dim, pre-RoPE fp16 rows and pre-RoPE
    uniform keys at head_dim 256 each get a KvcalError from the launcher's variant_for."""
    from kvcal.errors import KvcalError

    keys, values = nuq_codecs(4, KV_HEADS * 128)
    cases = [(CodebookCodec(keys.codebook), values, 128, 128),
             (keys, CodebookCodec(values.codebook, outlier_fraction=0.01), 128, 64)]
    for kc, vc, d, store_head_dim in cases:
        stores = [PackedRows(c, 1, KV_HEADS * d, "cpu", head_dim=store_head_dim) for c in (kc, vc)]
        with pytest.raises(KvcalError):
            tensor_core.variant_for(*stores, d, 4)
    with pytest.raises(KvcalError):
        tensor_core.variant_for(*filled("fp16", [3], 128), 128, 4, rope=True)
    with pytest.raises(KvcalError, match="head_dim 256"):  # pre-RoPE uniform keys at 256: no recipe stores them
        tensor_core.variant_for(*filled("int4", [3], 256), 256, 4, rope=True)


def test_channel_groups_the_kernel_does_not_serve_are_refused_not_misread():
    """SKVQ bodies whose KV head's channels fall in more than GROUP_SLOTS groups, ternary codes, fp16 keys' parameters
    beside fp8 values', or post-RoPE keys get a KvcalError from variant_for."""
    from helpers.kernel_cases import equal_skvq_groups
    from kvcal.errors import KvcalError

    def skvq(bits, groups=4, fp8=False):
        return equal_skvq_groups(KV_HEADS * 128, groups, bits, fp8, seed=groups)

    cases = [((skvq(2, 40), skvq(2)), True, "at most 16"), ((skvq(2), skvq(1.5)), True, "1.5-bit"), ((skvq(2), skvq(2, fp8=True)), True, "fp16 or fp8"),
             ((skvq(2), skvq(2)), False, "pre-RoPE")]
    for codecs, rope, message in cases:
        stores = [PackedRows(c, 1, KV_HEADS * 128, "cpu") for c in codecs]
        with pytest.raises(KvcalError, match=message):
            tensor_core.variant_for(*stores, 128, 4, rope=rope)


@pytest.mark.emulation
def test_a_sequence_without_tokens_gets_zeros_and_empty_splits_do_not_count(emulator):
    v = variant_of("int4", 128, 4)
    lengths = [0, v.stage_tokens + 1, 0]  # the middle sequence's second split holds one token
    keys, values = filled("int4", lengths, 128)
    query = torch.randn(3, KV_HEADS * 4, 128)
    got = run_emulated(emulator, v, query, keys, values, lengths, 0.1, per_split=v.stage_tokens)
    assert (got[0] == 0).all() and (got[2] == 0).all()
    assert (got[1].double() - reference(query, keys, values, lengths, 0.1)[1]).abs().max() < TOLERANCE


@pytest.mark.emulation
def test_the_launcher_asks_for_the_shared_memory_the_kernel_uses(emulator):
    for v in EMULATED:
        assert getattr(emulator, f"smem_{symbol(v)}")() == v.shared_bytes(), v


def test_every_variant_fits_a_block_of_an_a100():
    assert max(v.shared_bytes() for v in tensor_core.variants()) <= tensor_core.A100_SHARED_BYTES


def test_a_quarter_warps_rope_table_loads_fall_in_distinct_banks():
    """tc::rope_pair_word: a 16-byte load of lanes g, t reads row delta = 8 n + g; the 8 lanes a quarter-warp's load
    serves (g = 2i, 2i + 1; t = 0..3) must cover all 32 banks once (rope_row_start's padding after each odd row)."""
    for head_dim in tensor_core.HEAD_DIMS:
        for quad in range(head_dim // 32):  # a lane's 16-byte quads of two frequency pairs
            for first_row in range(0, tensor_core.STAGE_TOKENS, 2):
                starts = [tensor_core.rope_row_start(first_row + g, head_dim) + (quad * 4 + t) * 4 for g in (0, 1) for t in range(4)]
                banks = sorted(start % 32 + w for start in starts for w in range(4))
                assert banks == list(range(32)), (head_dim, quad, first_row)


def test_pre_rope_codebooks_at_256_run_two_blocks_on_an_sm_90():
    """Gemma 3's head_dim and default bundle's keys: at up to 4 query heads per KV head (every Gemma 3 size), two
    blocks (8 warps) share an SM of an H100 / H200 (228 KB, 1 KB reserved per block), not one block of 4 warps."""
    served = [v for v in tensor_core.variants() if v.head_dim == 256 and v.rope and v.codebook and v.gqa <= 4]
    assert served and all(2 * (v.shared_bytes() + 1024) <= 228 * 1024 for v in served)


def test_post_rope_codes_at_256_run_two_blocks_on_an_sm_90_but_the_wide_int4_ones():
    """Gemma 3's head_dim with KIVI's and KVmix's caches: every private pipeline's block leaves room for a second one
    on an SM of an H100 / H200 (int4 in key blocks of 128 in 5 stages, not 6; KVmix's int3 / int4 in key blocks of 32
    without a shared table of 3-bit code values), but for the wide int4 ones, which two blocks would leave one stage
    in flight a warp."""
    served = [v for v in tensor_core.variants() if v.head_dim == 256 and v.private]
    alone = {(v.bits, v.vbits, v.key_group) for v in served if 2 * (v.shared_bytes() + 1024) > 228 * 1024}
    assert alone == {(4, 4, 32), (4, 4, 64)}
    assert all(v.stages >= 3 for v in served)
    assert Variant(256, 4, 128, 128, 4).stages == 5


def test_split_plans_cover_the_longest_sequence_in_whole_stages():
    for stage in (tensor_core.STAGE_TOKENS, tensor_core.WIDE_STAGE_TOKENS):
        for lengths, pairs, slots in (([32768] * 8, 64, 264), ([0, 5, 70000], 24, 396), ([1], 1, 132), ([], 8, 100)):
            per_split, splits = tensor_core.split_plan(lengths, pairs, slots, stage)
            assert per_split % stage == 0 and per_split * splits >= max(lengths, default=0)
            assert per_split * (splits - 1) < max(lengths, default=1)
    # one wave: 64 (sequence, KV head) pairs on 528 resident blocks (4 per SM of an H100) or 396 (3 per SM)
    assert tensor_core.split_plan([32768] * 8, 64, 528, 64) == (4096, 8)
    assert tensor_core.split_plan([32768] * 8, 64, 396, 64) == (5504, 6)
    assert tensor_core.split_plan([32768] * 8, 64, 396, 128) == (5504, 6)
    assert tensor_core.split_plan([32768] * 8, 64, 264, 128) == (8192, 4)
    assert tensor_core.split_plan([32768] * 300, 2400, 528, 64) == (32768, 1)  # more pairs than a wave holds: no split


# a planted bug in each operand mapping, in the kernel or a header it includes: the comparison must catch it (on batch
# "1" at head_dim 128 in splits of PER_SPLIT tokens; optional fourth to sixth fields: another batch, head_dim, split)
MUTANTS = {
    "fp16-value-channels": ("fp16", "return 16 * mt + 8 * r + g;", "return 16 * mt + 8 * r + (g ^ 1);"),
    "quantized-key-pairs": ("int4", "p % HALF + e * HALF;", "p % HALF + (1 - e) * HALF;"),
    "value-scale-per-token": ("int2", "vp + group * ST + token)));", "vp + group * ST + (token ^ 2))));"),
    "int2-g32-value-byte": ("int2-g32", "byte | (4 + byte) << 8", "(byte ^ 1) | (4 + (byte ^ 1)) << 8"),
    "int2-g32-value-token-pair": ("int2-g32", "byte | (4 + byte) << 8", "(4 + byte) | byte << 8"),
    "value-zero-per-token": ("int4", "vp + (S::VGROUPS + group) * ST + token);", "vp + (S::VGROUPS + group) * ST + (token ^ 2));"),
    # raw key codes (1024 + code * 2^s): Q' takes 2^-s, the bias -1024 sum Q'
    "raw-key-shift": ("int2", "raw_shift<BITS>(p % (16 / BITS)) : 0;", "raw_shift<BITS>((p + 1) % (16 / BITS)) : 0;"),
    "raw-key-offset": ("int4", "if constexpr (KEY_RAW) tokens_in_m_steps(bacc, bacc2, minus_1024, minus_1024, qk);", ""),
    # raw value codes: fp16 subnormals, code * 2^(s - 24) (no offset), 2^(24 - s) per output row at the end
    "raw-value-offset": ("int2", "VALUE_BASE = magic::FP16_SUBNORMAL;", "VALUE_BASE = magic::FP16_1024;"),
    "raw-value-shift": ("int4", "raw_shift<VBITS>(n % PER_WORD)", "raw_shift<VBITS>((n + 1) % PER_WORD)"),
    # key blocks shorter than a stage: the unscaled query the warp holds for their Q'
    "held-query-pairs": ("int2-g32", "q_held[HOLD_QUERY ? p : 0]", "q_held[HOLD_QUERY ? p ^ 1 : 0]"),
    "rope-key-rotation-sign": ("int4-rope", "hfma2_bits(x, cos, hneg2_bits(hmul2(y, sin)));", "hfma2_bits(x, cos, hmul2(y, sin));"),
    "rope-table-row": ("int4-rope", "return rope_row_start<D>(delta) + ((q >> 1) * 4 + t)", "return rope_row_start<D>(delta) + ((q >> 1) * 4 + (t ^ 1))"),
    "rope-query-rotation-sign": ("int2-rope", "qb[e] = b * cs[2 * e] - a * cs[2 * e + 1];", "qb[e] = b * cs[2 * e] + a * cs[2 * e + 1];"),
    "nuq-value-nibbles": ("nuq4", "lop3<magic::SELECT>(wa[i] >> VBITS, wb[i], LOW)", "lop3<magic::SELECT>(wa[i], wb[i] >> VBITS, LOW)"),
    "nuq-key-pairs": ("nuq4-rope", "return CB || BITS == 3 ? 2 * p + e :", "return CB || BITS == 3 ? 2 * p + 1 - e :"),
    "nuq-value-zero": ("nuq4", "(hi + lo) * 0.5f}", "(hi - lo) * 0.5f}"),
    "nuq3-high-plane-half": ("nuq3-rope", "half ? 0x4342u : 0x4140u", "half ? 0x4140u : 0x4342u"),
    "nuq3-value-token-pairs": ("nuq3", "table_pairs(table, x.odd, y.odd, odd)", "table_pairs(table, x.odd, x.odd, odd)"),
    # two rows' quarter units in one word of indices (values at head_dim 64)
    "nuq3-value-rows-merged": ("nuq3", "table_pairs(table, x.even, x.even >> 16, even)", "table_pairs(table, x.even, x.even, even)", "1", 64),
    # outliers: ~1% of the elements, each a small correction: the three-sequence batch shows them
    "outlier-extreme-code": ("nuq4-out-rope", "(x > e.x ? e.z : e.y)", "(x > e.x ? e.y : e.z)", "3"),
    "outlier-key-rotation-half": ("nuq3-out-rope", "c < D / 2 ? cos : -sin", "c < D / 2 ? cos : sin", "3"),
    "outlier-key-zero": ("nuq4-out-rope", "(x > e.x ? e.z : e.y) - e.w;", "(x > e.x ? e.z : e.y);", "3"),
    "outlier-value-token": ("nuq3-out-rope", "tile_p[head * OUT_TILE + token]", "tile_p[head * OUT_TILE + (token ^ 1)]", "3"),
    "nuq3-quarter-low-bits": ("nuq3-rope", "2u * (first & 15)", "2u * (~first & 8)",
                              "1", 64),
    "nuq3-quarter-high-byte": ("nuq3", "0x4440u + (first >> 3 & 3)", "0x4440u + ((first >> 3 & 3) ^ 1)", "1", 64),
    "outlier-value-warp": ("nuq4-out-rope", "value_corrections + warp * D * GQA;\n#pragma unroll 1", "value_corrections + (warp ^ 1) * D * GQA;\n#pragma unroll 1", "3"),
    # each slice's run of the tile's value outliers, and the turns of a channel's outliers within it
    "outlier-value-runs": ("nuq4-out-rope", "? 0 : slice_of(i - 1) + 1,", "? 0 : slice_of(i - 1),", "3"),
    "outlier-value-turns": ("nuq4-crowded-rope", "if (mine && turn == r)", "if (mine)", "3"),
    # the outliers' scratch holds the launch's GQA heads: M's padding rows (g >= GQA) must not touch it (the other two
    # such writes, unguarded, run past the emulated shared memory)
    "outlier-score-padding-rows": ("nuq3-out-rope", "if (OUT && g < GQA) {  // the stage's key outliers", "if (OUT) {  // the stage's key outliers", "3"),
    "outlier-value-head": ("nuq4-out-rope", "tile_p[head * OUT_TILE + token]", "tile_p[(head ^ 1) * OUT_TILE + token]", "3"),
    "outlier-value-rescale": ("nuq3-out-rope", "return x * scale[e];", "return x;", "1", 128, 768),
    # a 2-bit table's fields: a pair's second code, the upper half-word's fields; a 3-bit table's bytes (table_pairs)
    "nuq2-table-second-code": ("nuq2", "second = x >> 2 & 0x33333333u", "second = x >> 1 & 0x33333333u"),
    "nuq2-table-upper-fields": ("nuq2", "table_pairs(table, first >> 16, second >> 16, out + 4)", "table_pairs(table, first, second, out + 4)"),
    "nuq3-table-high-byte": ("nuq3", "out[2 * k + 1] = prmt(lo, hi, 0x7362u);", "out[2 * k + 1] = prmt(lo, hi, 0x7632u);"),
    # a 3-bit table's planes from the side's entries (pre-RoPE at 64 / 128), an odd code's high bit in its index
    "nuq3-table-plane-entry": ("nuq3-out-rope", "__ldg(entries + x)", "__ldg(entries + (x ^ 1))", "3"),
    "nuq3-odd-index-high-bit": ("nuq3-rope", "lop3<magic::SELECT>(low >> 2, high, 0x33333333u)", "lop3<magic::SELECT>(low >> 2, high >> 2, 0x33333333u)"),
    # a 4-bit table's planes: an index's half (bit 3), the entries of the second half's planes
    "nuq4-table-half": ("nuq4", "lop3<magic::AND_OR>(s >> 1, 0x4444u, 0x3210u)", "lop3<magic::AND_OR>(s >> 2, 0x4444u, 0x3210u)"),
    "nuq4-table-plane-entry": ("nuq4-out-rope", "__ldg(entries + x)", "__ldg(entries + (x & 7))", "3"),
    # outliers: a side's last codebook entry by its width (nuq3 keys, nuq4 values)
    "outlier-last-entry": ("nuq3-nuq4v-out-rope", "entry(CODEBOOK_WORDS + (1 << VBITS) - 1)", "entry(CODEBOOK_WORDS + (1 << BITS) - 1)", "3"),
    "outlier-key-score-token": ("nuq3-out-rope", "score_corrections + head * OUT_TILE + token,", "score_corrections + head * OUT_TILE + (token ^ 1),", "3"),
    "outlier-first-round": ("nuq3-out-rope", "if (from + member < to) patch(", "if (from + member < from) patch(", "3"),
    # head_dim 256: a whole planes3 unit's second half, a key block's parameters in two rounds of a warp's lanes
    "nuq3-unit-second-half": ("nuq3", "at.high, 0u, 0x4342u}", "at.high, 0u, 0x4140u}", "1", 256),
    "key-block-second-round": ("int4", "i < (PCOPIES + CREW - 1) / CREW; ++i", "i < 1; ++i", "1", 256),
    # head_dim 256, pre-RoPE keys: the key pairs' table, the query fragments from shared memory, the rotation's parts
    "key-pair-table-part": ("nuq4-rope", "key_pairs[PAIRS * 4 + key_pair_word(p, part)] =",
                            "key_pairs[PAIRS * 4 + key_pair_word(p, part ^ 1)] =", "1", 256),
    "key-pair-table-zero": ("nuq3-rope", "key_pairs[PAIRS * 4 + key_pair_word(p, part)] = (unsigned)__ldg(key_zero + c0)",
                            "key_pairs[PAIRS * 4 + key_pair_word(p, part)] = (unsigned)__ldg(key_zero + c1)", "1", 256),
    "shared-query-fragment": ("nuq4-rope", "load_words(a[h][j], q_frag + step_pair * 128);", "load_words(a[h][j], q_frag + (step_pair ^ 1) * 128);", "1", 256),
    "rope-part-quarter": ("nuq3-rope", "planes3_place<2 * CP>(t * (D / 8) + c * 2 * CP)", "planes3_place<2 * CP>(t * (D / 8))", "1", 256),
    # keys and values of two widths: each side's rows by its own width
    "int3-key-pairs": ("int3-int4v", "return CB || BITS == 3 ? 2 * p + e :", "return CB ? 2 * p + e :", "3"),
    "int3-key-raw": ("int3-int2v", "KEY_RAW = RAW && BITS != 3,", "KEY_RAW = RAW,", "3"),
    # uniform 3-bit values: code values from their table, a group's units past the first's, an eighth's high bits
    "int3-value-raw": ("int4-int3v", "VALUE_RAW = RAW && VBITS != 3;", "VALUE_RAW = RAW;", "3"),
    "int3-value-group-units": ("int3-g32", "places[1].low + group * GROUP_WORDS,", "places[1].low,", "3"),
    "int3-value-eighth-high-bits": ("int3-g32", "lop3<magic::SELECT>(ha >> s, hb >> s << 4, 0xFFFFFF0Fu)", "lop3<magic::SELECT>(ha, hb << 4, 0xFFFFFF0Fu)", "3"),
    # uniform 3-bit codes' constant table: its high plane, a key pair's second code, a value half's second pair
    "int3-table-high-plane": ("int3-g32", "UNIFORM3_HIGH_4_7 = 0x47464544u", "UNIFORM3_HIGH_4_7 = 0x47464445u", "3"),
    "int3-table-pair-byte": ("int3-int4v", "(4u + i) << 12 | (8u + i) << 8", "(4u + (i ^ 1)) << 12 | (8u + i) << 8", "3"),
    "int3-table-halves-second": ("int3-g32", "prmt(hi, 0u, 0x3919u)", "prmt(hi, 0u, 0x3909u)", "3"),
    # SKVQ's channel groups: each channel of a 3-bit pair its own high bit, a code pair's second row, the rows' words
    # from the pairs along them, an fp8 parameter word's second pair of rows
    "skvq3-pair-high-bits": ("skvq3", "lop3<magic::AND_OR>(top << 1, 0x00040004u", "lop3<magic::AND_OR>(top << 2, 0x00040004u", "3"),
    "skvq-code-second-row": ("skvq2", "rows + (r + 1) * row_bytes", "rows + r * row_bytes", "3"),
    "skvq-row-words": ("skvq4", "k + 1, c) = prmt(along_c, along_c1, 0x7632u);", "k + 1, c) = prmt(along_c, along_c1, 0x3276u);", "3"),
    "skvq-fp8-parameter-rows": ("skvq2-fp8", "e4m3_pair_by_half(word >> 16)", "e4m3_pair_by_half(word)", "3"),
    "value-row-width": ("int4-int2v", "kvh * v_head;", "kvh * k_head;", "3"),
    # 16 tokens in M and the query heads in N: the k-step's second eight tokens, P's transpose, the merged heads
    "tokens-in-m-second-rows": ("int4", "key_row_pairs(k1, buffer + (tb + 16 * kt + 8 + g) * S::KSROW);",
                                "key_row_pairs(k1, buffer + (tb + 16 * kt + g) * S::KSROW);"),
    "tokens-in-m-p-transpose": ("int2", "if constexpr (TOKENS_IN_M) pw[half] = movmatrix_trans(pw[half]);", ""),
    "tokens-in-m-merged-heads": ("int2-g32", "const int head = TOKENS_IN_M ? 2 * t + h : g;", "const int head = TOKENS_IN_M ? 2 * t + (h ^ 1) : g;"),
    # a warp-private pipeline: each warp's own quarter of the split, the key parameters of each block it enters (one
    # split of 700 tokens: quarters of 256, two key blocks of 128 each)
    "private-warp-quarter": ("int4", "hi = S::PRIVATE ? min(end, lo + quarter) : end", "hi = S::PRIVATE ? min(end, lo + quarter / 2) : end"),
    "private-key-block-copies": ("int2", "tile == 0 || t0 % S::KB == 0", "tile == 0 || t0 % S::KB == 1", "1", 128, 768),
    # pre-RoPE keys in a private pipeline: a token's offset from the warp's rotated query, the step between rotations
    # (768 tokens: quarters of 192, three rotations a warp), codebook values' parameters from the warp's own tokens
    "private-rope-offset": ("nuq3-rope", "(S::PRIVATE ? tile % S::ROTATE_EVERY * ST : 0) + tb + g, t, 0)", "tb + g, t, 0)"),
    "private-rope-step": ("int4-rope", "exact_cos_sin(S::BLOCK_ST,", "exact_cos_sin(ST,", "1", 128, 768),
    "private-value-parameters": ("nuq4-rope", "v_first + lo + member % ST;", "v_first + start + member % ST;"),
    # outliers in a private pipeline: a warp's quarter of whole tiles, its own ring of tile areas (768 tokens: quarters
    # of 192, three tiles a warp), the slice of its tile a stage is, the tokens of the stage's own buffer
    "private-outlier-quarter": ("nuq3-out-rope", "QUARTER_UNIT = OUT ? OUT_TILE : ST;", "QUARTER_UNIT = ST;", "1", 128, 768),
    "private-outlier-ring": ("nuq4-out-rope", "(S::PRIVATE ? warp * S::OUT_AREAS : 0) + n % S::OUT_AREAS", "n % S::OUT_AREAS", "1", 128, 768),
    "private-outlier-slice": ("nuq3-out-rope", "const int slice = S::PRIVATE ? tile % S::TILE_STAGES : warp;",
                              "const int slice = S::PRIVATE ? 0 : warp;", "3"),
    "private-outlier-stage-token": ("nuq4-out-rope", "stage_token = S::PRIVATE ? slice * TPW : 0;", "stage_token = 0;", "3"),
    "value-stage-rows": ("int2-int4v", "copy_rows<ST, S::VROW, S::VSROW, S::FP16, CREW>", "copy_rows<ST, S::KROW, S::VSROW, S::FP16, CREW>", "3"),
    # 2-bit codebooks: a value field's two tokens, half-word reads of a lane's values (64) and keys' parts (256)
    "nuq2-value-fields": ("nuq2", "0x0F0F0F0Fu : 0x33333333u", "0x0F0F0F0Fu : 0x0F0F0F0Fu", "1", 64),
    "nuq2-value-half-word": ("nuq2", "wb[0] = *reinterpret_cast<const unsigned short*>(r0 + S::VSROW + (bit0 >> 3));",
                             "wb[0] = *reinterpret_cast<const unsigned short*>(r0 + (bit0 >> 3));", "1", 64),
    "nuq2-key-part": ("nuq2-out-rope", "row + S::KROW / 2 + c * 2);", "row + S::KROW / 2);", "3", 256),
    "two-stage-value-parameters": ("nuq4-out-rope", "if (ahead < tiles) store_value_params(ahead, pending);", "", "3", 256),
    "rope-shared-frequency": ("nuq3-out-rope", "const RopeTask frequency = rope_task<D>(member);", "const RopeTask frequency = rope_task<D>(member ^ 1);", "3", 256),
    # the fused merge (6 splits; GQA 2 at 128: two threads a column): the second part's sums, the weight of a slot
    # past the last split
    "merge-second-part": ("int2", "for (int p = 0; p < C::PARTS - 1; ++p)", "for (int p = 0; p < C::PARTS - 2; ++p)", "3"),
    "merge-past-last-split": ("int4", "weight[u] = split < splits ? lse[split] : none;", "weight[u] = split < splits ? lse[split] : 0.0f;", "3"),
}


@pytest.mark.emulation
@pytest.mark.parametrize("name", MUTANTS)
def test_the_comparison_catches_a_planted_mapping_bug(tmp_path, name):
    codec, old, new, *other = MUTANTS[name]
    batch, head_dim, per_split = (*other, *("1", 128, PER_SPLIT)[len(other):])
    # the mutated copy sits beside the kernel's, whose includes find it first
    holders = [path for path in sorted(kernel_source.KERNEL_DIR.glob("*.cu*")) if old in path.read_text()]
    assert len(holders) == 1 and holders[0].read_text().count(old) == 1, old
    (tmp_path / tensor_core.MODULE).write_text(KERNEL.read_text())
    (tmp_path / holders[0].name).write_text(holders[0].read_text().replace(old, new))
    v = variant_of(codec, head_dim, 2)
    lib = build([v], kernel_dir=tmp_path)
    assert max_error(codec, head_dim, 2, batch, lib, per_split=per_split) > 10 * tolerance(codec)


# ------------------------------------------------------------------------------------------------ NVRTC

# every (head_dim, codec, groups) the launcher serves at GQA 4 and 8 (the most registers: int4 g32 is at its limit
# there), and GQA 1 of the one-width KIVI-g128, codebook and fp16 cases (all of them take minutes to compile; GQA
# changes only the query load, the segment blocks' head loop and the final merge); SKVQ's channel groups (16 pairs of
# widths) at GQA 8, and 4 at head_dim 256, where they are within a few registers of the 255 they may take
def compiled_in_the_test(v: Variant) -> bool:
    if v.channel_groups:
        return v.gqa == 8 or (v.gqa == 4 and v.head_dim == 256)
    return v.gqa in (4, 8) or (v.gqa == 1 and v.key_group in (0, 128) and not v.value_bits)


COMPILED = sorted(filter(compiled_in_the_test, tensor_core.variants()), key=lambda v: v.name)


def nvrtc_report(arch: str):
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc-cu12) is not installed")
    names = [v.name for v in COMPILED]
    compiled = kernel_source.nvrtc_compile(KERNEL.read_text(), KERNEL.name, arch, names)
    by_mangled = {mangled: name for name, mangled in compiled.lowered.items()}
    return {by_mangled.get(f.name, f.name): f for f in compiled.functions}


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", kernel_source.ARCHITECTURES)
def test_every_variant_compiles_with_nvrtc_without_spills(arch):
    report = nvrtc_report(arch)
    assert len(report) == len(COMPILED)
    spilled = {name: (f.spill_bytes, f.stack_bytes) for name, f in report.items() if f.spill_bytes or f.stack_bytes}
    assert spilled == {}
    print({name: f.registers for name, f in report.items()})


# ------------------------------------------------------------------------------------------------ GPU

# on the GPU: the emulated cases of GQA 1 / 4 / 6 / 8 (each variant is compiled there), and long ragged batches
GPU_CASES = ([c for c in CASES if c[3] != "1" and c[2] in (1, 4, 6, 8)]
             + [(c, 128, 4, "long") for c in ("int4", "fp16", "int4-g32", "int4-rope", "nuq4", "nuq4-rope")] + [("int2", 128, 8, "long")])


@requires_gpu
@pytest.mark.parametrize("codec,head_dim,gqa,batch", GPU_CASES)
def test_gpu_kernel_matches_softmax_attention_over_the_decoded_stores(codec, head_dim, gqa, batch):
    lengths = LENGTHS.get(batch, [4096 + 13, 0, 9000])
    keys, values = filled(codec, lengths, head_dim, device="cuda")
    query = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=torch.Generator().manual_seed(1)).cuda()
    scaling = head_dim**-0.5
    rope = rope_of(codec, head_dim, len(lengths))
    inv_freq, attention_scaling, positions = rope if rope is not None else (None, 1.0, None)
    for per_split in (PER_SPLIT, None):  # the tests' splits, and the launcher's own plan
        got = tensor_core.decode_attention_tc(query, keys, values, KV_HEADS, scaling, lengths, per_split, inv_freq, attention_scaling,
                                              positions)
        torch.cuda.synchronize()
        want = reference(query.cpu(), keys, values, lengths, scaling, rope)
        assert (got.cpu().double() - want).abs().max().item() < tolerance(codec)


@requires_gpu
@pytest.mark.parametrize("codec", ("nuq4-crowded-rope", "nuq3-out-rope"))
def test_gpu_outlier_variants_give_the_same_bits_on_every_launch(codec):
    """Outliers meet in one token's scores and one channel of a warp's output: the launches, whose threads the GPU
    schedules as it likes, return the same bits (the emulator's reversed schedule checks the same on the CPU)."""
    lengths = [4096 + 13, 0, 9000]
    keys, values = filled(codec, lengths, 128, device="cuda")
    query = torch.randn(len(lengths), KV_HEADS * 4, 128, generator=torch.Generator().manual_seed(1)).cuda()
    inv_freq, attention_scaling, positions = rope_of(codec, 128, len(lengths))
    runs = [tensor_core.decode_attention_tc(query, keys, values, KV_HEADS, 128**-0.5, lengths, None, inv_freq, attention_scaling,
                                            positions).cpu() for _ in range(5)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])
