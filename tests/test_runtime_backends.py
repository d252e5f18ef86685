"""kvcal.runtime.backends: which backend serves a layer's decode steps and appends, why not a faster one, and that
what the planner says of a bundle is what the runtime binds (the emulated CUDA kernels' side of that is checked in
tests/test_kernel_emulation.py)."""

import pytest
import torch

from helpers import decode_token_by_token
from helpers.tiny_models import MISTRAL_LARGE4, tiny_model
from kvcal.bundle import load_bundle
from kvcal.runtime import backends, cpu_kernel


def test_the_planner_names_the_cpu_kernel_for_every_recipe_it_reads_and_the_reference_with_its_reason(recipe_bundles,
                                                                                                      monkeypatch):
    for recipe in ("kvquant", "mixed", "kivi", "kvmix", "skvq"):
        plans = backends.bundle_plan(load_bundle(recipe_bundles[recipe]), "cpu")
        assert {(p.bodies, p.why, p.short_steps) for p in plans} == {("cpu-kernel", "", 128)}, recipe
    monkeypatch.setattr(cpu_kernel, "library", lambda: None)
    plans = backends.bundle_plan(load_bundle(recipe_bundles["kvquant"]), "cpu")
    assert {(p.bodies, p.short_steps) for p in plans} == {("reference", 0)}
    assert "not cpu-kernel: the CPU kernel is not built here" in plans[0].why


def test_a_decoding_layer_binds_the_planned_backend_and_keeps_why(recipe_bundles):
    bundle = load_bundle(recipe_bundles["kivi"])
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, cache = decode_token_by_token(tiny_model("llama"), bundle, ids)
    plans = backends.bundle_plan(bundle, "cpu")
    assert [layer.decode_path for layer in cache.layers] == [p.bodies for p in plans] == ["cpu-kernel"] * len(plans)
    assert cache.layers[0].choice.why() == "not cuda-kernels: not a CUDA device with CuPy (cpu)"


