"""kvcal.runtime.store and kvcal.runtime.segments: batched appends and batched reads equal what one sequence at a time
stores and reads, bit for bit; the fast (un)packing equals kvcal.packing; the segment policy in Python equals
kvcal.kv's."""

import random

import pytest
import torch

from helpers.kernel_cases import APPEND_CODECS, CASES, WIDTH, seeded_tokens
from kvcal.kv import SegmentPolicy
from kvcal.packing import pack, unpack
from kvcal.runtime.segments import SegmentedStore, _fp16_recent
from kvcal.runtime.store import PackedRows, pack_codes, unpack_codes
from kvcal.skvq import SkvqTensor

LAYOUTS = [(1, "lsb"), (2, "lsb"), (3, "lsb"), (4, "lsb"), (3, "kvmix10x3+1x2"), (1.5, "ternary20")]


@pytest.mark.parametrize("bits, layout", LAYOUTS)
@pytest.mark.parametrize("channels", [7, 100, 192, 1024])
def test_fast_packing_equals_kvcal_packing(bits, layout, channels):
    top = 3 if layout == "ternary20" else 2 ** int(bits)
    codes = torch.randint(0, top, (37, channels), generator=torch.Generator().manual_seed(channels))
    words = pack(codes, bits, layout)
    assert torch.equal(pack_codes(codes, bits, layout), words)
    assert torch.equal(unpack_codes(words, bits, layout).flatten(-2)[..., :channels].long(), unpack(words, bits, channels, layout))


def skvq_codec(bits: float) -> SkvqTensor:
    permutation = torch.randperm(WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    starts = torch.tensor([0, 100, 356, 700, WIDTH], dtype=torch.int32)
    return SkvqTensor(permutation, starts, torch.full((4,), 0.9), bits, fp8=bits == 2)


CODECS = {**APPEND_CODECS, "skvq-2-fp8": lambda: skvq_codec(2), "skvq-ternary": lambda: skvq_codec(1.5)}


@pytest.mark.parametrize("name", CODECS)
def test_batched_appends_and_reads_equal_one_sequence_at_a_time(name):
    """append_rows of three sequences at once (a bulk append, then one block each) stores what per-sequence
    appends store, and decoded() (the batched reference's read) gives each sequence's read(b)."""
    codec = CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    batched, alone = (PackedRows(codec, 3, WIDTH, "cpu", None, layout) for _ in range(2))
    step = codec.block_tokens
    for seed, counts in ((0, [5 * step, 9 * step, 2 * step]), (10, [step] * 3)):
        rows = [seeded_tokens(n, seed + b) for b, n in enumerate(counts)]
        for b, x in enumerate(rows):
            alone.append(b, x)
        batched.append_rows([0, 1, 2], counts, torch.cat(rows))
    assert batched.length == alone.length and batched.outliers == alone.outliers
    decoded = batched.decoded(max(batched.length))
    for b in range(3):
        assert torch.equal(batched.read(b), alone.read(b))
        assert torch.equal(decoded[b, : batched.length[b]], alone.read(b))


@pytest.mark.parametrize("case", CASES)
def test_segmented_batches_equal_one_sequence_at_a_time(case):
    """Random batches of sequences with ragged counts (prefills, single tokens, sequences left out) through
    append_rows, against per-sequence appends; read_batch, by rows or by heads, holds each sequence's read."""
    key_codec, value_codec, policy, rpc, _, layout = CASES[case]()
    rng = random.Random(0)
    for codec, keys in ((key_codec, True), (value_codec, False)):
        batched, alone = (SegmentedStore(codec, policy, keys, rpc, 4, WIDTH, "cpu", layout) for _ in range(2))
        for step in range(25):
            seqs = sorted(rng.sample(range(4), rng.randint(1, 4)))
            counts = [rng.choice([1, 1, 2, 40, 150] if step % 8 == 0 else [1, 1, 1, 2, 7]) for _ in seqs]
            rows = [seeded_tokens(n, 100 * step + b) for b, n in zip(seqs, counts)]
            for b, x in zip(seqs, rows):
                alone.append(b, x)
            batched.append_rows(seqs, counts, torch.cat(rows))
        by_rows, by_heads = batched.read_batch({}), batched.read_batch({}, heads=8)
        for b in range(4):
            n = alone.count(b)
            assert batched.count(b) == n and batched.used_bytes(b) == alone.used_bytes(b)
            assert torch.equal(batched.read(b), alone.read(b))
            assert torch.equal(by_rows[b, :n], alone.read(b))
            assert torch.equal(by_heads[b, :, :n].transpose(0, 1).reshape(n, WIDTH), alone.read(b))


def test_the_segment_policy_in_python_equals_kvcal_kv():
    policies = [SegmentPolicy(sink=4, residual=128, key_block=32), SegmentPolicy(window=64, sink=5),
                SegmentPolicy(residual=8, key_block=4), SegmentPolicy(key_block=32, sink=1), SegmentPolicy()]
    for policy in policies:
        for keys in (True, False):
            assert [_fp16_recent(policy, n, keys) for n in range(600)] == policy.fp16_recent(torch.arange(600), keys).tolist()
