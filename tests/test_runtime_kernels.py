"""kvcal.runtime.kernels: the CUDA kernels (the append kernels, the tensor-core decode as the cache launches it)
against the torch reference on the same packed data (the tests marked `gpu` run only where CUDA and CuPy are present:
`pip install -e ".[gpu]"`), and the launcher's host-side bookkeeping (everywhere)."""

import ctypes

import numpy as np
import pytest
import torch

from helpers import (assert_taking_back_leaves_a_shorter_steps_cache, decode_token_by_token, generate_taking_sequences,
                     logits_in_steps, requires_gpu, ways_of_decode_steps)
from helpers.kernel_cases import (APPEND_CODECS, BATCHES, CASES, DECODE_CASES, G, HEAD_DIM, NARROW_CODECS, NARROW_ROWS, R,
                                  SERVED_CASES, WIDTH, assert_append_matches_torch, cocktail_stores, compare, filled,
                                  narrow_rows, seeded_tokens)
from helpers.tiny_bundles import kivi_bundle, windowed_short_steps
from helpers.tiny_models import left_padded, tiny_model
from kvcal.bundle import load_bundle
from kvcal.errors import KvcalError
from kvcal.quantizers import ChannelBlockUniform, TokenUniform
from kvcal.runtime import backends, cpu_kernel, kernel_source, kernels
from kvcal.runtime.segments import SegmentedStore
from kvcal.runtime.store import PackedRows
from kvcal.fit.skvq import SkvqTensor

@requires_gpu
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("case", SERVED_CASES)
def test_tensor_core_decode_matches_the_reference(case, batch):
    """As the cache runs it: one tensor-core launch, its body blocks over the body rows both sides hold, its segment
    blocks over the rest, its last block per (sequence, KV head) merging the splits."""
    lengths = BATCHES[batch]
    (key_store, value_store), pre_rope = filled(case, lengths)
    compare(key_store, value_store, len(lengths), group=4, pre_rope=pre_rope)


@requires_gpu
@pytest.mark.parametrize("case", SERVED_CASES)
def test_tensor_core_decode_reads_each_kv_heads_rows_together_as_rows_whole(case):
    """Bodies keeping each KV head's rows together (AppendKernels(rows_together=False)): the appends write them and the
    launch reads them to the same bits as bodies keeping each row whole, and the reference's attention."""
    outputs = []
    for together in (True, False):
        (key_store, value_store), pre_rope = filled(case, BATCHES["3"], rows_together=together)
        assert key_store.body.rows_together == value_store.body.rows_together == together
        outputs.append(compare(key_store, value_store, len(BATCHES["3"]), group=4, pre_rope=pre_rope))
    assert torch.equal(*outputs)


