"""Packed K/V stores of every codec the kernels serve, filled with seeded data, and the checks that the
GPU suite (tests/test_runtime_kernels.py), the CPU emulation (tests/test_kernel_emulation.py) and the CPU kernel's
tests share: a decode against the torch reference on the same packed data, and the append kernels against the
torch encoders."""

import functools

import torch

from kvcal.kv import SegmentPolicy
from kvcal.packing import OUTLIER_TILE_TOKENS
from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook
from kvcal.runtime import cpu_kernel, kernels, reference, tensor_core
from kvcal.runtime.segments import CocktailStore, SegmentedStore
from kvcal.runtime.store import PackedRows

HEAD_DIM, KV_HEADS = 128, 8
WIDTH = HEAD_DIM * KV_HEADS
G, R, WINDOW = 32, 128, 64  # quantization group, KIVI residual, fp16 window
LENGTHS = (0, 1, G - 1, G, G + 1, R - 1, R, R + 1, WINDOW - 7, 4096 + 13)
BATCHES = {"17": [LENGTHS[i % len(LENGTHS)] + 3 * (i // len(LENGTHS)) for i in range(17)], "3": [R + 1, 0, G], "1": [4096 + 13]}
CHANNEL_SCALES = torch.linspace(0.2, 3.0, WIDTH)


def seeded_tokens(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)) * CHANNEL_SCALES).half()


def _thresholds(tail: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel thresholds that leave `tail` of each side outside: 0.3 crowds every tile with outliers."""
    bounds = torch.quantile(seeded_tokens(2048, 99).float(), torch.tensor([tail, 1 - tail]), dim=0)
    return bounds[0], bounds[1]


def _uniform(k_bits, v_bits, sink=0, residual=R, rpc=0.0, layout=None):
    policy = SegmentPolicy(sink=sink, residual=residual, key_block=G)
    return ChannelBlockUniform(k_bits, G), TokenUniform(v_bits, G), policy, rpc, False, layout


def _codebook(k_bits, v_bits, sink=0, window=WINDOW, tail=0.0005, pre_rope=True, per_token_keys=False):
    lo, hi = (None, None) if per_token_keys else _thresholds(tail)
    keys = CodebookCodec(normal_float_codebook(k_bits), lo, hi, outlier_fraction=0.01)
    values = CodebookCodec(normal_float_codebook(v_bits), None, None, outlier_fraction=0.01)
    return keys, values, SegmentPolicy(sink=sink, window=window), 0.0, pre_rope, None


# the cases the tensor-core kernel serves (KIVI int2 / int4 g32, KVmix's int3 keys with int2 values and RPC tokens,
# nuq2 / nuq3 / nuq4 with outliers, pre- and post-RoPE keys, SKVQ's channel groups); on CUDA the others (1-bit and
# per-token uniform keys, per-token codebook key thresholds, KVmix's 10x3+1x2 words) decode on the torch reference
SERVED_CASES = ("kivi2", "kivi4-sink4", "kvmix-k3-v2-rpc", "nuq3-prerope-sink4-window", "nuq4-prerope-crowded-outliers",
                "nuq2-postrope-mostly-empty-outlier-tiles", "skvq2-prerope-sink5-window", "skvq3-planes", "skvq4",
                "skvq2-twelve-groups", "skvq3-fp8-parameters")
# its tolerance: test_tensor_core_decode's 4e-3 on N(0, 1) rows (fp16 operands) times the largest channel scale (3)
SERVED_TOLERANCE = 1.2e-2

CASES = {
    "kivi2": lambda: _uniform(2, 2),
    "kivi4-sink4": lambda: _uniform(4, 4, sink=4),
    "kvmix-k3-v2-rpc": lambda: _uniform(3, 2, residual=0, rpc=0.1),
    "kvmix-k1-v4": lambda: _uniform(1, 4, residual=0),
    "kvmix-3bit-10x3+1x2-words": lambda: _uniform(3, 3, residual=0, layout="kvmix10x3+1x2"),
    "token-uniform-keys": lambda: (TokenUniform(2, G), TokenUniform(2, 128), SegmentPolicy(sink=4), 0.0, False, None),
    "nuq3-prerope-sink4-window": lambda: _codebook(3, 3, sink=4),
    "nuq3-prerope-sink4-window300": lambda: _codebook(3, 3, sink=4, window=300),
    "nuq4-prerope-crowded-outliers": lambda: _codebook(4, 4, window=0, tail=0.3),
    "nuq2-postrope-mostly-empty-outlier-tiles": lambda: _codebook(2, 2, tail=0.0, pre_rope=False),
    "nuq3-per-token-keys": lambda: _codebook(3, 2, sink=4, per_token_keys=True),
}


def _skvq(bits, layout=None, inner=(WIDTH // 4, WIDTH // 2 + 8), fp8=False):
    """SKVQ's permuted groups (kvcal.fit.skvq.SkvqTensor): a seeded permutation of every channel, groups of uneven
    sizes split at `inner` (three by default: one register of parameters on AVX2; TWELVE_GROUPS: two), keys pre-RoPE
    behind 5 fp16 sinks and a 64-token window (the CPU kernel serves these)."""
    from kvcal.fit.skvq import SkvqTensor

    def codec(seed):
        permutation = torch.randperm(WIDTH, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
        starts = torch.tensor([0, *inner, WIDTH], dtype=torch.int32)
        return SkvqTensor(permutation, starts, torch.linspace(1.0, 0.8, len(inner) + 1), bits, fp8)

    return codec(1), codec(2), SegmentPolicy(sink=5, window=WINDOW), 0.0, True, layout


TWELVE_GROUPS = tuple(i * WIDTH // 12 + 3 * (i % 2) for i in range(1, 12))

# SKVQ's cases: both kernels decode them, the append kernels write them
SKVQ_CASES = {
    "skvq2-prerope-sink5-window": lambda: _skvq(2),
    "skvq3-planes": lambda: _skvq(3),
    "skvq4": lambda: _skvq(4),
    "skvq2-twelve-groups": lambda: _skvq(2, inner=TWELVE_GROUPS),
    "skvq3-fp8-parameters": lambda: _skvq(3, fp8=True),
}
DECODE_CASES = {**CASES, **SKVQ_CASES}


def equal_skvq_groups(width: int, groups: int, bits: float, fp8: bool = False, seed: int = 0):
    """An SKVQ codec (kvcal.fit.skvq.SkvqTensor) of `groups` groups of (nearly) equal size over a seeded permutation of
    `width` channels: which groups a KV head's channels fall in is what the kernels' checks read."""
    from kvcal.fit.skvq import SkvqTensor

    starts = torch.tensor([i * width // groups for i in range(groups)] + [width], dtype=torch.int32)
    permutation = torch.randperm(width, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    return SkvqTensor(permutation, starts, torch.ones(groups), bits, fp8)


def filled(case: str, lengths: list[int], device="cuda", rows_together: bool = True):
    """K and V stores of `case` holding len(lengths) sequences: a prefill, then 3 decode appends. rows_together: the
    kernels' stores' layout (kvcal.runtime.kernels.AppendKernels)."""
    key_codec, value_codec, policy, rpc, pre_rope, layout = DECODE_CASES[case]()
    encoder_for = functools.partial(kernels.append_encoder, rows_together=rows_together)
    stores = [SegmentedStore(codec, policy, keys, rpc, len(lengths), WIDTH, device, layout, encoder_for, HEAD_DIM)
              for codec, keys in ((key_codec, True), (value_codec, False))]
    for b, n in enumerate(lengths):
        for store, seed in zip(stores, (2 * b, 2 * b + 1)):
            x = seeded_tokens(n, seed).to(device)
            if n > 3:
                store.append(b, x[: n - 3])
            for t in range(max(0, n - 3), n):
                store.append(b, x[t : t + 1])
    return stores, pre_rope


def _inv_freq() -> torch.Tensor:
    return 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


def served_decode(query, launches, kv_heads, scaling, offsets, inv_freq, rows: list | None = None):
    """kernels.decode_attention on the tensor-core kernel, as the cache runs it; rows collects the body rows its body
    blocks took per sequence."""
    served = [tensor_core.serve(segments, query.shape[1], kv_heads, query.shape[2], inv_freq) for segments in launches]
    if rows is not None:
        rows.extend(row for body in served for row in body.rows(query.shape[0]))
    return kernels.decode_attention(query, launches, kv_heads, scaling, offsets, served)


def cpu_kernel_decode(query, launches, kv_heads, scaling, offsets, inv_freq, softcap=None):
    """kvcal.runtime.cpu_kernel.decode_attention with kernels.decode_attention's arguments: RoPE tables at each
    sequence's positions offset .. offset + tokens - 1, as the cache's StepPlan.rope makes them."""
    rope = None
    if inv_freq is not None:
        tokens = max(sum(part.length[b] for part in segments.keys if part is not None)
                     for segments in launches for b in range(len(offsets)))
        positions = torch.arange(tokens)[None, :] + torch.tensor(offsets)[:, None]
        rope = cpu_kernel.half_rope_tables(*reference.rope_tables(positions, inv_freq, 1.0))
    return cpu_kernel.decode_attention(query, launches, kv_heads, scaling, rope, softcap=softcap)


def compare(key_store, value_store, batch: int, group: int, pre_rope: bool, device="cuda", seed: int = 0,
            decode=served_decode, atol: float = SERVED_TOLERANCE, rtol: float = 0.0, **softcap):
    """Kernel output (`decode`: the CUDA launcher, or cpu_kernel_decode) vs reference.attention on the same
    stores, one query token per sequence; the query is a non-contiguous view and positions start far from 0 (RoPE
    angles of tens of thousands). Stores that dropped their first tokens (a sliding window) start at the first kept.
    softcap=...: the scores soft-capped (cpu_kernel_decode only). Returns the kernel's output."""
    heads = KV_HEADS * group
    query = torch.randn(batch, HEAD_DIM, heads, generator=torch.Generator().manual_seed(seed)).to(device).transpose(1, 2)
    offsets = [(37_000 * b) % 100_003 for b in range(batch)]
    scaling, inv_freq = HEAD_DIM**-0.5, _inv_freq().to(device)
    launches = [kernels.Segments(k, v) for k, v in zip(key_store.kernel_segments(), value_store.kernel_segments())]
    got = decode(query, launches, KV_HEADS, scaling, [o + d for o, d in zip(offsets, key_store.dropped)], inv_freq if pre_rope else None,
                 **softcap)
    expected = torch.zeros_like(got)
    for b in range(batch):
        if key_store.count(b):
            keys = reference.stored_keys(key_store, b, pre_rope, offsets[b], inv_freq, 1.0, KV_HEADS)
            expected[b] = reference.attention(query[b][:, None], keys, value_store.read(b), scaling, **softcap)[:, 0]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    return got


def cocktail_stores(device="cuda"):
    """Cocktail K and V stores: chunks spread over fp16 | int4 | int2 by random widths, then one recent token."""
    codecs = {kind: {bits: ChannelBlockUniform(bits, G) if kind == "k" else TokenUniform(bits, G) for bits in (4, 2)} for kind in "kv"}
    lengths = [40 * G + 5, 3 * G, 7]
    stores = [CocktailStore(codecs[kind], G, len(lengths), WIDTH, device, kernels.append_encoder) for kind in "kv"]
    widths = torch.tensor([16, 4, 2])[torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(3))].tolist()
    for b, n in enumerate(lengths):
        for store, seed in zip(stores, (2 * b, 2 * b + 1)):
            store.append(b, seeded_tokens(n, seed).to(device))
            store.compress(b, widths[: n // G])
            store.append(b, seeded_tokens(1, 50 + seed).to(device))
    return stores, len(lengths)


APPEND_CODECS = {
    "token-uniform-2": lambda: TokenUniform(2, G),
    "token-uniform-3-group128": lambda: TokenUniform(3, 128),
    "channel-block-4": lambda: ChannelBlockUniform(4, G),
    "channel-block-1": lambda: ChannelBlockUniform(1, G),
    "channel-block-3-10x3+1x2-words": lambda: ChannelBlockUniform(3, G),
    "token-uniform-3-10x3+1x2-words": lambda: TokenUniform(3, G),
    "codebook-channel-3": lambda: _codebook(3, 3)[0],
    "codebook-channel-4-crowded": lambda: _codebook(4, 4, tail=0.3)[0],
    "codebook-token-3": lambda: _codebook(3, 3)[1],
    # a tenth of each row's elements below and above its thresholds: more order statistics than the CPU append keeps
    # as a row streams by, so it selects them (append_cpu.cpp's RowQuantiles)
    "codebook-token-4-fifth-outliers": lambda: CodebookCodec(normal_float_codebook(4), None, None, outlier_fraction=0.2),
    "skvq2": lambda: _skvq(2)[0], "skvq3": lambda: _skvq(3)[0], "skvq4": lambda: _skvq(4)[1],
    # a group of one channel: its zero-range groups take the scale floor of clipped_params
    "skvq2-one-channel-group": lambda: _skvq(2, inner=(1, WIDTH // 2))[0],
    "skvq3-fp8": lambda: _skvq(3, fp8=True)[0],
    # rows from 2^-22 to 2^12: fp8 scales that saturate, subnormal ones and ones below fp8's least (stored as 0)
    "skvq2-fp8-wide-range": lambda: _skvq(2, fp8=True)[1],
}


# (width, head_dim) of rows narrower than WIDTH for the per-token codebook appends: 3-bit codes ending inside a unit
# of 32, a few values a row, and quantile ranks that come out whole (21 values at q = 0.1 and 0.9, the
# fifth-outliers codec's: one order statistic read, not two)
NARROW_ROWS = {"rows-ending-mid-unit": (80, 80), "small-heads": (48, 16), "whole-quantile-ranks": (21, 21)}
NARROW_CODECS = ("codebook-token-3", "codebook-token-4-fifth-outliers")


def narrow_rows(width: int) -> torch.Tensor:
    """Seeded normal fp16 rows (12 G, width) for NARROW_ROWS."""
    return torch.randn(12 * G, width, generator=torch.Generator().manual_seed(3)).half()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def assert_append_matches_torch(name: str, device="cuda", encoder_for=lambda *_: kernels.AppendKernels(),
                                rows_together: bool | None = None, x: torch.Tensor | None = None, head_dim: int = HEAD_DIM):
    """The append kernels (`encoder_for(codec, width, layout, device)`: the CUDA ones, or the CPU append) write the same codes, parameters
    and outliers (in the same order) as the torch encoders of kvcal.quantizers, bit for bit: a bulk append, then
    appends of one token (one block for per-channel blocks) into sequence 1 of 2. rows_together: the kernels' store's
    layout (None: the encoder's); x: the rows (12 G, width) fp16, of KV heads head_dim wide (None: seeded ones, WIDTH
    wide)."""
    codec = APPEND_CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    if x is None:
        x = seeded_tokens(12 * G, 7)
    if "wide-range" in name:
        x = (x.float() * 2 ** torch.linspace(-22, 12, len(x))[:, None]).half()
    x = x.to(device)
    stores = [PackedRows(codec, 2, x.shape[1], device, encoder_for, layout, head_dim, rows_together),
              PackedRows(codec, 2, x.shape[1], device, None, layout, head_dim)]
    assert stores[0].use_kernels and (rows_together is None or stores[0].rows_together == (rows_together or stores[0].pieces == 1))
    step = codec.block_tokens
    for store in stores:
        store.append(1, x[: 8 * G])
        for t in range(8 * G, len(x), step):
            store.append(1, x[t : t + step])
    fast, exact = stores
    assert fast.length == exact.length and fast.outliers == exact.outliers
    assert torch.equal(fast.words, exact.words)
    for table in ("token", "blocks"):  # bit for bit (fp8 has no torch.equal)
        for key, value in getattr(exact, table).items():
            got = getattr(fast, table)[key]
            assert got.dtype == value.dtype and torch.equal(_bits(got), _bits(value)), key
    assert fast.outlier_counts() == exact.outlier_counts()
    assert torch.equal(fast.outlier_count, exact.outlier_count)
    for head, count in enumerate(exact.outlier_counts()[1]):
        for field in ("outlier_positions", "outlier_values"):
            assert torch.equal(getattr(fast, field)[1, head, :count], getattr(exact, field)[1, head, :count]), field
    tiles = -(-exact.length[1] // OUTLIER_TILE_TOKENS)
    assert torch.equal(fast.outlier_offsets[1, :, :tiles], exact.outlier_offsets[1, :, :tiles])
