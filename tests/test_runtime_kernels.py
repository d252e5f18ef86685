"""kvcal.runtime.kernels: the CUDA kernels against the torch reference on the same packed data (the tests
marked `gpu` run only where CUDA and CuPy are present: `pip install -e ".[gpu]"`), and the launcher's
host-side bookkeeping (everywhere)."""

import ctypes

import numpy as np
import pytest
import torch

from conftest import tiny_model
from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook
from kvcal.runtime import kernel_source, kernels, reference
from kvcal.runtime.segments import CocktailStore, SegmentedStore
from kvcal.runtime.store import PackedRows
from kvcal.simulate import SegmentPolicy

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.cuda_ready("cuda")),
                         reason="needs a CUDA GPU and CuPy (pip install -e '.[gpu]')")

HEAD_DIM, KV_HEADS = 128, 8
WIDTH = HEAD_DIM * KV_HEADS
G, R, WINDOW = 32, 128, 64  # quantization group, KIVI residual, fp16 window
LENGTHS = (0, 1, G - 1, G, G + 1, R - 1, R, R + 1, WINDOW - 7, 4096 + 13)
BATCHES = {"17": [LENGTHS[i % len(LENGTHS)] + 3 * (i // len(LENGTHS)) for i in range(17)], "3": [R + 1, 0, G], "1": [4096 + 13]}
CHANNEL_SCALES = torch.linspace(0.2, 3.0, WIDTH)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)) * CHANNEL_SCALES).half()