@requires_gpu
@pytest.mark.parametrize("group", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("case", ("kivi2", "nuq3-prerope-sink4-window"))
def test_decode_attention_serves_every_gqa_group_size(case, group):
    (key_store, value_store), pre_rope = filled(case, BATCHES["3"])
    compare(key_store, value_store, 3, group=group, pre_rope=pre_rope)


@requires_gpu
def test_cocktail_chunks_of_three_widths_are_one_attention():
    """Cocktail: fp16 | int4 | int2 chunk groups and the fp16 recent tokens, as the cache runs them: a tensor-core
    launch over the int4 groups (its segment blocks over the fp16 chunks and recent tokens), one over the int2 groups,
    the last merging both."""
    stores, batch = cocktail_stores()
    compare(*stores, batch, group=4, pre_rope=False)


@requires_gpu
@pytest.mark.parametrize("rows_together", (True, False), ids=("rows-whole", "heads-together"))
@pytest.mark.parametrize("name", APPEND_CODECS)
def test_append_kernels_write_what_the_torch_encoder_writes_in_either_layout(name, rows_together):
    assert_append_matches_torch(name, rows_together=rows_together)


@requires_gpu
@pytest.mark.parametrize(("width", "head_dim"), NARROW_ROWS.values(), ids=NARROW_ROWS)
@pytest.mark.parametrize("name", NARROW_CODECS)
def test_codebook_append_kernel_writes_what_the_torch_encoder_writes_at_narrow_widths(name, width, head_dim):
    assert_append_matches_torch(name, x=narrow_rows(width), head_dim=head_dim)


@pytest.mark.parametrize("name", APPEND_CODECS)
def test_kernel_parameter_buffers_have_the_torch_encoders_layout(name):
    """The kernel path allocates the parameter buffers the torch encoder would fill: names, columns, dtype."""
    codec = APPEND_CODECS[name]()
    encoded = codec.encode(seeded_tokens(G, 1).float())
    per_token, per_block = kernels.parameter_columns(codec, WIDTH)
    assert per_token == {key: value.shape[1] for key, value in encoded.token.items()}
    assert per_block == {key: value.shape[1] for key, value in encoded.block.items()}
    dtype = kernels.parameter_dtype(codec)
    assert all(value.dtype == dtype for value in [*encoded.token.values(), *encoded.block.values()])
    assert kernels.append_supported(codec, WIDTH)


def test_kernels_are_chosen_only_where_they_exist():

    uniform = (ChannelBlockUniform(2, G), TokenUniform(2, G))
    skvq = SkvqTensor(torch.arange(WIDTH, dtype=torch.int32), torch.tensor([0, WIDTH], dtype=torch.int32), torch.ones(1), 1.5, False)
    assert kernels.heads_refusal(heads=32, kv_heads=8, head_dim=128) is None
    assert kernels.heads_refusal(heads=9, kv_heads=3, head_dim=64) is None
    assert kernels.heads_refusal(heads=72, kv_heads=8, head_dim=128) is None  # 9 query heads per KV head: in passes
    assert kernels.heads_refusal(heads=30, kv_heads=4, head_dim=128) is not None
    assert kernels.heads_refusal(heads=32, kv_heads=8, head_dim=96) is not None
    assert not kernels.append_supported(skvq, WIDTH)
    assert not kernels.cuda_ready("cpu")
    assert kernels.append_encoder(uniform[0], WIDTH, "lsb", "cpu") is None and not PackedRows(uniform[0], 1, WIDTH, "cpu").use_kernels


def test_the_cases_the_tensor_core_kernel_does_not_read_decode_on_the_reference_on_cuda_with_a_reason():
    """1-bit and per-token uniform keys, per-token codebook key thresholds: the planner names the reason (codecs), and a
    store in a layout the kernel does not read (KVmix's 10x3+1x2 words, which no recipe's runtime store keeps) is
    refused by `serve`, never decoded wrong."""
    from kvcal.runtime import tensor_core

    for case, reason in (("kvmix-k1-v4", "the tensor-core kernel reads 2-4-bit uniform codes, not 1-bit keys with 4-bit values"),
                         ("token-uniform-keys", "the tensor-core kernel reads uniform per-channel keys"),
                         ("nuq3-per-token-keys", "the tensor-core kernel reads uniform per-channel keys")):
        key_codec, value_codec, *_ = DECODE_CASES[case]()
        shape = backends.LayerShape(((key_codec, value_codec),), False, 32, 8, HEAD_DIM, torch.device("cuda"))
        assert reason in backends.cuda_refusal(shape), case
    (keys, values), _ = filled("kvmix-3bit-10x3+1x2-words", [5], device="cpu")
    with pytest.raises(KvcalError, match="reads 3-bit codes in the 'planes3' packing"):
        tensor_core.serve(kernels.Segments(keys.kernel_segments()[0], values.kernel_segments()[0]), 32, 8, HEAD_DIM)


def test_a_gqa_group_past_what_a_launch_takes_is_split_into_the_fewest_even_passes():
    assert kernels.head_passes(8) == [8] and kernels.head_passes(4) == [4]
    assert kernels.head_passes(16) == [8, 8] and kernels.head_passes(12) == [6, 6]
    assert kernels.head_passes(11) == [6, 5] and kernels.head_passes(17) == [6, 6, 5]


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")  # one worker builds the session fixture, not one per worker
@pytest.mark.parametrize("recipe", ("kvquant", "mixed", "skvq", "kivi", "kvmix", "nuq4-0%", "nuq4-1%", "kivi4-g32", "kivi2-g32"))
def test_decoding_on_cuda_runs_the_kernels_and_matches_the_cpu_reference(head_dim_64_bundles, recipe):
    """Token by token through transformers: the CUDA model's cache decodes with the kernels (every layer; the
    tensor-core kernel over the bodies of kvquant, nuq4-0%, nuq4-1%, kivi4-g32 and kivi2-g32), and its logits equal the
    CPU reference runtime's within 2e-3, or 6e-3 where the tensor-core kernel serves nuq bodies: its fp16 operands (per-token value scales
    folded into P, pre-RoPE keys rotated in fp16) give 5.2e-3 for kvquant and 2.6e-3 for nuq4-0% here, on the H100
    as in the emulation of the same .cu (5.24e-3 and 2.43e-3 measured, 2026-11-23), where the fp32 reference of a
    served body attends to a few tokens."""

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    bundle = head_dim_64_bundles[recipe]
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(tiny_model("llama", head_dim=64), bundle, ids)
        cuda_logits, cache = decode_token_by_token(tiny_model("llama", head_dim=64).cuda(), bundle, ids.cuda())
    plans = backends.bundle_plan(load_bundle(bundle), "cuda")  # kivi's groups of 4: the reference
    assert [layer.decode_path for layer in cache.layers] == [plan.bodies for plan in plans]
    if recipe in ("kvquant", "nuq4-0%", "nuq4-1%", "kivi4-g32", "kivi2-g32"):
        assert {plan.bodies for plan in plans} == {"tensor-core"}
    fp16_operands = recipe in ("kvquant", "mixed", "nuq4-0%", "nuq4-1%")
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=6e-3 if fp16_operands else 2e-3)


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")
@pytest.mark.parametrize("recipe", ("kivi2-g32", "kvmix", "kvquant"))
def test_a_cuda_cache_keeping_each_kv_heads_rows_together_decodes_the_same_logits(head_dim_64_bundles, recipe):
    """quantized_cache(..., cuda_layout="heads") on the GPU: the appends write each KV head's rows together and the
    kernels read them there, token by token through transformers, to the same logits, bit for bit, as rows whole (the
    emulated cache's test, on the device)."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4)).cuda()
    logits = []
    for layout, together in (("rows", True), ("heads", False)):
        with torch.inference_mode():
            got, cache = decode_token_by_token(tiny_model("llama", head_dim=64).cuda(), head_dim_64_bundles[recipe], ids, layout)
        assert {layer.keys_store.body.rows_together for layer in cache.layers} == {together}
        logits.append(got)
    assert torch.equal(*logits)


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")
@pytest.mark.parametrize("cuda_layout", ["rows", "heads"])
@pytest.mark.parametrize("recipe", ("kvquant", "nuq4-1%", "kivi2-g32", "kvmix"))
def test_sequences_taken_on_cuda_decode_as_the_batch_fed_so(head_dim_64_bundles, recipe, cuda_layout):
    """Beam search's batch edits on the device (tensor-core bodies, outliers, each layout): sequences kept by
    batch_select_indices after decode steps give the tokens, logits, bytes and outliers of a cache fed them so."""
    model = tiny_model("llama", head_dim=64).cuda()
    ids, mask = left_padded((21, 9, 14), seed=6)
    runs = generate_taking_sequences(model, head_dim_64_bundles[recipe], ids.cuda(), mask.cuda(), [2, 0, 2], cuda_layout)
    (edited, *edited_state), (fed, *fed_state) = runs
    assert torch.equal(edited.sequences, fed.sequences) and edited_state == fed_state
    torch.testing.assert_close(torch.stack(edited.logits), torch.stack(fed.logits), rtol=0, atol=1e-4)


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")
@pytest.mark.parametrize("cuda_layout", ["rows", "heads"])
@pytest.mark.parametrize("recipe", ("kvquant", "nuq4-1%", "kivi2-g32", "kvmix"))
def test_tokens_taken_back_on_cuda_leave_the_cache_a_shorter_step_leaves(head_dim_64_bundles, recipe, cuda_layout):
    """crop after a step of candidates on the device (tensor-core bodies, outliers, each layout): the cache a shorter
    step leaves, read back and decoded."""
    ids = torch.randint(3, 512, (2, 72), generator=torch.Generator().manual_seed(7)).cuda()
    assert_taking_back_leaves_a_shorter_steps_cache(tiny_model("llama", head_dim=64).cuda(), head_dim_64_bundles[recipe],
                                                    ids, 60, cuda_layout)


@requires_gpu
@pytest.mark.parametrize("model_type, overrides", [("gpt_oss", dict(num_attention_heads=4)),
                                                   ("gpt_oss", dict(num_attention_heads=32)), ("gemma2", {}),
                                                   ("qwen3_5_text", {}), ("falcon_h1", {}), ("gemma3n_text", {}), ("gemma4_text", {}),
                                                   ("laguna", {})])
def test_sinks_soft_caps_and_hybrids_decode_on_cuda_like_the_cpu_reference(model_type, overrides):
    """Tiny models at head_dim 64 under KIVI's int4 in blocks of 32, 40 tokens one at a time: gpt-oss (a 16-token
    sliding layer and a full one; each row's sink joined after the fused merge; 32 query heads: in passes of 8 per KV
    head), Gemma 2 (scores capped at 0.05), Qwen3.5 (gated DeltaNet layers before its two attention layers), Falcon-H1
    (Mamba 2 beside each attention), Gemma 3n (two more layers reading the two attention layers' caches), Laguna (a
    sliding layer of 8 query heads, a full one of 4, over 2 KV heads each). The
    tensor-core kernel on every attention layer, the CPU runtime's logits within 2e-3 (the emulated kernel's tests, on
    the device)."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    model = tiny_model(model_type, head_dim=64, **overrides)
    bundle = kivi_bundle(model, 4, 32, 32)
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(model, bundle, ids)
        cuda_logits, cache = decode_token_by_token(model.cuda(), bundle, ids.cuda())
    assert [layer.decode_path for layer in cache.attention_layers] == ["tensor-core"] * 2
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=2e-3)


