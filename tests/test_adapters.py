import pytest
import torch
import transformers

from helpers import attention_at
from helpers.tiny_models import (ALTERNATING, CROSS_ATTENDING, DOTS3_NOTE, DSA, GEMMA4, GLM5_NEXT, GRANITE_SWA, HYBRID,
                                 HY_V4, LATENT, MINICPM_V, MINIMAX_M3, MINIMAX_M3_BLOCK, MISTRAL_LARGE4, MUSE,
                                 QWEN3_5_MROPE, QWEN4_EXP, TINY_ARCHITECTURES, TINY_WINDOW, from_transformers, known,
                                 longrope, tiny_latent_widths, tiny_model)
from kvcal.adapters import adapt, decoder_of, query_heads, rope_orders, score_scale
from kvcal.adapters.model_types import (LATENT_ATTENTION_TYPES, LATENT_DECODERS, NOT_TAKEN_YET, SERVED_ONES,
                                        SUPPORTED_MODEL_TYPES)
from kvcal.errors import KvcalError
from kvcal.model_caches import CACHE_ARGUMENT, cache_argument
from kvcal.rope import apply_rope
from kvcal.version import transformers_from

NORMED_KEYS = ("qwen3", "qwen3_moe", "olmo2", "olmo3", "exaone4", "exaone_moe", "kolibri1", "beam", "apertus", "cohere", "glm4_moe", "stablelm",
               "olmoe", "minimax_m2", "mellum", "flex_olmo", "afmoe", "gemma3_text", "gemma3", "hy_v3", "dots1",
               "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "lfm2", "lfm2_moe", "gemma3n_text",
               "qwen3_vl", "qwen3_vl_moe", "persimmon", "fuyu", "lfm3", "flint", "hunyuan_v1_dense", "hunyuan_v1_moe", "laguna", *MINIMAX_M3,
               "lfm2_vl", "lighton_ocr", "exaone4_5", "lfm3_vl", "hunyuan_vl", "qwen3_omni_moe_thinker", "step3p7", "qianfan_ocr",
               "cosmos3_omni", *MINICPM_V, "molmo2", "param2moe", "sarvam_moe", "lara_mini", "llava_onevision1_5", "ovis2_5",
               "ergo", "apertus1p5_text", "apertus1p5", "qwen4_exp_text", "qwen4_exp", *GEMMA4)
KV_SHARING = ("gemma3n_text", *GEMMA4)  # their decoder layers 2 and 3 read layers 0's and 1's keys and values
# OLMo 3, Mellum, Gemma 3, 3n and 4, MiMo-V2-Flash by layer type, Granite MoE SWA by RoPE base; the others (Aya Vision
# and Command A Vision: Cohere 2's; EXAONE 4.5: EXAONE 4's) for their NoPE layer
PER_LAYER_FREQUENCIES = ("olmo3", "smollm3", "exaone4", "exaone_moe", "kolibri1", "beam", "cohere2", "mellum", "afmoe", "flint",
                         "gemma3_text", "gemma3", "gemma3n_text", *GEMMA4, "aya_vision", *GRANITE_SWA, "llama4_text", "llama4",
                         "lfm3", "lfm3_vl", "mimo_v2_flash", "laguna", "cohere_compass_text", "cohere_compass", "cohere2_vision",
                         "exaone4_5", *MUSE, "step3p7", "molmo2", "lara_mini", "ergo", "modernbert-decoder")