def decode_paths(architecture_bundles, model_type: str, recipe: str, tokens: int = 12):
    """(bundle, each layer's decode path) of the tiny model's `recipe` bundle decoding a batch of two prompts."""
    bundle = load_bundle(architecture_bundles(model_type)[recipe])
    ids = torch.randint(3, 512, (2, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, cache = decode_token_by_token(tiny_model(model_type), bundle, ids)
    return bundle, [layer.decode_path for layer in cache.layers]


def test_latent_attention_decodes_on_the_cpu_kernel_and_on_cuda_on_the_reference(architecture_bundles):
    """MLA (kvcal.adapters.LatentAttention): the CPU kernel reads the latent (its query's latent part scoring it), the
    tensor-core kernel does not yet, so on CUDA its layers decode on the batched torch reference, as the plan says
    with the reason; its appends use the compiled encoders at each tensor's own width."""
    bundle, paths = decode_paths(architecture_bundles, "deepseek_v3", "kivi")
    assert paths == ["cpu-kernel", "cpu-kernel"]
    assert {p.bodies for p in backends.bundle_plan(bundle, "cpu")} == {"cpu-kernel"}
    plans = backends.bundle_plan(bundle, "cuda")
    assert {p.bodies for p in plans} == {"reference"}
    assert all(p.why == f"not cuda-kernels: {backends.LATENT_REFUSAL}" for p in plans)
    assert {(p.key_append, p.value_append) for p in backends.bundle_plan(bundle, "cpu")} == {("cpu-append", "cpu-append")}


@MISTRAL_LARGE4
def test_a_latent_layer_storing_no_key_decodes_on_the_cpu_kernel_its_key_appended_by_the_torch_codec(architecture_bundles):
    """Mistral Large 4's layer 1, without RoPE, stores no key: the CPU kernel scores its latent alone, and its key's
    appends (nothing to encode) go to the torch codec, as the plan says. (A context within its indexer's pick of 8:
    past it a step attends over the pick on the reference.)"""
    bundle, paths = decode_paths(architecture_bundles, "mistral_large4", "kvquant", tokens=7)
    assert paths == ["cpu-kernel", "cpu-kernel"]
    plans = backends.bundle_plan(bundle, "cpu")
    assert [(p.bodies, p.key_append) for p in plans] == [("cpu-kernel", "cpu-append"), ("cpu-kernel", "torch codec")]


def test_values_narrower_than_keys_decode_on_the_cpu_kernel_and_on_cuda_on_the_reference(architecture_bundles):
    """MiMo-V2-Flash's values (16 channels a KV head beside keys of 32): the CPU kernel reads them at their width, the
    tensor-core kernel reads values as wide as keys, so on CUDA they decode on the torch reference, as the plan says."""
    bundle, paths = decode_paths(architecture_bundles, "mimo_v2_flash", "kvquant")
    assert paths == ["cpu-kernel", "cpu-kernel"]
    plans = backends.bundle_plan(bundle, "cuda")
    assert {p.bodies for p in plans} == {"reference"}
    assert all(p.why == "not cuda-kernels: values of 16 channels a KV head beside keys of 32: the tensor-core kernel reads "
               "values as wide as keys" for p in plans)


def test_the_cuda_plan_says_which_bodies_the_tensor_core_kernel_reads_and_why_not_the_others(head_dim_64_bundles, recipe_bundles):
    plan = {name: backends.bundle_plan(load_bundle(head_dim_64_bundles[name]), "cuda") for name in ("kvquant", "kivi", "nuq4-0%")}
    assert {p.bodies for p in plan["kvquant"]} == {p.bodies for p in plan["nuq4-0%"]} == {"tensor-core"}
    # GQA 2: a step's queries in at most 8 passes of 8 query heads a KV head
    assert {p.short_steps for p in plan["kvquant"]} == {32}
    assert {(p.key_append, p.value_append) for p in plan["kvquant"]} == {("cuda-append", "cuda-append")}
    # its sink: fp16 rows of both sides, in the tensor-core launch
    assert {p.fp16_segments for p in plan["kvquant"]} == {p.fp16_segments for p in plan["nuq4-0%"]} == {"tensor-core"}
    kivi = plan["kivi"][0]  # 2-bit codes in groups of 4 channels: no tensor-core variant, so the torch reference
    assert (kivi.bodies, kivi.fp16_segments, kivi.short_steps) == ("reference", "reference", 0)
    assert kivi.why.startswith("not cuda-kernels: int2 per channel g4 / int2 per token g4: key blocks of 4 tokens")
    # keys wait fp16 for a block while values are packed: the segment blocks read uniform bodies too
    kivi4 = backends.bundle_plan(load_bundle(head_dim_64_bundles["kivi4-g32"]), "cuda")[0]
    assert (kivi4.bodies, kivi4.fp16_segments, kivi4.why) == ("tensor-core", "tensor-core", "")
    skvq = backends.bundle_plan(load_bundle(head_dim_64_bundles["skvq"]), "cuda")[0]  # SKVQ's permuted groups
    assert (skvq.bodies, skvq.key_append, skvq.value_append) == ("tensor-core", "cuda-append", "cuda-append")
    tiny = backends.bundle_plan(load_bundle(recipe_bundles["skvq"]), "cuda")[0]  # head_dim 16
    assert (tiny.bodies, tiny.key_append) == ("reference", "cuda-append")  # the append kernel takes any head_dim
    assert tiny.why.startswith("not cuda-kernels: they read head_dim ")


def test_soft_capped_scores_decode_on_the_cpu_kernel_and_on_the_tensor_core_kernel(architecture_bundles):
    """Gemma 2's capped scores: both kernels cap them (at head_dim 64 on CUDA, which the tiny model's 16 is not)."""
    from helpers.tiny_bundles import kivi_bundle
    from helpers.tiny_models import tiny_model

    bundle = load_bundle(architecture_bundles("gemma2")["kvquant"])
    assert {(p.bodies, p.why) for p in backends.bundle_plan(bundle, "cpu")} == {("cpu-kernel", "")}
    bundle = kivi_bundle(tiny_model("gemma2", head_dim=64), 4, 32, 32)
    assert {(p.bodies, p.why) for p in backends.bundle_plan(bundle, "cuda")} == {("tensor-core", "")}


def test_no_recipe_falls_to_the_torch_reference_or_a_second_decode_kernel_on_cuda(head_dim_64_bundles):
    """Every recipe's bodies and fp16 segments at head_dim 64 are the tensor-core kernel's, in one launch a step (the
    reference dequantizes the whole cache every step): KIVI at its own groups of 32 (the kivi bundle's groups of 4
    channels are the reference's), and the other widths the fixtures hold."""
    from kvcal import registry

    names = [*(recipe for recipe in registry.recipes() if recipe != "kivi"), "kivi2-g32", "kivi3-g32", "kivi4-g32",
             "kvmix-two-widths", "skvq-k3v1", "kvquant-post-rope"]
    for name in names:
        for plan in backends.bundle_plan(load_bundle(head_dim_64_bundles[name]), "cuda"):
            assert (plan.bodies, plan.fp16_segments in ("tensor-core", "-")) == ("tensor-core", True), (name, plan)


def test_the_tensor_core_kernel_reads_every_whole_bit_width_the_recipes_offer():
    """Beyond each recipe's defaults: KIVI and KVmix's uniform 2-4-bit codes in groups of 32, 64 and 128 (K and V
    widths apart too), nuq2-4 (pre- and post-RoPE keys, with outliers and without), SKVQ's 1-4-bit channel groups with fp16
    or fp8 parameters, at head_dim 64, 128 and 256 and GQA 1 to 16; what it does not read keeps a reason (the torch
    reference serves it)."""
    from helpers.kernel_cases import equal_skvq_groups
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook

    kv_heads, widths = 2, (2, 3, 4)

    def refusal(pair, head_dim, pre_rope=False):
        return [backends.cuda_refusal(backends.LayerShape((pair,), pre_rope, kv_heads * gqa, kv_heads, head_dim, torch.device("cuda")))
                for gqa in (1, 4, 16)]

    for head_dim in (64, 128, 256):
        for k, v, group in ((k, v, g) for k in widths for v in widths for g in (32, 64, 128)):
            assert refusal((ChannelBlockUniform(k, group), TokenUniform(v, group)), head_dim) == [None] * 3, (k, v, group)
        for k, v in ((k, v) for k in widths for v in widths):
            lo, hi = -torch.ones(kv_heads * head_dim), torch.ones(kv_heads * head_dim)
            for fraction, pre_rope in ((f, r) for f in (0.01, 0.0) for r in (True, False)):
                pair = (CodebookCodec(normal_float_codebook(k), lo, hi, outlier_fraction=fraction),
                        CodebookCodec(normal_float_codebook(v), outlier_fraction=fraction))
                assert refusal(pair, head_dim, pre_rope) == [None] * 3, (k, v, fraction, pre_rope)
        for k, v, fp8 in ((k, v, fp8) for k in (1, *widths) for v in (1, *widths) for fp8 in (False, True)):
            pair = tuple(equal_skvq_groups(kv_heads * head_dim, 8, bits, fp8, seed=bits) for bits in (k, v))
            assert refusal(pair, head_dim, pre_rope=True) == [None] * 3, (k, v, fp8)
    (small_groups,) = set(refusal((ChannelBlockUniform(2, 16), TokenUniform(2, 16)), 128))
    assert small_groups == "int2 per channel g16 / int2 per token g16: value groups of 16 channels with 2-bit codes and head_dim 128 are not served"


def test_codebook_bodies_whose_k_and_v_keep_different_fp16_tokens_go_to_the_reference_on_cuda():
    """The tensor-core kernel's segment blocks read fp16 rows beside codebook and SKVQ bodies only where K and V keep
    the same tokens fp16 (no recipe keeps them otherwise); uniform bodies' rows they read themselves."""
    from kvcal.kv import SegmentPolicy
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook
    from kvcal.runtime.segments import fp16_rows_alike

    lo, hi = -torch.ones(128), torch.ones(128)
    nuq = (CodebookCodec(normal_float_codebook(3), lo, hi, 0.01), CodebookCodec(normal_float_codebook(3), outlier_fraction=0.01))
    kivi = (ChannelBlockUniform(2, 32), TokenUniform(2, 32))
    assert fp16_rows_alike(SegmentPolicy(sink=1, window=8), (1, 1), (0.1, 0.1))
    assert not fp16_rows_alike(SegmentPolicy(residual=32), (1, 1), (0.0, 0.0))
    assert not fp16_rows_alike(SegmentPolicy(), (1, 1), (0.1, 0.0))
    shape = lambda pair, alike: backends.LayerShape((pair,), True, 4, 1, 128, torch.device("cuda"), alike)  # noqa: E731
    assert backends.cuda_refusal(shape(nuq, True)) is None and backends.cuda_refusal(shape(kivi, False)) is None
    assert backends.cuda_refusal(shape(nuq, False)).startswith("K and V keep different tokens fp16 beside nuq3 ")


def test_an_unknown_device_is_refused(recipe_bundles):
    with pytest.raises(backends.KvcalError, match="device 'gpu': say cpu or cuda"):
        backends.bundle_plan(load_bundle(recipe_bundles["kivi"]), "gpu")


def test_the_runtime_dispatches_on_the_kind_a_codec_declares():
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, CodecKind, TokenUniform
    from kvcal.rotation_codecs import HadamardInt
    from kvcal.runtime import kernel_source as src
    from kvcal.runtime import kernels

    book = torch.linspace(-1, 1, 8)
    per_token, per_channel = CodebookCodec(book), CodebookCodec(book, lo=-torch.ones(64), hi=torch.ones(64))
    assert (per_token.kind, per_channel.kind) == (CodecKind.CODEBOOK_TOKEN, CodecKind.CODEBOOK_CHANNEL)
    ids = [kernels.codec_id(c) for c in (TokenUniform(2, 32), ChannelBlockUniform(2, 32), per_channel, per_token)]
    assert ids == [src.UNIFORM_TOKEN, src.UNIFORM_CHANNEL, src.CODEBOOK_CHANNEL, src.CODEBOOK_TOKEN]
    simulated = HadamardInt(3, 64)  # another engine's type: `eval ppl` simulates it, no runtime store reads it
    assert simulated.kind is CodecKind.SIMULATED and kernels.codec_id(simulated) is None
    shape = backends.LayerShape(((simulated, simulated),), False, 4, 1, 64, torch.device("cpu"))
    assert backends.CpuKernel().refusal(shape) == "it reads no simulated 3-bit / simulated 3-bit bodies"