@requires_gpu
@pytest.mark.xdist_group("head_dim_256_gemma3_bundles")
@pytest.mark.parametrize("recipe", ("kvquant", "nuq4-1%", "kivi4-g32"))
def test_gemma3_at_head_dim_256_decodes_its_sliding_window_on_cuda_like_the_cpu_reference(head_dim_256_gemma3_bundles, recipe):
    """A tiny Gemma 3 at head_dim 256, 40 tokens one at a time through a 16-token sliding layer and a full one: every
    layer's body on the tensor-core kernel, the CPU reference runtime's logits within 2e-3 (6e-3 for the nuq bodies'
    fp16 operands, as the emulated kernels at head_dim 256)."""
    from helpers.tiny_models import HEAD_DIM_256

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    bundle = head_dim_256_gemma3_bundles[recipe]
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(tiny_model("gemma3_text", **HEAD_DIM_256), bundle, ids)
        cuda_logits, cache = decode_token_by_token(tiny_model("gemma3_text", **HEAD_DIM_256).cuda(), bundle, ids.cuda())
    assert [layer.decode_path for layer in cache.layers] == ["tensor-core"] * 2
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=2e-3 if recipe == "kivi4-g32" else 6e-3)


@requires_gpu
@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_linear"])
def test_latent_attention_decodes_on_cuda_like_the_cpu_reference(model_type):
    """MLA under KIVI's int4 in blocks of 32, 40 tokens one at a time: the rotated key (64 channels) and the latent (96)
    stored on the device, the batched reference decoding over them there (the tensor-core kernel reads no latent yet),
    the CPU runtime's logits (its kernel's) within 2e-3 (Kimi Linear: its KDA layers' states in transformers' cache
    layers)."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    model = tiny_model(model_type)
    bundle = kivi_bundle(model, 4, 32, 32)
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(model, bundle, ids)
        cuda_logits, cache = decode_token_by_token(model.cuda(), bundle, ids.cuda())
    assert [layer.decode_path for layer in cache.attention_layers] == ["reference"] * 2
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=2e-3)


@requires_gpu
def test_a_gqa_16_model_decodes_on_cuda_in_two_passes_like_the_cpu_reference():
    """A tiny Llama with 16 query heads over one KV head of 64 under KIVI-4 (g32), 40 tokens one at a time: every layer
    on the tensor-core kernel in two passes of 8 query heads, the CPU reference runtime's logits within 2e-3."""
    gqa_16 = dict(head_dim=64, num_attention_heads=16, num_key_value_heads=1)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    bundle = kivi_bundle(tiny_model("llama", **gqa_16), 4, 32, 32)
    with torch.inference_mode():
        cpu_logits, _ = decode_token_by_token(tiny_model("llama", **gqa_16), bundle, ids)
        cuda_logits, cache = decode_token_by_token(tiny_model("llama", **gqa_16).cuda(), bundle, ids.cuda())
    assert [layer.decode_path for layer in cache.layers] == ["tensor-core"] * len(cache.layers)
    torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, rtol=0, atol=2e-3)


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")
@pytest.mark.parametrize("recipe", ("kvquant", "kivi2-g32", "kvmix"))
def test_short_steps_on_cuda_read_the_cache_like_the_cpu_reference(head_dim_64_bundles, recipe):
    """Steps of 4 and of 16 tokens between decode steps on a left-padded batch (speculative decoding's checks): the
    tensor-core kernel reads the stored tokens with the step's queries as more query heads (8 a KV head: one pass,
    then 32: four passes), merged with the step's own tokens' attention, the CPU runtime's logits within 2e-3 (the
    emulated kernel's test, on the device)."""
    model = tiny_model("llama", head_dim=64)
    ids, mask = left_padded((90, 75), seed=3)
    assert_short_steps_on_cuda_give_the_cpu_logits(model, head_dim_64_bundles[recipe], ids, mask, [62, 1, 4, 1, 16, 1])