WINDOWS = {"mistral": [4096, 4096], "idefics2": [4096, 4096], "mimo_v2_flash": [None, TINY_WINDOW],  # per layer
           "modernbert-decoder": [None, TINY_WINDOW],
           **{kind: [TINY_WINDOW, None] for kind in (*ALTERNATING, "aya_vision", "cohere2_vision", "exaone4_5", "lfm3", "lfm3_vl",
                                                     *MUSE, "lara_mini")}}


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_adapter_finds_projections_heads_and_rope(model_type):
    model = tiny_model(model_type)
    adapter = adapt(model)
    # Llama 4's and Qwen3.5's composites are named as the causal LM of their decoder (what their checkpoints load as)
    served_as = {"llama4": "llama4_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text",
                 "mllama": "mllama_text_model", "emu3": "emu3_text_model"}
    assert adapter.model_type == served_as.get(model_type, model_type) and len(adapter.layers) == 2
    # GPT-NeoX, OPT, BioGPT, GPT-2, GPT-J, CodeGen, Persimmon (and Fuyu's) and ModernBERT's decoder have no GQA,
    # GPT-BigCode one KV head (multi_query, of 32 channels)
    kv_heads = (4 if model_type in ("gpt_neox", "opt", "biogpt", "gpt2", "persimmon", "fuyu", "gptj", "codegen",
                                    "modernbert-decoder") else
                1 if model_type == "gpt_bigcode" else 2)
    # Gemma 4's full layer: half the KV heads of its sliding one, of twice the channels; MiMo-V2-Flash's sliding layer
    # twice the KV heads of its full one, of 32 channels, its values narrower (16) and scaled after v_proj
    shapes = ([(2, 16), (1, 32)] if model_type in GEMMA4 else [(1, 32)] * 2 if model_type == "gpt_bigcode" else
              [(2, 32), (4, 32)] if model_type == "mimo_v2_flash" else [(kv_heads, 16)] * 2)
    # Laguna's and Step 3.7's sliding layer: twice the query heads of its full one
    assert adapter.query_heads == ([8, 4] if model_type in ("laguna", "step3p7") else [4, 4])
    assert list(zip(adapter.kv_heads, adapter.head_dims)) == shapes
    assert adapter.kv_widths == [heads * head_dim for heads, head_dim in shapes]
    assert adapter.value_widths == ([32, 64] if model_type == "mimo_v2_flash" else adapter.kv_widths)
    assert [layer.value_multiplier for layer in adapter.layers] == [0.707 if model_type == "mimo_v2_flash" else 1.0] * 2
    # hybrids: layers with a state between; Mllama's: layers attending across to an image between
    assert adapter.model_layers == ((1, 3) if model_type in (*HYBRID, *CROSS_ATTENDING) else (0, 1))
    assert list(adapter.cross_attention) == ([0, 2] if model_type in CROSS_ATTENDING else [])
    assert adapter.keeps_state == [model_type == "falcon_h1"] * 2  # Falcon-H1: Mamba 2 beside every attention
    # Falcon-H1's keys scaled by its key_multiplier; Ergo's queries and keys on its full layer by qk_scale (2 ** 0.5)
    assert [layer.key_multiplier for layer in adapter.layers] == (
        [1.0, pytest.approx(2 ** 0.5)] if model_type == "ergo" else [0.7 if model_type == "falcon_h1" else 1.0] * 2)
    assert [layer.query_multiplier for layer in adapter.layers] == (
        [1.0, pytest.approx(2 ** 0.5)] if model_type == "ergo" else [1.0] * 2)
    # Gemma 3n: decoder layers 2 and 3 read layers 0's and 1's keys and values
    assert [(r.decoder_index, r.source) for r in adapter.readers] == ([(2, 0), (3, 1)] if model_type in KV_SHARING else [])
    attention = attention_at(model, adapter.model_layers[1])
    # Phi-3's, Phi-4-multimodal's, DBRX's, GPT-NeoX's, Persimmon's, Falcon's, CodeGen's, GPT-2's and Ergo's q, k and v:
    # one linear (GPT-2's: a Conv1D); JetMoE's k and v (its queries its attention experts')
    key_projection = getattr(attention, {"phi3": "qkv_proj", "phi4_multimodal": "qkv_proj", "dbrx": "Wqkv", "gpt_neox": "query_key_value",
                                         "persimmon": "query_key_value", "fuyu": "query_key_value", "falcon": "query_key_value",
                                         "codegen": "qkv_proj",
                                         "gpt2": "c_attn",
                                         "gpt_bigcode": "c_attn", "ergo": "qkv_proj", "jetmoe": "kv_proj"}.get(model_type, "k_proj"))
    assert adapter.layers[1].k_proj is key_projection
    # JetMoE's query heads: a tile of the 2 KV heads for each of its 2 attention experts
    assert [layer.query_tiles for layer in adapter.layers] == [2 if model_type == "jetmoe" else 1] * 2
    assert adapter.layers[1].value_source is getattr(attention, "v_norm", adapter.layers[1].v_proj)  # Gemma 3n, 4: v_norm
    # Gemma 4's full layer: no v_proj, the value is v_norm of k_proj's output
    assert [layer.value_from_key_projection for layer in adapter.layers] == [False, model_type in GEMMA4]
    has_norm = model_type in NORMED_KEYS
    assert (adapter.layers[1].k_norm is not None) == has_norm
    key_norm = next((norm for name in ("k_norm", "k_layernorm", "key_layernorm")  # StableLM, LFM2: k_layernorm; Hunyuan
                     if (norm := getattr(attention, name, None)) is not None), None)
    assert adapter.layers[1].key_source is (key_norm if has_norm else key_projection)
    # Gemma 4's rows padded to its full layer's 16 frequencies; MiMo-V2-Flash's heads of 32 channels, half rotated
    frequencies = ((2, 16) if model_type in (*GEMMA4, "mimo_v2_flash") else (2, 8) if model_type in PER_LAYER_FREQUENCIES else
                   (16,) if model_type == "gpt_bigcode" else (8,))
    assert adapter.inv_freq.shape == frequencies and adapter.max_positions == 256
    assert adapter.windows == WINDOWS.get(model_type, [None, None])
    assert adapter.chunks == ([TINY_WINDOW, None] if model_type.startswith("llama4") else [None, None])  # Llama 4's first layer
    assert adapter.fingerprint()["num_kv_heads"] == kv_heads


