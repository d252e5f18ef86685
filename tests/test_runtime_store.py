"""kvcal.runtime.store and kvcal.runtime.segments: batched appends and batched reads equal what one sequence at a time
stores and reads, bit for bit; the fast (un)packing equals kvcal.packing; the segment policy in Python equals
kvcal.kv's."""

import random

import pytest
import torch

from helpers.kernel_cases import APPEND_CODECS, CASES, HEAD_DIM, KV_HEADS, WIDTH, _codebook, seeded_tokens
from kvcal.errors import KvcalError
from kvcal.packing import OUTLIER_TILE_TOKENS
from kvcal.quantizers import ChannelBlockUniform, TokenUniform
from kvcal.runtime import cpu_kernel, tensor_core
from kvcal.runtime.segments import SegmentedStore
from kvcal.runtime.store import GROWTH, PackedRows
from kvcal.bundle import load_bundle
from kvcal.fit.skvq import SkvqTensor


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
    batched, alone = (PackedRows(codec, 3, WIDTH, "cpu", None, layout, HEAD_DIM) for _ in range(2))
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


@pytest.mark.parametrize("encoder", ["torch", "cpu-append"])
@pytest.mark.parametrize("name", CODECS)
def test_a_store_keeping_each_kv_heads_rows_together_holds_what_one_keeping_rows_whole_holds(name, encoder):
    """A CPU store's layout (each KV head's rows together) against rows kept whole, through a bulk append past the
    first capacity, block appends, drops from the front, a release and compactions: the same word at every (row,
    piece), the same reads."""
    codec = CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    encoder_for = cpu_kernel.append_encoder if encoder == "cpu-append" else None
    apart, whole = (PackedRows(codec, 2, WIDTH, "cpu", encoder_for, layout, HEAD_DIM, rows_together=together) for together in (False, True))
    assert whole.words.is_contiguous() and apart.rows_together == (apart.pieces == 1)  # (kvmix's 11 codes a word: one piece)
    step = codec.block_tokens
    for round in range(6):
        counts = [600 // step * step, 300 // step * step] if round == 0 else [step, 2 * step]
        x = seeded_tokens(sum(counts), round)
        for store in (apart, whole):
            store.append_rows([0, 1], counts, x)
            if round in (1, 3):
                store.drop_front(0, 5 * step)
                store.release()
    assert torch.equal(apart.words, whole.words)
    for b in range(2):
        assert torch.equal(apart.read(b), whole.read(b))
    assert torch.equal(apart.part()[0], whole.part()[0])


@pytest.mark.parametrize("encoder", ["torch", "cpu-append"])
@pytest.mark.parametrize("name", CODECS)
def test_rows_dropped_from_the_front_leave_the_others_as_stored(name, encoder):
    """A sliding-window layer's body: appends (one long one, then a few blocks at a time) and drops from the front in
    whole blocks, through the release of the storage a long append left and compactions when appends reach the
    end; each sequence's live rows read back (alone and batched) as a store that dropped nothing holds them, outliers
    included, and the storage stays near what the live rows need."""
    codec = CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    encoder_for = cpu_kernel.append_encoder if encoder == "cpu-append" else None
    trimmed, whole = (PackedRows(codec, 3, WIDTH, "cpu", encoder_for, layout, HEAD_DIM) for _ in range(2))
    step, keep = codec.block_tokens, 3 * codec.block_tokens + 70  # about a window of 70 tokens
    rng = random.Random(1)
    for round in range(16):
        counts = [600 // step * step if round == 0 else rng.choice([1, 2, 3]) * max(step, 24) for _ in range(3)]
        x = seeded_tokens(sum(counts), round)
        trimmed.append_rows([0, 1, 2], counts, x)
        whole.append_rows([0, 1, 2], counts, x)
        for b in range(3):
            excess = trimmed.length[b] - keep
            if excess > 0:
                trimmed.drop_front(b, excess - excess % step)
        trimmed.release()
        if round % 5:
            continue
        decoded, heads, lengths = trimmed.part()
        for b in range(3):
            live = whole.read(b)[trimmed.dropped[b] :]
            assert torch.equal(trimmed.read(b), live)
            assert torch.equal(decoded[b, heads[b] : heads[b] + lengths[b]], live)
    assert all(head < dropped for head, dropped in zip(trimmed.head, trimmed.dropped))  # compacted
    assert trimmed.words.shape[1] <= 2 * GROWTH < whole.words.shape[1]
    with pytest.raises(ValueError, match="whole blocks"):
        trimmed.drop_front(0, trimmed.length[0] + step)


@pytest.mark.parametrize("rows_together", [False, True])
@pytest.mark.parametrize("encoder", ["torch", "cpu-append"])
@pytest.mark.parametrize("name", CODECS)
def test_sequences_taken_keep_their_rows_and_the_stores_layout(name, encoder, rows_together):
    """take_sequences (beam search's reordering: a sequence dropped, one repeated) after appends and a drop from the
    front: each taken sequence reads back its rows and outliers, every buffer keeps the strides the store made them
    with (the kernels read them so), and appends after it read back as in a store fed the taken sequences."""
    codec = CODECS[name]()
    layout = "kvmix10x3+1x2" if "10x3+1x2" in name else None
    encoder_for = cpu_kernel.append_encoder if encoder == "cpu-append" else None
    store, fed = (PackedRows(codec, 3, WIDTH, "cpu", encoder_for, layout, HEAD_DIM, rows_together=rows_together)
                  for _ in range(2))
    step, taken = codec.block_tokens, [2, 0, 2]
    rows = [seeded_tokens(n * step, b) for b, n in enumerate((5, 9, 2))]
    store.append_rows([0, 1, 2], [len(x) for x in rows], torch.cat(rows))
    store.drop_front(0, step)
    fed.append_rows([0, 1, 2], [len(rows[b]) for b in taken], torch.cat([rows[b] for b in taken]))
    fed.drop_front(1, step)
    reads, outliers = [store.read(b) for b in range(3)], store.outliers
    strides = lambda: [t.stride() for t in (store.words, *store.token.values(), *store.blocks.values(), store.outlier_positions)]
    made = strides()
    store.take_sequences(taken, torch.tensor(taken))
    assert strides() == made and store.outliers == [outliers[b] for b in taken]
    assert all(torch.equal(store.read(b), reads[t]) for b, t in enumerate(taken))
    more = seeded_tokens(6 * step, 7)
    for target in (store, fed):
        target.append_rows([0, 1, 2], [step, 2 * step, 3 * step], more)
    assert store.length == fed.length and store.outliers == fed.outliers
    assert all(torch.equal(store.read(b), fed.read(b)) for b in range(3))


def recipe_store(bundle, keys: bool, encoder_for, batch: int, decode_later_steps: bool = False) -> SegmentedStore:
    """The store of layer 0's keys (or values) of a bundle, as quantized_cache makes it (tiny Llama: 2 KV heads of 16)."""
    recipe, codecs = bundle.layers[0], bundle.layer_codecs(0)
    return SegmentedStore(codecs.key_codec if keys else codecs.value_codec, recipe.format.policy(recipe), keys,
                          recipe.rpc_k if keys else recipe.rpc_v, batch, 32, "cpu", encoder_for=encoder_for, head_dim=16,
                          decode_later_steps=decode_later_steps)


def store_state(store, batch: int = 2) -> tuple[list, list]:
    """A store's segment lengths, RPC counts and outliers per sequence, and every sequence's tokens read back."""
    return ([list(counts) for counts in (store.rpc, store.sink.length, store.body.length, store.recent.length,
                                         store.body.outliers)], [store.read(b) for b in range(batch)])


def assert_same_store_state(got, want, case) -> None:
    (counts, reads), (want_counts, want_reads) = store_state(got), store_state(want)
    assert counts == want_counts, case
    assert all(torch.equal(read, wanted) for read, wanted in zip(reads, want_reads)), case


def test_a_store_reading_later_steps_as_decode_steps_routes_them_as_one_token_steps(recipe_bundles):
    """100 random cases over every recipe's K and V stores and KIVI with a residual of 128, with decode_later_steps:
    after a first step, steps of 2 to 90 tokens leave the store what those tokens one at a time leave (bit for bit:
    KVmix's RPC count decays a token at a time), each step's decode_step_reads ends where the body ended after each
    of its tokens, its rows the recent tokens and the step's, and read_from(b, first) reads read(b)[first:]; taking 1
    to 64 of the last step's tokens back leaves what one-token steps without them leave."""
    from helpers.tiny_bundles import kivi_bundle
    from helpers.tiny_models import tiny_model

    bundles = {**{name: load_bundle(path) for name, path in recipe_bundles.items()},
               "kivi-r128": kivi_bundle(tiny_model("llama"), 2, 32, 128)}
    rng = random.Random(1)
    for case in range(100):
        bundle, keys = bundles[rng.choice(sorted(bundles))], rng.random() < 0.5
        stepped, one_at_a_time = (recipe_store(bundle, keys, cpu_kernel.append_encoder, 2, True) for _ in range(2))
        rows = (seeded_tokens(1400, case)[:, :32] * 3).half()  # (a sequence takes at most 660)
        fed = [0, 700]

        def rows_of(counts):
            return torch.cat([rows[fed[b] : fed[b] + n] for b, n in enumerate(counts)])

        first = [rng.choice([1, 17, 90, 300]) for _ in range(2)]
        for store in (stepped, one_at_a_time):
            store.append_rows([0, 1], first, rows_of(first))
        fed[:] = [start + n for start, n in zip(fed, first)]
        for step in range(rng.randint(1, 4)):
            counts = [rng.randint(2, 90) for _ in range(2)]
            reads = [stepped.decode_step_reads(b, rows[fed[b] : fed[b] + n]) for b, n in enumerate(counts)]
            stepped.append_rows([0, 1], counts, rows_of(counts))
            for b, n in enumerate(counts):
                assert torch.equal(reads[b].rows, torch.cat([one_at_a_time.recent.read(b), rows[fed[b] : fed[b] + n]]))
                ends = []
                for i in range(n):
                    one_at_a_time.append_rows([b], [1], rows[fed[b] + i : fed[b] + i + 1])
                    ends.append(one_at_a_time.sink.length[b] + one_at_a_time.body.length[b])
                assert reads[b].ends == ends, (case, step, b)
            fed[:] = [start + n for start, n in zip(fed, counts)]
            assert_same_store_state(stepped, one_at_a_time, (case, step))
            for b in range(2):
                start = rng.randint(0, stepped.count(b))
                assert torch.equal(stepped.read_from(b, start), stepped.read(b)[start:]), (case, step, start)
        back = rng.randint(1, min(min(counts), 64))
        stepped.take_back(back)
        without = recipe_store(bundle, keys, cpu_kernel.append_encoder, 2, True)
        starts = [0, 700]
        without.append_rows([0, 1], first, torch.cat([rows[s : s + n] for s, n in zip(starts, first)]))
        for b, last in enumerate(fed):
            for t in range(starts[b] + first[b], last - back):
                without.append_rows([b], [1], rows[t : t + 1])
        assert_same_store_state(stepped, without, (case, "taken back"))


@pytest.mark.parametrize("encoder", ["torch", "cpu-append"])
def test_tokens_taken_back_leave_the_store_a_shorter_step_leaves(recipe_bundles, encoder):
    """200 random cases over every recipe's K and V stores and KIVI with a residual of 128 (its keys leave it 128 at a
    time): after random steps of two sequences (decode steps among them), a step of 2 to 120 tokens each, and
    take_back of 1 to 64 of them, the store holds what one given the shorter step holds, bit for bit (segments, RPC
    counts, outliers, every token read back), and stays so through the next append."""
    from helpers.tiny_bundles import kivi_bundle
    from helpers.tiny_models import tiny_model

    bundles = {**{name: load_bundle(path) for name, path in recipe_bundles.items()},
               "kivi-r128": kivi_bundle(tiny_model("llama"), 2, 32, 128)}
    encoder_for = cpu_kernel.append_encoder if encoder == "cpu-append" else None
    rng = random.Random(0)
    for case in range(200):
        bundle, keys = bundles[rng.choice(sorted(bundles))], rng.random() < 0.5
        taken, shorter = (recipe_store(bundle, keys, encoder_for, 2) for _ in range(2))
        rows = (seeded_tokens(1100, case)[:, :32] * 3).half()
        fed = [0, 550]

        def feed(stores, counts):
            for store in stores:
                store.append_rows([0, 1], counts, torch.cat([rows[fed[b] : fed[b] + n] for b, n in enumerate(counts)]))
            fed[:] = [start + n for start, n in zip(fed, counts)]

        for _ in range(rng.randint(0, 4)):
            feed((taken, shorter), [rng.choice([1, 2, 5, 17, 40, 90]) for _ in range(2)])
        step = [rng.randint(2, 120) for _ in range(2)]
        back = rng.randint(1, min(min(step), 64))
        feed((taken,), step)
        fed[:] = [start - n for start, n in zip(fed, step)]
        taken.take_back(back)
        feed((shorter,), [n - back for n in step])
        for when in ("after the take-back", "after the next append"):
            assert_same_store_state(taken, shorter, (case, when))
            feed((taken, shorter), [3, 7])


def test_per_token_parameters_run_along_the_tokens_per_channel_group():
    """Each per-token parameter column (a channel group's scale or zero) runs along the tokens, as the tensor-core
    kernel copies them, 8 tokens to a 16-byte chunk, also once the store has grown; it holds what the codec encodes.
    The tensor-core launcher refuses parameters kept otherwise rather than read them wrong."""
    group, batch, n = 64, 2, GROWTH + 5
    keys = PackedRows(ChannelBlockUniform(2, 128), batch, WIDTH, "cpu")
    values = PackedRows(TokenUniform(2, group), batch, WIDTH, "cpu")
    x = seeded_tokens(n - 5, 0)
    for b in range(batch):
        keys.append(b, x[: GROWTH - 128])
        values.append(b, x[:5])
        values.append(b, x[: n - 5])  # grows past GROWTH rows
    scale, capacity, groups = values.token["scale"], values.words.shape[1], WIDTH // group
    assert capacity == 2 * GROWTH and scale.shape == (batch, capacity, groups)
    assert scale.stride() == (groups * capacity, 1, capacity) and values.token["zero"].stride() == scale.stride()
    encoded = values.codec.encode(torch.cat((x[:5], x[: n - 5])).float())
    assert all(torch.equal(values.token[name][b, :n], encoded.token[name]) for name in ("scale", "zero") for b in range(batch))
    values.token = {name: t.contiguous() for name, t in values.token.items()}  # one row of every group per token
    query = torch.zeros(batch, KV_HEADS, HEAD_DIM)
    with pytest.raises(KvcalError, match="each group along the tokens"):
        tensor_core.prepare_decode_tc(query, keys, values, KV_HEADS, 1.0, lengths=[GROWTH - 128] * batch, per_split=128)


@pytest.mark.parametrize("case", CASES)
def test_segmented_batches_equal_one_sequence_at_a_time(case):
    """Random batches of sequences with ragged counts (prefills, single tokens, sequences left out) through
    append_rows, against per-sequence appends; read_batch, by rows or by heads, holds each sequence's read."""
    key_codec, value_codec, policy, rpc, _, layout = CASES[case]()
    rng = random.Random(0)
    for codec, keys in ((key_codec, True), (value_codec, False)):
        batched, alone = (SegmentedStore(codec, policy, keys, rpc, 4, WIDTH, "cpu", layout, head_dim=HEAD_DIM) for _ in range(2))
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


def test_outliers_are_kept_per_kv_head_and_tile_at_4_bytes_each_plus_an_offset_table():
    """kvcal.packing's outlier layout, by hand: per (sequence, KV head) in append order, which is position order within
    each tile (the tensor-core kernel finds each warp's outliers by it), positions in the tile and values; offset[t] =
    the head's outliers before tile t; used_bytes counts 4 bytes per outlier and per entry."""
    codec = _codebook(3, 3, tail=0.3)[0]  # fixed per-channel thresholds: rows encode alone, crowded with outliers
    store = PackedRows(codec, 2, WIDTH, "cpu", None, None, HEAD_DIM)
    tokens = 2 * OUTLIER_TILE_TOKENS + 22
    x = seeded_tokens(tokens, 3)
    store.append(1, x[:100])
    for t in range(100, tokens):
        store.append(1, x[t : t + 1])
    rows, channels, values = codec.encode(x.float()).outliers
    counts = store.outlier_counts()[1]
    tiles = -(-tokens // OUTLIER_TILE_TOKENS)
    for head in range(KV_HEADS):
        mine = channels // HEAD_DIM == head
        row, channel = rows[mine], channels[mine] % HEAD_DIM
        assert counts[head] == len(row) > 0 and store.outlier_counts()[0] == [0] * KV_HEADS
        assert store.outlier_offsets[1, head, :tiles].tolist() == [int((row < t * OUTLIER_TILE_TOKENS).sum()) for t in range(tiles)]
        positions = store.outlier_positions[1, head, : len(row)].long() & 0xFFFF
        assert torch.equal(positions, row % OUTLIER_TILE_TOKENS * HEAD_DIM + channel)
        ends = [*store.outlier_offsets[1, head, :tiles].tolist(), len(row)]
        for t in range(tiles):
            in_tile = positions[ends[t] : ends[t + 1]]
            assert len(in_tile) > 1 and (in_tile[1:] > in_tile[:-1]).all()
        assert torch.equal(store.outlier_values[1, head, : len(row)], values[mine])
    assert store.row_words * 32 == WIDTH * 3  # 3-bit codes in exactly 3 bits
    assert store.used_bytes(1) == tokens * WIDTH * 3 // 8 + sum(counts) * 4 + KV_HEADS * tiles * 4
    assert store.used_bytes(0) == 0


def test_a_store_keeping_outliers_needs_a_head_dim_that_fits_their_positions():
    codec = _codebook(3, 3)[1]
    with pytest.raises(KvcalError, match="pass head_dim"):
        PackedRows(codec, 1, WIDTH, "cpu")
    with pytest.raises(KvcalError, match="head_dim 2048 is too large"):
        PackedRows(codec, 1, 2048, "cpu", head_dim=2048)