@requires_gpu
@pytest.mark.xdist_group("head_dim_64_bundles")
@pytest.mark.parametrize("recipe", ("kvquant", "kivi2-g32", "kvmix"))
def test_later_steps_read_as_decode_steps_on_cuda_give_the_cpu_logits(head_dim_64_bundles, recipe, monkeypatch):
    """later_steps="decode" on CUDA: steps of 4 and of 16 tokens between decode steps on a left-padded batch, read by
    the tensor-core kernel and re-read where the step moved tokens to the body (reference.reread), give the CPU
    runtime's logits within 2e-3."""
    model = tiny_model("llama", head_dim=64)
    ids, mask = left_padded((90, 75), seed=3)
    steps, bundle = [62, 1, 4, 1, 16, 1], head_dim_64_bundles[recipe]
    cpu_logits = logits_in_steps(model, bundle, ids, mask, steps, later_steps="decode")
    ways = ways_of_decode_steps(monkeypatch)
    cuda_logits = logits_in_steps(model.cuda(), bundle, ids.cuda(), mask.cuda(), steps, later_steps="decode")
    assert ways and set(ways) == {True}
    for got, want in zip(cuda_logits, cpu_logits):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-3)


@requires_gpu
@pytest.mark.parametrize("model_type, window", [("gpt_oss", 48), ("llama4_text", 56)])
def test_short_steps_past_a_window_on_cuda_read_the_cache_like_the_cpu_reference(model_type, window):
    """Steps of 4 and 7 tokens after a 100-token prefill on a left-padded batch under KIVI's int4 in blocks of 32
    (windowed_short_steps): each of the step's queries sees the stored tokens of its own window (gpt-oss's
    48, with sinks) or chunk (Llama 4's 56, which the step of 7 crosses), the tensor-core kernel masking each query
    row from its own first token, the CPU runtime's logits within 2e-3 (the emulated kernel's test, on the device)."""
    assert_short_steps_on_cuda_give_the_cpu_logits(*windowed_short_steps(model_type, window))