def assert_kvcal_rotates_the_pre_rope_keys_as(model, tokens: int = 12) -> None:
    """The model's own cached (post-RoPE) keys of a forward over `tokens` tokens are kvcal.rope's rotation of the key
    source's output by each layer's frequencies and cos/sin scaling, at every position, both in kvcal's channel order."""
    adapter = adapt(model)
    sources = {}
    hooks = [layer.key_source.register_forward_hook(lambda module, args, out, i=i: sources.__setitem__(i, out))
             for i, layer in enumerate(adapter.layers)]
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE_ARGUMENT)
        if cache is None:  # (Granite 4 Vision's decoder makes none of its own: generate() hands it one)
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            model(ids, **cache_argument(cache), use_cache=True)
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(adapter.layers):
        pre_rope = layer.source_rows("k", sources[i])[0].view(tokens, adapter.kv_heads[i], adapter.head_dims[i])
        positions = torch.arange(tokens) + adapter.first_position  # (PaliGemma's count from 1)
        rotated = apply_rope(pre_rope, positions, adapter.layer_inv_freq(i, tokens), adapter.layer_rope_scaling(i))
        cached = adapter.in_rope_order(cache.layers[adapter.model_layers[i]].keys[0].transpose(0, 1), i)
        torch.testing.assert_close(rotated, cached, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_kvcal_rotates_the_pre_rope_keys_as_the_model_does(model_type):
    """What the runtime and the fits assume of every supported architecture. Weights drawn wide (std 0.25) so that the
    keys are far from zero and a wrong rotation shows."""
    assert_kvcal_rotates_the_pre_rope_keys_as(tiny_model(model_type, initializer_range=0.25))


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_caches_its_rotated_key_and_its_latent_as_the_model_does(model_type):
    """MLA (kvcal.adapters.LatentAttention): one KV head, whose key is the rotated part of kv_a_proj_with_mqa's output
    and whose value is the latent, kv_a_layernorm's output: what transformers' cache holds for the layer (its latent in
    the key slot, its rotated key in the value slot), the key rotated by kvcal as the model rotates it, in kvcal's
    channel order where RoPE leaves it so (rope_interleave's, bailing_hybrid's, DeepSeek-V3.2's, GLM-5's, A.X K2's,
    LongCat-Flash's, Hy V4's from transformers 5.25), else in the model's; LongCat-Flash's latent cached times its
    mla_scale_kv_lora, dots.note3's times its kv_lora_scale. Mistral Large 4's layer 1, without RoPE, caches its latent
    alone (a rotated key of no channel); dots.note3's sliding layers cache a latent and a rotated key narrower than its
    others' (the fingerprint's layer_value_dims)."""
    model = tiny_model(model_type, initializer_range=0.25)
    adapter = adapt(model)
    config = model.config.get_text_config(decoder=True)  # (Kimi K2.5's: its DeepSeek-V3 decoder's)
    widths, latents, index = tiny_latent_widths(model_type)
    assert (adapter.kv_heads, adapter.head_dims, adapter.value_dims) == ([1] * len(widths), widths, latents)
    assert adapter.latent and adapter.fingerprint()["value_dim"] == 96 and adapter.value_widths == latents
    assert adapter.fingerprint().get("layer_value_dims") == (latents if len(set(latents)) > 1 else None)
    # an indexer's keys, which the cache keeps beside the rotated key and the latent
    assert adapter.index_widths == index and adapter.fingerprint().get("layer_index_dims") == (index if any(index) else None)
    assert [handles.sparse for handles in adapter.layers] == [model_type in DSA + GLM5_NEXT or bool(width) for width in index]
    attention = attention_at(model, adapter.model_layers[1])  # (Kimi Linear's after a KDA layer)
    handles = adapter.layers[1]
    # (dots.note3's rotated key: kv_a_proj_with_mqa's part normed, with a scale, before RoPE)
    key_source = attention.k_rope_only_layernorm if model_type in DOTS3_NOTE else attention.kv_a_proj_with_mqa
    assert handles.key_source is key_source and handles.value_source is attention.kv_a_layernorm
    # q_b_proj where the query is of a low rank (Ling's never is), q_gate_proj where it is fused with a gate (A.X K2's)
    query = next(getattr(attention, name) for name in ("q_proj", "q_b_proj", "q_gate_proj")
                 if getattr(attention, name, None) is not None)
    assert handles.q_proj is query
    assert handles.value_multiplier == getattr(attention, "mla_scale_kv_lora", getattr(attention, "kv_lora_scale", 1.0))
    interleaved = (model_type in ("deepseek_v2", "bailing_hybrid", "deepseek_v32", "glm_moe_dsa", "axk2", "longcat_flash",
                                  "mistral_large4", *DOTS3_NOTE)
                   or getattr(config, "rope_interleave", False) or model_type in HY_V4 and transformers_from(5, 25))
    assert [order is not None for order in adapter.rope_orders] == [interleaved and width > 0 for width in widths]
    sources, tokens = {}, 12
    hooks = [module.register_forward_hook(lambda module, args, out, kind=kind, i=i: sources.__setitem__((kind, i), out))
             for i, layer in enumerate(adapter.layers)
             for kind, module in (("k", layer.key_source), ("v", layer.value_source))]
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE_ARGUMENT)
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(adapter.layers):
        pre_rope = layer.source_rows("k", sources["k", i])[0].view(tokens, 1, widths[i])
        rotated = apply_rope(pre_rope, torch.arange(tokens), adapter.layer_inv_freq(i, tokens), adapter.layer_rope_scaling(i))
        cached = cache.layers[adapter.model_layers[i]].values[0].transpose(0, 1)
        cached = cached if layer.latent.rope_in_order else adapter.in_rope_order(cached, i)
        torch.testing.assert_close(rotated, cached, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.source_rows("v", sources["v", i])[0], cache.layers[adapter.model_layers[i]].keys[0, 0])


@MISTRAL_LARGE4
def test_latent_layers_reading_another_layers_latent_are_refused():
    """Mistral Large 4's kv_source_layers: a layer attending over an earlier layer's latent cache (its own indexer
    keys kept) is not served yet, refused in one line before anything runs."""
    with pytest.raises(KvcalError, match=r"its layers read other layers' latent caches \(kv_source_layers"):
        adapt(tiny_model("mistral_large4", no_rope_layers=[1, 1], kv_source_layers=[0, 0]))


@MISTRAL_LARGE4
def test_mistral_large4_as_released_caches_no_rotated_key_on_every_fourth_layer(tmp_path):
    """Its default config (its released shapes, built on the meta device): every fourth layer, without RoPE, caches its
    latent of 512 channels alone; the others a rotated key of 64 beside it; every layer keeps indexer keys of 128."""
    from transformers import AutoConfig

    from kvcal.models import load_model_structure

    AutoConfig.for_model("mistral_large4").save_pretrained(tmp_path)
    adapter = adapt(load_model_structure(str(tmp_path))[0])
    assert adapter.head_dims == [0 if layer % 4 == 3 else 64 for layer in range(72)]
    assert adapter.value_dims == [512] * 72 and adapter.index_widths == [128] * 72
    assert adapter.rotated == [layer % 4 != 3 for layer in range(72)]


@pytest.mark.skipif("minicpm5_moe" not in TINY_ARCHITECTURES, reason="MiniCPM 5 MoE is new in transformers 5.24")
def test_a_query_projected_beside_its_gate_is_read_as_each_heads_query():
    """MiniCPM 5 MoE's q_gate_proj holds each head's query, then its output gate (as its attention chunks each head's
    2 x head_dim outputs): kvcal reads the first half of each head's, never a gate channel."""
    model = tiny_model("minicpm5_moe")
    adapter = adapt(model)
    outputs = []
    hook = adapter.layers[1].query_source.register_forward_hook(lambda module, args, out: outputs.append(out))
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0)))
    hook.remove()
    assert adapter.layers[1].query_source is attention_at(model, 1).q_gate_proj
    query, gate = outputs[0].view(1, 12, 4, 32).chunk(2, dim=-1)
    assert torch.equal(adapter.layers[1].source_rows("q", outputs[0]), query.flatten(2))
    assert not torch.equal(query, gate)