def _thresholds(tail: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel thresholds that leave `tail` of each side outside: 0.3 crowds every tile with outliers."""
    bounds = torch.quantile(_tokens(2048, 99).float(), torch.tensor([tail, 1 - tail]), dim=0)
    return bounds[0], bounds[1]


def _uniform(k_bits, v_bits, sink=0, residual=R, rpc=0.0, layout=None):
    policy = SegmentPolicy(sink=sink, residual=residual, key_block=G)
    return ChannelBlockUniform(k_bits, G), TokenUniform(v_bits, G), policy, rpc, False, layout


def _codebook(k_bits, v_bits, sink=0, window=WINDOW, tail=0.0005, pre_rope=True, per_token_keys=False):
    lo, hi = (None, None) if per_token_keys else _thresholds(tail)
    keys = CodebookCodec(normal_float_codebook(k_bits), lo, hi, outlier_fraction=0.01)
    values = CodebookCodec(normal_float_codebook(v_bits), None, None, outlier_fraction=0.01)
    return keys, values, SegmentPolicy(sink=sink, window=window), 0.0, pre_rope, None


CASES = {
    "kivi2": lambda: _uniform(2, 2),
    "kivi4-sink4": lambda: _uniform(4, 4, sink=4),
    "kvmix-k3-v2-rpc": lambda: _uniform(3, 2, residual=0, rpc=0.1),
    "kvmix-k1-v4": lambda: _uniform(1, 4, residual=0),
    "kvmix-3bit-10x3+1x2-words": lambda: _uniform(3, 3, residual=0, layout="kvmix10x3+1x2"),
    "token-uniform-keys": lambda: (TokenUniform(2, G), TokenUniform(2, 128), SegmentPolicy(sink=4), 0.0, False, None),
    "nuq3-prerope-sink4-window": lambda: _codebook(3, 3, sink=4),
    "nuq4-prerope-crowded-outliers": lambda: _codebook(4, 4, window=0, tail=0.3),
    "nuq2-postrope-mostly-empty-outlier-tiles": lambda: _codebook(2, 2, tail=0.0, pre_rope=False),
    "nuq3-per-token-keys": lambda: _codebook(3, 2, sink=4, per_token_keys=True),
}


def filled(case: str, lengths: list[int], device="cuda"):
    """K and V stores of `case` holding len(lengths) sequences: a prefill, then 3 decode appends."""
    key_codec, value_codec, policy, rpc, pre_rope, layout = CASES[case]()
    stores = [SegmentedStore(codec, policy, keys, rpc, len(lengths), WIDTH, device, layout)
              for codec, keys in ((key_codec, True), (value_codec, False))]
    for b, n in enumerate(lengths):
        for store, seed in zip(stores, (2 * b, 2 * b + 1)):
            x = _tokens(n, seed).to(device)
            if n > 3:
                store.append(b, x[: n - 3])
            for t in range(max(0, n - 3), n):
                store.append(b, x[t : t + 1])
    return stores, pre_rope


def _inv_freq() -> torch.Tensor:
    return 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


def compare(key_store, value_store, batch: int, group: int, pre_rope: bool, device="cuda", seed: int = 0):
    """Kernel output vs reference.attention on the same stores, one query token per sequence; the query is
    a non-contiguous view and positions start far from 0 (RoPE angles of tens of thousands)."""
    heads = KV_HEADS * group
    query = torch.randn(batch, HEAD_DIM, heads, generator=torch.Generator().manual_seed(seed)).to(device).transpose(1, 2)
    offsets = [(37_000 * b) % 100_003 for b in range(batch)]
    scaling, inv_freq = HEAD_DIM**-0.5, _inv_freq().to(device)
    launches = [kernels.Segments(k, v) for k, v in zip(key_store.kernel_segments(), value_store.kernel_segments())]
    got = kernels.decode_attention(query, launches, KV_HEADS, scaling, offsets, inv_freq if pre_rope else None)
    expected = torch.zeros_like(got)
    for b in range(batch):
        if key_store.count(b):
            keys = reference.stored_keys(key_store, b, pre_rope, offsets[b], inv_freq, 1.0, KV_HEADS)
            expected[b] = reference.attention(query[b][:, None], keys, value_store.read(b), scaling)[:, 0]
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)


@gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_the_reference(case, batch):
    lengths = BATCHES[batch]
    (key_store, value_store), pre_rope = filled(case, lengths)
    compare(key_store, value_store, len(lengths), group=4, pre_rope=pre_rope)


@gpu
@pytest.mark.parametrize("group", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("case", ("kivi2", "nuq3-prerope-sink4-window"))
def test_decode_attention_serves_every_gqa_group_size(case, group):
    (key_store, value_store), pre_rope = filled(case, BATCHES["3"])
    compare(key_store, value_store, 3, group=group, pre_rope=pre_rope)


def cocktail_stores(device="cuda"):
    """Cocktail K and V stores: chunks spread over fp16 | int4 | int2 by random widths, then one recent token."""
    codecs = {kind: {bits: ChannelBlockUniform(bits, G) if kind == "k" else TokenUniform(bits, G) for bits in (4, 2)} for kind in "kv"}
    lengths = [40 * G + 5, 3 * G, 7]
    stores = [CocktailStore(codecs[kind], G, len(lengths), WIDTH, device) for kind in "kv"]
    widths = torch.tensor([16, 4, 2])[torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(3))].tolist()
    for b, n in enumerate(lengths):
        for store, seed in zip(stores, (2 * b, 2 * b + 1)):
            store.append(b, _tokens(n, seed).to(device))
            store.compress(b, widths[: n // G])
            store.append(b, _tokens(1, 50 + seed).to(device))
    return stores, len(lengths)


@gpu
def test_cocktail_chunks_of_three_widths_are_one_attention():
    """Cocktail: fp16 | int4 | int2 chunk groups (separate launches, one merge) and the fp16 recent tokens."""
    stores, batch = cocktail_stores()
    compare(*stores, batch, group=4, pre_rope=False)


APPEND_CODECS = {
    "token-uniform-2": lambda: TokenUniform(2, G),
    "token-uniform-3-group128": lambda: TokenUniform(3, 128),
    "channel-block-4": lambda: ChannelBlockUniform(4, G),
    "channel-block-1": lambda: ChannelBlockUniform(1, G),
    "token-uniform-3-10x3+1x2-words": lambda: TokenUniform(3, G),
    "codebook-channel-3": lambda: _codebook(3, 3)[0],
    "codebook-channel-4-crowded": lambda: _codebook(4, 4, tail=0.3)[0],
    "codebook-token-3": lambda: _codebook(3, 3)[1],
}


def assert_append_matches_torch(name: str, device="cuda"):
    """The append kernels write the same codes, parameters and outliers (in the same order) as the torch
    encoders of kvcal.quantizers, bit for bit: a bulk append, then appends of one token (one block for
    per-channel blocks) into sequence 1 of 2."""
    codec = APPEND_CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    x = _tokens(12 * G, 7).to(device)
    stores = [PackedRows(codec, 2, WIDTH, device, use_kernels=flag, layout=layout) for flag in (True, False)]
    step = codec.block_tokens
    for store in stores:
        store.append(1, x[: 8 * G])
        for t in range(8 * G, len(x), step):
            store.append(1, x[t : t + step])
    fast, exact = stores
    assert fast.length == exact.length and fast.outliers == exact.outliers
    assert torch.equal(fast.words, exact.words)
    for key, value in exact.token.items():
        assert torch.equal(fast.token[key], value), key
    for key, value in exact.blocks.items():
        assert torch.equal(fast.blocks[key], value), key
    count = exact.outliers[1]
    for field in ("outlier_rows", "outlier_channels", "outlier_values"):
        assert torch.equal(getattr(fast, field)[1, :count], getattr(exact, field)[1, :count]), field


@gpu
@pytest.mark.parametrize("name", APPEND_CODECS)
def test_append_kernels_write_what_the_torch_encoder_writes(name):
    assert_append_matches_torch(name)


@pytest.mark.parametrize("name", APPEND_CODECS)
def test_kernel_parameter_buffers_have_the_torch_encoders_layout(name):
    """The kernel path allocates the parameter buffers the torch encoder would fill: names, columns, fp16."""
    codec = APPEND_CODECS[name]()
    encoded = codec.encode(_tokens(G, 1).float())
    per_token, per_block = kernels.parameter_columns(codec, WIDTH)
    assert per_token == {key: value.shape[1] for key, value in encoded.token.items()}
    assert per_block == {key: value.shape[1] for key, value in encoded.block.items()}
    assert all(value.dtype == torch.float16 for value in [*encoded.token.values(), *encoded.block.values()])
    assert kernels.append_supported(codec, WIDTH)


def test_kernels_are_chosen_only_where_they_exist():
    from kvcal.skvq import SkvqTensor

    uniform = (ChannelBlockUniform(2, G), TokenUniform(2, G))
    skvq = SkvqTensor(torch.arange(WIDTH, dtype=torch.int32), torch.tensor([0, WIDTH], dtype=torch.int32), torch.ones(1), 1.5, False)
    assert kernels.decode_supported(*uniform, heads=32, kv_heads=8, head_dim=128)
    assert kernels.decode_supported(*uniform, heads=9, kv_heads=3, head_dim=64)
    assert not kernels.decode_supported(*uniform, heads=72, kv_heads=8, head_dim=128)  # 9 query heads per KV head
    assert not kernels.decode_supported(*uniform, heads=32, kv_heads=8, head_dim=96)
    assert not kernels.decode_supported(uniform[0], skvq, heads=32, kv_heads=8, head_dim=128)
    assert not kernels.append_supported(skvq, WIDTH)
    assert not kernels.cuda_ready("cpu")
    assert not PackedRows(uniform[0], 1, WIDTH, "cpu").use_kernels


@gpu
@pytest.mark.parametrize("recipe", ("kvquant", "mixed", "kivi", "kvmix"))
def test_decoding_on_cuda_runs_the_kernels_and_matches_the_cpu_reference(head_dim_64_bundles, recipe):
    """Token by token through transformers: the CUDA model's cache decodes with the kernels (every layer),
    and its logits equal the CPU reference runtime's within 2e-3."""
    from test_runtime_cache import decode_token_by_token

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    bundle = head_dim_64_bundles[recipe]
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(tiny_model("llama", head_dim=64), bundle, ids)
        cuda_logits, cache = decode_token_by_token(tiny_model("llama", head_dim=64).cuda(), bundle, ids.cuda())
    assert all(layer.use_kernels for layer in cache.layers)
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=2e-3)