def assert_short_steps_on_cuda_give_the_cpu_logits(model, bundle, ids, mask, steps: list[int]) -> None:
    """The logits of feeding (ids, mask) in `steps` (a prefill, then decode steps and two short steps) on CUDA, both
    short steps read through the CUDA decoder, within 2e-3 of the CPU runtime's."""
    from kvcal.runtime.layer import RuntimeLayer

    with torch.inference_mode():
        cpu_logits = logits_in_steps(model, bundle, ids, mask, steps)
        short_step, served = RuntimeLayer._short_step, []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RuntimeLayer, "_short_step", lambda *args: served.append(short_step(*args)) or served[-1])
            cuda_logits = logits_in_steps(model.cuda(), bundle, ids.cuda(), mask.cuda(), steps)
    assert [out is not None for out in served] == [False] * 2 + [True] * 4  # the prefill's layers, then both steps'
    for got, want in zip(cuda_logits, cpu_logits):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-3)


def _memory(address: int, dtype, count: int) -> np.ndarray:
    """count elements of dtype at a raw (CPU) address: what a kernel would read from a descriptor pointer."""
    ctype = {np.uint16: ctypes.c_uint16, np.uint32: ctypes.c_uint32, np.int32: ctypes.c_int32, np.int16: ctypes.c_int16,
             np.float32: ctypes.c_float}[dtype]
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape=(count,)).copy()