@pytest.mark.skipif("ergo" not in TINY_ARCHITECTURES, reason="Ergo is new in transformers 5.25")
def test_queries_and_keys_scaled_after_their_norm_are_read_scaled(monkeypatch):
    """Ergo's full layer (no RoPE) multiplies its normed queries and keys by qk_scale before attending: kvcal's queries
    and keys are the norms' output times it, what the attention is handed (its sliding layer's are not scaled)."""
    model = tiny_model("ergo")
    adapter = adapt(model)
    normed, handed = {}, []
    hooks = [module.register_forward_hook(lambda m, args, out, key=(kind, i): normed.__setitem__(key, out))
             for i, layer in enumerate(adapter.layers) for kind, module in (("q", layer.query_source), ("k", layer.key_source))]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda query, key, *args, **kwargs: handed.append((query, key)) or sdpa(query, key, *args, **kwargs))
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    query, key = handed[1]  # the full layer's: (batch, heads, tokens, head_dim), no RoPE
    assert adapter.layers[1].query_multiplier == adapter.layers[1].key_multiplier == pytest.approx(2 ** 0.5)
    for kind, handed_rows in (("q", query), ("k", key)):  # (kvcal's rows in its channel order: Ergo's RoPE interleaves)
        expected = adapter.rows_in_rope_order(handed_rows.transpose(1, 2).flatten(2), 1)
        torch.testing.assert_close(adapter.layers[1].source_rows(kind, normed[kind, 1]), expected)
    assert adapter.layers[0].query_multiplier == adapter.layers[0].key_multiplier == 1.0


def test_cocktails_cache_refuses_latent_attention_as_yet():
    """Cocktail's cache refuses an MLA model in one line naming what serves it (export vllm too: tests/test_cli.py)."""
    from kvcal.policy.cocktail import cocktail_cache

    with pytest.raises(KvcalError, match=r"deepseek_v3: kvcal serves its multi-head latent attention \(MLA\) in "
                                         r"calibration, `kvcal eval ppl` and its quantized cache so far; Cocktail's cache "
                                         "does not take it yet"):
        cocktail_cache(tiny_model("deepseek_v3"))


def test_bidirectional_attention_is_refused():
    """Gemma 3's use_bidirectional_attention (its embedding models'): kvcal's cache and fits attend causally."""
    with pytest.raises(KvcalError, match=r"its attention is bidirectional \(is_causal False\)"):
        adapt(tiny_model("gemma3_text", use_bidirectional_attention=True))


@pytest.mark.parametrize("model_type, minor", [("hunyuan_vl", 20), ("deepseek_v32", 18)])
def test_a_model_type_served_from_a_later_transformers_is_refused_naming_that_release(monkeypatch, model_type, minor):
    """HunYuan VL is served from transformers 5.20, DeepSeek-V3.2 from 5.18: under an older release (one pretended here,
    5.17 in its quick run) each is refused in one line naming the release to install."""
    model = tiny_model(model_type)
    monkeypatch.setattr("kvcal.adapters.model_types.transformers_from", lambda *release: release < (5, minor))
    with pytest.raises(KvcalError, match=rf"serves it from transformers 5\.{minor}.*pip install 'transformers>=5\.{minor}'"):
        adapt(model)


@pytest.mark.parametrize("model_type", ["gemma2", "vaultgemma"])
def test_soft_capped_scores_under_sdpa_are_refused(model_type):
    """Gemma 2's and VaultGemma's scores are soft-capped, which transformers' SDPA (their default before 5.21) leaves
    out: a profile or a cache of that model would not follow the one kvcal's attention computes, so it is refused."""
    model = tiny_model(model_type)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(KvcalError, match="soft-caps its attention scores.*attn_implementation='eager'"):
        adapt(model)


@pytest.mark.parametrize("kind, refusal", [
    ("compressed_sparse_attention", r"its layer types \['compressed_sparse_attention'\] are not ones kvcal serves"),
    pytest.param("indexed_attention", r"decoder layer 0: an indexed layer whose attention has no indexer of key blocks",
                 marks=from_transformers(5, 18, "the indexed_attention layer type")),
    ("minimax_m3_sparse", r"decoder layer 0: an indexed layer whose attention has no indexer of key blocks"),
])
def test_layer_types_other_than_attention_and_a_recurrent_state_are_refused(kind, refusal):
    """DeepSeek-V4's compressed sparse attention is no attention kvcal computes; an indexer's pick (each query reads
    what an indexer picks) it serves in MLA (DeepSeek-V3.2's tokens) and from an indexer of key blocks beside GQA
    (MiniMax-M3's), which a Llama's attention does not have."""
    with pytest.raises(KvcalError, match=refusal):
        adapt(tiny_model("llama", layer_types=[kind, "full_attention"]))