def _memory(address: int, dtype, count: int) -> np.ndarray:
    """count elements of dtype at a raw (CPU) address: what a kernel would read from a descriptor pointer."""
    ctype = {np.uint16: ctypes.c_uint16, np.uint32: ctypes.c_uint32, np.int32: ctypes.c_int32, np.int16: ctypes.c_int16,
             np.float32: ctypes.c_float}[dtype]
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape=(count,)).copy()


def _halves(address: int, count: int) -> np.ndarray:
    return _memory(address, np.uint16, count).view(np.float16).astype(np.float32)


def _rows_from_descriptor(side: list[int], lengths: list[int], codec: int, b: int) -> np.ndarray:
    """Sequence b's (tokens, WIDTH) rows read only through a side's descriptor and lengths, following
    decode_attention.cu's locate/body_value/outlier formulas."""
    sink, body, head, recent, outliers = lengths
    f = dict(zip(("sink", "sink_stride", "recent", "recent_stride", "words", "words_stride", "words_per_row", "param0", "param1",
                  "param_stride", "param_cols", "param_extra", "codebook", "outlier_rows", "outlier_channels", "outlier_values",
                  "outlier_stride", "layout"), side))
    parts = [_halves(f["sink"] + 2 * b * f["sink_stride"], sink * WIDTH).reshape(sink, WIDTH)] if sink else []
    if body:
        bits, per_word = {1: (1, 32), 2: (2, 16), 3: (3, 10), 4: (4, 8), 5: (3, 11)}[f["layout"]]
        words = _memory(f["words"] + 4 * b * f["words_stride"], np.uint32, body * f["words_per_row"]).reshape(body, -1)
        channel = np.arange(WIDTH)
        codes = (words[:, channel // per_word] >> (channel % per_word * bits)) & (2**bits - 1)
        base = b * f["param_stride"]
        if codec in (kernel_source.UNIFORM_TOKEN, kernel_source.UNIFORM_CHANNEL):
            rows = body if codec == kernel_source.UNIFORM_TOKEN else body // f["param_extra"]
            scale, zero = (_halves(f[p] + 2 * base, rows * f["param_cols"]).reshape(rows, -1) for p in ("param0", "param1"))
            if codec == kernel_source.UNIFORM_TOKEN:
                scale, zero = scale[:, channel // f["param_extra"]], zero[:, channel // f["param_extra"]]
            else:
                scale, zero = np.repeat(scale, f["param_extra"], 0), np.repeat(zero, f["param_extra"], 0)
            values = codes * np.maximum(scale, 2.0**-24) + zero
        else:
            codebook = _memory(f["codebook"], np.float32, 2**bits)
            if codec == kernel_source.CODEBOOK_CHANNEL:
                lo, hi = (_memory(f[p], np.float32, WIDTH) for p in ("param0", "param1"))
            else:
                lo, hi = (_halves(f[p] + 2 * base, body)[:, None] for p in ("param0", "param1"))
            values = codebook[codes] * np.maximum((hi - lo) / 2, 1e-8) + (hi + lo) / 2
        if outliers:
            at = b * f["outlier_stride"]
            rows = _memory(f["outlier_rows"] + 4 * at, np.int32, outliers)
            channels = _memory(f["outlier_channels"] + 2 * at, np.int16, outliers)
            values[rows, channels] = _halves(f["outlier_values"] + 2 * at, outliers)
        parts.append(values)
    if recent:
        parts.append(_halves(f["recent"] + 2 * (b * f["recent_stride"] + head * WIDTH), recent * WIDTH).reshape(recent, WIDTH))
    return np.concatenate(parts) if parts else np.zeros((0, WIDTH), np.float32)


@pytest.mark.parametrize("case", CASES)
def test_descriptors_describe_the_stores(case):
    """What the launcher hands the decode kernel (pointers, strides, parameter tables, lengths) reads back,
    by the kernel's own formulas, as the stores' reference read: checked on CPU stores of every case."""
    key_codec, value_codec, policy, rpc, _, layout = CASES[case]()
    lengths = [3, G + 5, R + 1, 300]
    for codec, keys in ((key_codec, True), (value_codec, False)):
        store = SegmentedStore(codec, policy, keys, rpc, len(lengths), WIDTH, "cpu", layout)
        for b, n in enumerate(lengths):
            x = _tokens(n, b)
            store.append(b, x[: n - 2])
            store.append(b, x[n - 2 : n - 1])
            store.append(b, x[n - 1 :])
        (segments,) = store.kernel_segments()
        side = kernels._side(*segments)
        for b, row in enumerate(kernels._lengths(*segments, len(lengths))):
            read = _rows_from_descriptor(side, row, kernels.codec_id(codec), b)
            np.testing.assert_allclose(read, store.read(b).numpy(), rtol=0, atol=1e-6)