def _halves(address: int, count: int) -> np.ndarray:
    return _memory(address, np.uint16, count).view(np.float16).astype(np.float32)


def _codes(words: np.ndarray, layout: int) -> tuple[np.ndarray, int]:
    """(codes (rows, WIDTH), bits) of packed rows, by common.cuh's code_at formulas."""
    channel = np.arange(WIDTH)
    if layout == 3:  # planes3: low 2 bits in word 3 * unit + half, high bit in word 3 * unit + 2
        unit, i = channel >> 5, channel & 31
        low = (words[:, 3 * unit + ((i >> 4) & 1)] >> (2 * (i & 15))) & 3
        return low | (((words[:, 3 * unit + 2] >> i) & 1) << 2), 3
    bits, per_word = {1: (1, 32), 2: (2, 16), 4: (4, 8), 5: (3, 11)}[layout]
    return (words[:, channel // per_word] >> (channel % per_word * bits)) & (2**bits - 1), bits


def _rows_from_descriptor(side: list[int], lengths: list[int], codec: int, b: int) -> np.ndarray:
    """Sequence b's (tokens, WIDTH) rows read only through a side's CPU descriptor (the CUDA one's fields first) and
    lengths, following the kernels' formulas (segments.cuh's locate, the CPU kernel's body values, row pieces and
    outliers)."""
    sink, body, head, recent = lengths
    f = {field.name.lower(): side[field] for field in cpu_kernel.CpuSideField if field < len(side)}
    parts = [_halves(f["sink"] + 2 * b * f["sink_stride"], sink * WIDTH).reshape(sink, WIDTH)] if sink else []
    if body:
        # a row's pieces (piece_channels each, piece_stride words apart), joined back into whole rows
        channels = f["piece_channels"]
        piece_words = {3: 3 * channels // 32, 5: -(-channels // 11)}.get(f["layout"], channels * f["layout"] // 32)
        at = (np.arange(body)[:, None, None] * f["words_per_row"] + np.arange(WIDTH // channels)[:, None] * f["piece_stride"]
              + np.arange(piece_words)).reshape(body, -1)
        words = _memory(f["words"] + 4 * b * f["words_stride"], np.uint32, int(at.max()) + 1)[at]
        codes, bits = _codes(words, f["layout"])
        channel = np.arange(WIDTH)
        base = b * f["param_stride"]

        def parameters(name: str, rows: int) -> np.ndarray:  # (rows, param_cols): row r, column c at r param_row + c param_column
            at = np.arange(rows)[:, None] * f["param_row"] + np.arange(f["param_cols"]) * f["param_column"]
            return _halves(f[name] + 2 * base, int(at.max()) + 1)[at]

        if codec in (kernel_source.UNIFORM_TOKEN, kernel_source.UNIFORM_CHANNEL):
            rows = body if codec == kernel_source.UNIFORM_TOKEN else body // f["param_extra"]
            scale, zero = (parameters(p, rows) for p in ("param0", "param1"))
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
                lo, hi = (parameters(p, body) for p in ("param0", "param1"))
            values = codebook[codes] * np.maximum((hi - lo) / 2, 1e-8) + (hi + lo) / 2
        if f["outlier_counts"]:  # per (sequence, KV head) run: tile t's outliers from offset[t], the last to the count
            kv_heads, tile_tokens = WIDTH // HEAD_DIM, 1 << f["outlier_tile_shift"]
            counts = _memory(f["outlier_counts"] + 4 * b * kv_heads, np.int32, kv_heads)
            tiles = -(-body // tile_tokens)
            for kv_head, count in enumerate(counts):
                run = b * kv_heads + kv_head
                offsets = _memory(f["outlier_offsets"] + 4 * run * f["offset_stride"], np.int32, tiles)
                tile = np.repeat(np.arange(tiles), np.diff(np.append(offsets, count)))
                positions = _memory(f["outlier_positions"] + 2 * run * f["outlier_stride"], np.uint16, count).astype(np.int64)
                rows, channels = tile * tile_tokens + positions // HEAD_DIM, kv_head * HEAD_DIM + positions % HEAD_DIM
                values[rows, channels] = _halves(f["outlier_values"] + 2 * run * f["outlier_stride"], count)
        parts.append(values)
    if recent:
        parts.append(_halves(f["recent"] + 2 * (b * f["recent_stride"] + head * WIDTH), recent * WIDTH).reshape(recent, WIDTH))
    return np.concatenate(parts) if parts else np.zeros((0, WIDTH), np.float32)


def test_the_tensor_core_operands_refuse_a_body_cut_in_other_pieces_than_its_kv_heads():
    """A body whose rows lie in pieces of another head_dim than the launch's (one a KV head or one a row are what the
    kernel reads) is refused, not read as KV heads."""
    from kvcal.runtime import tensor_core

    keys, values = (PackedRows(codec, 1, WIDTH, "cpu", head_dim=HEAD_DIM // 2) for codec in (ChannelBlockUniform(2, 32), TokenUniform(2, 32)))
    for store in (keys, values):
        store.append(0, seeded_tokens(64, 0))
    assert keys.pieces == 2 * (WIDTH // HEAD_DIM)
    with pytest.raises(KvcalError, match="one piece a KV head"):
        tensor_core.store_operands(keys, values, WIDTH // HEAD_DIM, 1.0, {})


def test_parameter_offsets_past_32_bits_are_refused():
    """The decode kernels index a sequence's parameters with 32-bit offsets: a store holding 2^31 or more per sequence
    is refused when its descriptor is made, not read wrong."""
    huge = torch.empty_strided((1, 1, 2), (2**31, 1, 2**30), dtype=torch.float16, device="meta")
    with pytest.raises(KvcalError, match="2\\^31"):
        kernels.parameter_fields(huge, huge, 1)


@pytest.mark.parametrize("case", CASES)
def test_descriptors_describe_the_stores(case):
    """What the launcher hands the decode kernel (pointers, strides, parameter tables, lengths) reads back,
    by the kernel's own formulas, as the stores' reference read: checked on CPU stores of every case."""
    key_codec, value_codec, policy, rpc, _, layout = CASES[case]()
    lengths = [3, G + 5, R + 1, 300]
    for codec, keys in ((key_codec, True), (value_codec, False)):
        store = SegmentedStore(codec, policy, keys, rpc, len(lengths), WIDTH, "cpu", layout, head_dim=HEAD_DIM)
        for b, n in enumerate(lengths):
            x = seeded_tokens(n, b)
            store.append(b, x[: n - 2])
            store.append(b, x[n - 2 : n - 1])
            store.append(b, x[n - 1 :])
        (segments,) = store.kernel_segments()
        side = cpu_kernel.side_descriptor(*segments)
        for b, row in enumerate(kernels.side_lengths(*segments, len(lengths))):
            read = _rows_from_descriptor(side, row, kernels.codec_id(codec), b)
            np.testing.assert_allclose(read, store.read(b).numpy(), rtol=0, atol=1e-6)