@pytest.mark.parametrize("model_type", MINIMAX_M3)
def test_block_sparse_layers_pick_key_blocks_with_their_own_indexer(model_type):
    """MiniMax-M3's block-sparse layer (minimax_m3_sparse) is sparse: its attention's indexer picks blocks of 4 keys
    per KV head and keeps keys of its own, 16 channels a token, which the fingerprint counts; its full layer reads
    every key and keeps none."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    assert [(handles.sparse, handles.pick_block) for handles in adapter.layers] == [(True, MINIMAX_M3_BLOCK), (False, 1)]
    assert adapter.layers[0].indexer is attention_at(model, 0).indexer
    assert adapter.layers[1].indexer is None
    assert adapter.index_widths == [16, 0] and adapter.fingerprint()["layer_index_dims"] == [16, 0]


@QWEN4_EXP
def test_qsa_layers_pick_tokens_in_their_mask_with_their_own_indexer():
    """Qwen4-Exp's QSA layers (decoder layers 1 and 3, after gated DeltaNet ones) are sparse: each one's indexer picks
    the tokens its queries attend and hands them over inside the attention's mask (no key blocks by cache column, so
    padding is served); each keeps indexer keys of its own, 16 channels a token, which the fingerprint counts."""
    model = tiny_model("qwen4_exp_text")
    adapter = adapt(model)
    assert adapter.model_layers == (1, 3)
    assert [(handles.sparse, handles.pick_in_mask, handles.pick_block) for handles in adapter.layers] == [(True, True, 1)] * 2
    assert [handles.indexer for handles in adapter.layers] == [attention_at(model, m).indexer for m in (1, 3)]
    assert adapter.index_widths == [16, 16] and adapter.fingerprint()["layer_index_dims"] == [16, 16]
    assert not adapter.picks_key_blocks


@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_k_pool_layers_take_the_pick_their_indexer_returns(model_type):
    """GLM-5 Next's MLA layers (decoder layers 1 and 2, between KDA ones) are sparse and take their pick as the indexer
    returns it: layer 1's indexer keeps 2 x 16 + 1 channels a token (its key, its pool gate's scores, whether the token
    is real), which the fingerprint counts; layer 2 ("shared") runs none, reading layer 1's pick."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    assert adapter.model_layers == (1, 2)
    assert [(handles.sparse, handles.pick_returned, handles.pick_in_mask) for handles in adapter.layers] == [(True, True, False)] * 2
    assert adapter.layers[0].indexer is attention_at(model, 1).indexer and adapter.layers[1].indexer is None
    assert adapter.index_widths == [33, 0] and adapter.fingerprint()["layer_index_dims"] == [33, 0]
    assert not adapter.picks_key_blocks


@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_k_pool_layers_without_what_kvcal_reads_their_pick_from_are_refused(model_type):
    """A GLM-5 Next layer whose indexer tells no pool size, or whose attention takes no prev_topk_indices (where a
    shared layer is handed its pick), is refused in one line, not read wrongly."""
    model = tiny_model(model_type)
    del attention_at(model, 1).indexer.index_kpool
    with pytest.raises(KvcalError, match=r"decoder layer 1: its attention's indexer has no head_dim and index_kpool"):
        adapt(model)
    model = tiny_model(model_type)
    attention_at(model, 2).forward = lambda hidden_states, attention_mask, cache=None, **kwargs: None
    with pytest.raises(KvcalError, match=r"decoder layer 2: its attention takes no prev_topk_indices"):
        adapt(model)


def test_q_and_k_normed_after_rope_are_read_normed_on_the_layers_that_rotate():
    """Llama 4 Scout's use_qk_norm norms q and k after RoPE on its RoPE layers only, here with its llama3 RoPE scaling
    (which leaves cos/sin unscaled); Maverick's config norms none (its keys are the k_proj output)."""
    llama3 = dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                  original_max_position_embeddings=32, rope_theta=10000.0)
    scout = tiny_model("llama4_text", rope_parameters=llama3, initializer_range=0.25)
    qk_norm = decoder_of(scout).layers[0].self_attn.qk_norm
    assert [layer.rope_norms for layer in adapt(scout).layers] == [(qk_norm, qk_norm), None]
    assert_kvcal_rotates_the_pre_rope_keys_as(scout)
    maverick = tiny_model("llama4_text", use_qk_norm=False, initializer_range=0.25)
    assert [layer.rope_norms for layer in adapt(maverick).layers] == [None, None]
    assert_kvcal_rotates_the_pre_rope_keys_as(maverick)


def test_q_and_k_normed_after_a_scaled_rope_are_refused():
    """The norm takes YaRN's cos/sin scaling out of the keys, which kvcal's rotation of the stored keys puts back."""
    yarn = dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64)
    with pytest.raises(KvcalError, match=r"it norms q and k after a RoPE that scales cos/sin by 1\.139; kvcal serves"):
        adapt(tiny_model("llama4_text", rope_parameters=yarn))


def test_a_model_none_of_whose_layers_attends_is_refused():
    """A Jamba whose attention period falls past its 4 layers is all Mamba: no KV cache to quantize."""
    with pytest.raises(KvcalError, match=r"none of its layers attends \(layer types \['linear_attention'\]\)"):
        adapt(tiny_model("jamba", attn_layer_period=8, attn_layer_offset=5))


@pytest.mark.parametrize("model_type", ("olmo", "olmoe"))
def test_q_k_and_v_clamped_in_place_are_read_clamped(model_type):
    """OLMo 1.7's and OLMoE's clip_qkv clamp q, k and v in place (OLMoE's after its norms), after kvcal's hooks have
    read them: what the hooks hand kvcal, copied there (not a view the model's clamp reaches later), is clamped alike,
    the keys the model's cache holds."""
    model = tiny_model(model_type, clip_qkv=0.25, initializer_range=0.25)
    adapter = adapt(model)
    assert [layer.clip for layer in adapter.layers] == [0.25, 0.25]
    read = []
    hook = adapter.layers[0].key_source.register_forward_hook(
        lambda module, args, out: read.append(adapter.layers[0].source_rows("k", out).clone()))
    with torch.no_grad():
        ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
        cache = getattr(model(ids, use_cache=True), CACHE_ARGUMENT)
    hook.remove()
    keys = apply_rope(read[0][0].view(12, 2, 16), torch.arange(12), adapter.layer_inv_freq(0, 12), adapter.layer_rope_scaling(0))
    assert read[0].abs().max() <= 0.25 and (read[0].abs() == 0.25).any()
    torch.testing.assert_close(keys, adapter.in_rope_order(cache.layers[0].keys[0].transpose(0, 1), 0), rtol=1e-5, atol=1e-5)


def test_keys_multiplied_by_zero_are_refused():
    """A Falcon-H1 with key_multiplier 0 has no key to keep, and its keys' gradients would divide by zero."""
    with pytest.raises(KvcalError, match=r"decoder layer 0: its key_multiplier is 0"):
        adapt(tiny_model("falcon_h1", key_multiplier=0.0))


def test_fingerprint_changes_with_the_config_not_with_the_weights():
    one, two = adapt(tiny_model("llama", seed=0)), adapt(tiny_model("llama", seed=1))
    assert one.fingerprint() == two.fingerprint()
    assert adapt(tiny_model("llama", max_positions=128)).fingerprint() != one.fingerprint()


def test_unsupported_architecture_names_what_is_missing():
    """What the attention holds, each part's type beside its name (here a Llama whose first attention lost q_proj)."""
    model = tiny_model("llama")
    del model.model.layers[0].self_attn.q_proj
    missing = r"could not find separate q_proj, k_proj, v_proj \(or one qkv_proj or query_key_value\)"
    with pytest.raises(KvcalError, match=rf"LlamaForCausalLM.*decoder layer 0: {missing}.*found: k_proj \(Linear\), "
                                         r"v_proj \(Linear\), o_proj \(Linear\)\)"):
        adapt(model)


# the settings a type's default config lacks to be built (Qwen4-Exp's QSA indexer has no defaults)
_NOT_TAKEN_SETTINGS = {"qwen4_exp_text": dict(indexer_budget=64, indexer_compress_ratio=4, indexer_n_heads=4,
                                              indexer_kv_heads=1, indexer_head_dim=256)}


@pytest.mark.parametrize("model_type", sorted(NOT_TAKEN_YET))
def test_a_type_not_taken_yet_is_refused_with_why_not(model_type, tmp_path):
    """Each from its default config (its released shapes, built on the meta device; a decoder's from its composite's):
    the table's reason, not the symptom its modules would show the adapter."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from kvcal.models import load_model_structure

    composite = model_type.removesuffix("_text")
    built = next((kind for kind in (composite, model_type) if kind in CONFIG_MAPPING_NAMES), None)
    if built is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    settings = _NOT_TAKEN_SETTINGS.get(model_type)
    AutoConfig.for_model(built, **({"text_config": settings} if settings else {})).save_pretrained(tmp_path)
    model, _ = load_model_structure(str(tmp_path))
    with pytest.raises(KvcalError) as refused:
        adapt(model)
    assert str(refused.value).endswith(f": {NOT_TAKEN_YET[model_type]}; {SERVED_ONES}")


@pytest.mark.parametrize("model_type", ["rwkv", "mamba"])
def test_a_model_without_attention_heads_is_refused_in_one_line(model_type, tmp_path):
    """RWKV's and Mamba's configs have no num_attention_heads (no attention, no KV cache): refused, not an
    AttributeError, from their default configs built on the meta device."""
    from transformers import AutoConfig

    from kvcal.models import load_model_structure

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    model, _ = load_model_structure(str(tmp_path))
    with pytest.raises(KvcalError, match="its config has no num_attention_heads, the attention heads kvcal reads"):
        adapt(model)


def test_no_type_not_taken_yet_is_served():
    assert not set(NOT_TAKEN_YET) & set(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES + LATENT_DECODERS)


@pytest.mark.parametrize("model_type, settings", known({"mpt": {}, "falcon": dict(alibi=True)}).items())
def test_positions_given_as_alibi_biases_are_refused(model_type, settings):
    """MPT's and Falcon-RW's positions are biases added to the scores, which kvcal's attention does not add."""
    with pytest.raises(KvcalError, match=r"ForCausalLM.*its positions are ALiBi biases on the scores"):
        adapt(tiny_model(model_type, **settings))


@from_transformers(5, 25, "Falcon's attention through transformers' attention functions")
@pytest.mark.parametrize("layout", [dict(multi_query=True), dict(multi_query=False)])
def test_falcons_other_fused_layouts_give_the_keys_and_values_the_model_caches(layout):
    """Falcon-7B's q, k and v side by side in query_key_value (one KV head: multi_query) and each head's in turn (no
    GQA), beside the tiny config's grouped layout: kvcal's key and value columns are what the model caches, the key
    rotated by kvcal as the model rotates it."""
    model = tiny_model("falcon", initializer_range=0.25, new_decoder_architecture=False, num_kv_heads=None, **layout)
    adapter = adapt(model)
    assert adapter.kv_heads == [1 if layout["multi_query"] else 4] * 2
    assert_kvcal_rotates_the_pre_rope_keys_as(model)
    sources = {}
    hooks = [layer.value_source.register_forward_hook(lambda module, args, out, i=i: sources.__setitem__(i, out))
             for i, layer in enumerate(adapter.layers)]
    with torch.no_grad():
        cache = getattr(model(torch.arange(3, 15)[None], use_cache=True), CACHE_ARGUMENT)
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(adapter.layers):
        cached = cache.layers[i].values[0].transpose(0, 1).flatten(1)
        torch.testing.assert_close(layer.source_rows("v", sources[i])[0], cached, rtol=0, atol=0)


def test_gemma3_layers_rotate_with_the_frequencies_of_their_type():
    """Sliding-window layers use rope_local_base_freq (10K), full-attention ones rope_theta (1M): each layer's
    frequencies are its type's, and artifacts store one row per layer."""
    model = tiny_model("gemma3_text")
    adapter = adapt(model)
    rotary = model.model.rotary_emb
    assert adapter.layer_types == ["sliding_attention", "full_attention"]
    assert torch.equal(adapter.layer_inv_freq(0), rotary.sliding_attention_inv_freq)
    assert torch.equal(adapter.layer_inv_freq(1), rotary.full_attention_inv_freq)
    assert not torch.equal(adapter.layer_inv_freq(0), adapter.layer_inv_freq(1))
    assert torch.equal(adapter.inv_freq, torch.stack([adapter.layer_inv_freq(0), adapter.layer_inv_freq(1)]))


@pytest.mark.parametrize("model_type", known(("smollm3", "exaone4", "kolibri1", "beam")))
def test_a_layer_without_rope_stores_its_keys_rotated_by_zero_frequencies(model_type):
    """SmolLM3's NoPE layers, EXAONE 4's, Kolibri-1's and Beam's full-attention ones (the tiny models' layer 1):
    frequencies of zero make kvcal's rotation the identity, as the model applies none
    (test_kvcal_rotates_the_pre_rope_keys_as_the_model_does checks the keys)."""
    adapter = adapt(tiny_model(model_type))
    assert adapter.rotated == [True, False]
    assert adapter.layer_inv_freq(0).min() > 0 and torch.equal(adapter.layer_inv_freq(1), torch.zeros(8))


@pytest.mark.parametrize("config, rotated", [
    (dict(mlp_layer_types=["dense", "dense"]), [True, True]),  # force_rope on the full dense layer
    (dict(mlp_layer_types=["sparse", "sparse"]), [True, False]),  # no dense layer to force
    (dict(prefix_dense_sliding_window_pattern=2), [True, False]),  # a dense full layer, but no force_rope past pattern 1
], ids=["dense", "sparse", "pattern-2"])
def test_cohere_2_moe_rotates_its_sliding_layers_and_its_forced_dense_ones_as_the_model_does(config, rotated):
    """Cohere 2 MoE rotates its sliding layers' keys and, where prefix_dense_sliding_window_pattern is 1, its dense
    layers' (force_rope): kvcal reads which, and the model's cached keys agree."""
    model = tiny_model("cohere2_moe", initializer_range=0.25, **config)
    assert adapt(model).rotated == rotated
    assert_kvcal_rotates_the_pre_rope_keys_as(model)


@pytest.mark.parametrize("model_type, kind", [("llama", "dense"), ("gemma3_text", "dense"), ("lfm2", "recurrent"),
                                              ("jamba", "recurrent"), ("falcon_h1", "recurrent"), ("gemma3n_text", "shared"),
                                              ("gemma4", "shared"), ("mllama", "cross"), ("mllama_text_model", "cross")])
def test_the_decoder_kind_names_what_it_holds_besides_kv_caches_as_engines_tell_models_apart(model_type, kind):
    """vLLM's TurboQuant boundary layers follow it: nothing (dense), a Mamba / DeltaNet / convolution state (hybrids,
    and Falcon-H1, whose every layer runs Mamba 2 beside its attention), layers reading another's cache, or layers
    attending across to an image (Llama 3.2 Vision's)."""
    assert adapt(tiny_model(model_type)).decoder_kind == kind


def test_qwen3_5s_multimodal_rope_sections_rotate_text_as_kvcal_does():
    """Released Qwen3.5 configs interleave the RoPE frequencies over (time, height, width) sections (mrope_section);
    a text token's three positions are equal, so its keys rotate by the one set of frequencies kvcal stores."""
    assert_kvcal_rotates_the_pre_rope_keys_as(tiny_model("qwen3_5_text", initializer_range=0.25, rope_parameters=QWEN3_5_MROPE))


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=4.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),  # Llama 3.1-3.3
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),  # Qwen's long-context configs
], ids=lambda rope: rope["rope_type"])
def test_static_rope_scalings_rotate_as_the_model_does(rope):
    """The frequencies (and YaRN's cos/sin scaling) transformers computes once for these are the ones kvcal stores."""
    assert_kvcal_rotates_the_pre_rope_keys_as(tiny_model("llama", rope_parameters=dict(rope_theta=10000.0, **rope), initializer_range=0.25))


# Attention shaped as these checkpoints' published configs give it (heads, head_dim, RoPE thetas and scalings, windows,
# the scores' scale; two layers where layer types alternate), everything else tiny: nothing is downloaded
CHECKPOINT_ATTENTION = {
    "gemma-3-27b": ("gemma3_text", 131072, dict(
        hidden_size=5376, num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
        sliding_window=1024, layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)))),
    "qwen3-30b-a3b": ("qwen3_moe", 40960, dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                rope_theta=1000000.0)),
    "phi-4": ("phi3", 16384, dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=10, rope_theta=250000.0)),
    "olmo-3-7b": ("olmo3", 65536, dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=500000.0),
            full_attention=dict(rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=8192)))),
    "smollm3-3b": ("smollm3", 65536, dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=4,
                                           no_rope_layers=[1, 1, 1, 0], rope_theta=5000000.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", CHECKPOINT_ATTENTION)
def test_checkpoint_shaped_attention_rotates_as_the_model_does(checkpoint):
    """head_dim 128 beside other hidden sizes, real thetas and scalings at 128 channels, Gemma 3 27B's score scale."""
    model_type, positions, attention = CHECKPOINT_ATTENTION[checkpoint]
    model = tiny_model(model_type, max_positions=positions, intermediate_size=64, initializer_range=0.05, **attention)
    assert_kvcal_rotates_the_pre_rope_keys_as(model)
    adapter = adapt(model)
    assert adapter.head_dims == [128] * len(adapter.layers)
    assert adapter.score_scale == pytest.approx(attention.get("query_pre_attn_scalar", 128) ** -0.5, rel=1e-6)


def test_cos_sin_scaled_on_some_layers_only_is_scaled_per_layer():
    """OLMo 3's YaRN scales its full layers' cos/sin and not its sliding ones' (the tiny one: layer 1 full); SmolLM3's
    NoPE layers scale nothing, whatever its YaRN does to the others. Artifacts then record one scaling a layer."""
    olmo3 = adapt(tiny_model("olmo3"))
    assert olmo3.layer_rope_scaling(0) == 1.0 and olmo3.layer_rope_scaling(1) > 1.0
    assert olmo3.rope_scaling == [1.0, olmo3.layer_rope_scaling(1)]
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256)
    smollm3 = tiny_model("smollm3", max_positions=1024, rope_parameters=yarn, initializer_range=0.25)
    adapter = adapt(smollm3)
    assert adapter.rope_scaling == [adapter.layer_rope_scaling(0), 1.0] and adapter.layer_rope_scaling(0) > 1.0
    assert_kvcal_rotates_the_pre_rope_keys_as(smollm3)


def test_rope_over_part_of_each_head_rotates_the_rest_by_zero_frequencies():
    """Phi-4-mini's partial_rotary_factor 0.75 (without its LongRoPE): kvcal's order puts the 4 channels RoPE leaves
    alone after the 12 it rotates, in each half of the head, at a frequency of zero."""
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)
    model = tiny_model("phi3", rope_parameters=rope, initializer_range=0.25)
    adapter = adapt(model)
    order = (0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15)
    assert adapter.rope_orders == [order] * 2
    assert torch.equal(adapter.inv_freq[:6], model.model.rotary_emb.inv_freq) and not adapter.inv_freq[6:].any()
    fingerprint = adapter.fingerprint()
    assert fingerprint["rope_order"] == list(order) and "layer_rope_orders" not in fingerprint
    assert rope_orders(fingerprint) == adapter.rope_orders
    assert_kvcal_rotates_the_pre_rope_keys_as(model)


def test_layers_rotating_their_own_share_of_each_head_keep_their_own_channel_order():
    """Laguna's full layer rotates half of each head (YaRN), its sliding one all of it, of twice the query heads: kvcal
    reads each layer's queries and keys in that layer's order (the sliding one's is the model's), the fingerprint
    records each layer's order and query heads, and kvcal's rotation of each layer's pre-RoPE keys is the model's."""
    model = tiny_model("laguna", initializer_range=0.25)
    adapter = adapt(model)
    half = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
    assert adapter.rope_orders == [None, half]
    assert adapter.inv_freq[0].all() and adapter.inv_freq[1, :4].all() and not adapter.inv_freq[1, 4:].any()
    fingerprint = adapter.fingerprint()
    assert fingerprint["layer_rope_orders"] == [None, list(half)] and "rope_order" not in fingerprint
    assert rope_orders(fingerprint) == adapter.rope_orders
    assert fingerprint["layer_num_heads"] == [8, 4] and query_heads(fingerprint) == [8, 4]
    assert_kvcal_rotates_the_pre_rope_keys_as(model)


def test_a_config_giving_fewer_query_head_counts_than_layers_is_refused():
    model = tiny_model("laguna")
    model.config.num_attention_heads_per_layer = [8]  # (edited after LagunaConfig checked its length)
    with pytest.raises(KvcalError, match=r"gives 1 query-head counts \(num_attention_heads_per_layer\) for 2 layers"):
        adapt(model)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_rotates_by_its_long_frequencies_past_its_switch(partial):
    """Phi-3.5's LongRoPE (Phi-4-mini's over 0.75 of each head), switching at 16 tokens here: a forward over 16 tokens
    rotates by its short frequencies, one over 17 or more by its long ones, as the model's own keys show; after a long
    forward (whose frequencies the rotary's inv_freq then holds) a short one is read as short again."""
    model = tiny_model("phi3", initializer_range=0.25, **longrope(16, partial))
    adapter = adapt(model)
    assert adapter.long_rope.switch == 16
    short, long = adapter.layer_inv_freq(0, 16), adapter.layer_inv_freq(0, 17)
    assert (short != long).any() and torch.equal(adapter.inv_freq, short)
    for tokens in (16, 20, 12):
        assert_kvcal_rotates_the_pre_rope_keys_as(model, tokens)
    model(torch.arange(20)[None])
    assert torch.equal(model.model.rotary_emb.inv_freq, long[: len(model.model.rotary_emb.inv_freq)])
    assert torch.equal(adapter.layer_inv_freq(0, 16), short)


def test_phimoe_rotates_by_its_short_frequencies_at_any_length_scaled_by_its_mscale():
    """PhiMoE's LongRoPE (Phi-3.5-MoE's, switching at 16 tokens here): transformers' rotary rotates by its short
    frequencies below and past the switch and scales cos/sin by the config's mscale, as the model's own keys show; a
    config whose short and long mscales differ (a scaling that switches with the forward's length) is refused."""
    model = tiny_model("phimoe", initializer_range=0.25, **longrope(16, model_type="phimoe"))
    adapter = adapt(model)
    assert adapter.long_rope.switch == 16 and adapter.layer_rope_scaling(0) == 1.25
    assert torch.equal(adapter.layer_inv_freq(0, 17), adapter.layer_inv_freq(0, 16))
    for tokens in (16, 20, 12):
        assert_kvcal_rotates_the_pre_rope_keys_as(model, tokens)
    switching = longrope(16, model_type="phimoe")
    switching["rope_parameters"]["long_mscale"] = 1.5
    with pytest.raises(KvcalError, match="phimoe's RoPE scales cos/sin by short_mscale 1.25 up to 16 positions and by "
                                         "long_mscale 1.5 past them"):
        adapt(tiny_model("phimoe", **switching))


def test_a_score_scale_per_layer_is_refused():
    """GPT-2's scale_attn_by_inverse_layer_idx divides layer i's scores by i + 1: kvcal's fits take one scale."""
    with pytest.raises(KvcalError, match=r"its layers scale attention scores differently \(\[0.125, 0.25\]\)"):
        adapt(tiny_model("gpt2", scale_attn_by_inverse_layer_idx=True))


def test_rope_recomputed_with_every_sequence_length_is_refused():
    """Dynamic NTK's frequencies change with every length past max_position_embeddings: kvcal stores one set."""
    dynamic = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    with pytest.raises(KvcalError, match="changes its frequencies with every sequence length"):
        adapt(tiny_model("llama", rope_parameters=dynamic))


@pytest.mark.parametrize("model_type, overrides, scale", [
    ("llama", {}, 16**-0.5),
    ("gemma3_text", dict(query_pre_attn_scalar=64), 64**-0.5),  # as Gemma 3 27B's 168 beside head_dim 128
    ("granite", dict(attention_multiplier=0.125), 0.125),
])
def test_the_attention_score_scale_is_the_models_own(model_type, overrides, scale):
    """What the fits (SKVQ's clipping search, the FP8 scale search) multiply q . k by, as the model's attention does."""
    adapter = adapt(tiny_model(model_type, **overrides))
    assert adapter.score_scale == pytest.approx(scale, rel=1e-6)
    assert score_scale({"fingerprint": adapter.fingerprint(), "score_scale": adapter.score_scale}) == adapter.score_scale
    assert score_scale({"fingerprint": adapter.fingerprint()}) == 16**-0.5  # profiles that recorded none: head_dim's
