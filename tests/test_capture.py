"""The capture pass against independent computations on tiny random models of every architecture."""

import copy
import importlib

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from helpers import attention_at
from helpers.tiny_models import GEMMA4, LATENT, LONGROPE, MUSE, TINY_ARCHITECTURES, TINY_VOCAB, longrope, tiny_model
from kvcal.adapters import adapt, decoder_of, text_inputs
from kvcal.capture import CaptureSettings, profile_gradients, select_rows
from kvcal.errors import KvcalError
from kvcal.model_caches import CACHE_ARGUMENT
from kvcal.rope import rotate_keys

NSAMPLES, SEQLEN = 3, 48


def windows(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (NSAMPLES, SEQLEN), generator=torch.Generator().manual_seed(seed))




def text_config(model):
    """The decoder's config (Gemma 3 4B-27B's text_config beside its vision one)."""
    return model.config.get_text_config(decoder=True)


def models_rotary(model, layer: int):
    """Decoder layer `layer`'s rotary embedding (LFM2-MoE names it pos_emb; Granite SWA keeps one per RoPE base,
    rotary_embs, its rotary_emb unused; Molmo 2 a scaled and an unscaled one), or None where it has none."""
    decoder = decoder_of(model)
    if text_config(model).model_type == "molmo2_text":  # its scaled rotary on rope_scaling_layers, else its unscaled one
        return decoder.rotary_emb if layer in text_config(model).rope_scaling_layers else decoder.rotary_emb_unscaled
    if text_config(model).model_type in ("granite_swa", "granitemoe_swa"):
        theta = text_config(model).layer_rope_theta[layer]
        return next((r for r in decoder.rotary_embs if r.config.rope_parameters["rope_theta"] == theta), None)
    return getattr(decoder, "rotary_emb", None) or getattr(decoder, "pos_emb", None)


# q and k normed after RoPE with a scale (Hunyuan's): kvcal reads the key the attention reads, without a RoPE of its own
SCALED_NORMS_AFTER_ROPE = ("hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text")
# q and k normed before RoPE by one norm (Muse Spark's and Glimmer's qk_norm): its second output is the pre-RoPE key
NORMED_BEFORE_ROPE = tuple(f"{kind}_text" for kind in MUSE)


def applies_rope(model, layer: int) -> bool:
    """As the modeling code decides: SmolLM3's use_rope flag, EXAONE 4's, EXAONE MoE's and Cohere 2's "global NoPE"
    (none on their full layers where they have sliding ones; Cohere 2 MoE's force_rope), AFMoE's local layers, Flint's
    layers with a window, Granite SWA's RoPE base of 0 (Muse Spark's and Glimmer's likewise), Beam's and North's layer
    types (and Ergo's) with rope parameters, Lara Mini's sliding layers (its decoder hands the others no cos and sin)."""
    attention = attention_at(model, layer)
    if models_rotary(model, layer) is None:  # Granite 4.0-H, Nemotron-H, Jamba: no RoPE anywhere
        return False
    if text_config(model).model_type in ("exaone4", "exaone_moe", "kolibri1"):
        return attention.sliding_window is None or attention.is_sliding
    if text_config(model).model_type in ("cohere2", "cohere2_moe"):
        return attention.sliding_window is not None or getattr(attention, "force_rope", False)
    if text_config(model).model_type == "afmoe":
        return attention.is_local_attention
    if text_config(model).model_type == "flint":
        return attention.sliding_window is not None
    if text_config(model).model_type == "lara_mini":
        return text_config(model).layer_types[layer] == "sliding_attention"
    if text_config(model).model_type in NORMED_BEFORE_ROPE:
        return bool(text_config(model).layer_rope_theta[layer])
    if text_config(model).model_type in ("beam", "cohere_compass_text", "ergo"):  # their full layers' rope parameters
        # are None
        return text_config(model).rope_parameters[text_config(model).layer_types[layer]] is not None
    return getattr(attention, "use_rope", True)


def unrotated_scale(model, layer: int, head_dim: int) -> torch.Tensor:
    """Per channel of a head in the model's order: its cos/sin scaling on the channels its RoPE leaves alone (of the
    first rotated ones), 1 elsewhere: the key's gradient there times this is the one of the key kvcal reads."""
    rotary, scale = models_rotary(model, layer), torch.ones(head_dim)
    if applies_rope(model, layer) and hasattr(rotary, "inv_freq"):
        scale[2 * rotary.inv_freq.numel() :] = rotary.attention_scaling
    return scale


def key_and_value_sources(model, layer: int):
    """Per side (keys, values): (the module whose output holds it, its columns of that output, the projection whose
    weight makes it, its rows of that weight). Phi-3's one qkv_proj holds q, k and v side by side, GPT-NeoX's
    query_key_value each head's q, k and v in turn (GPT-BigCode's c_attn too, but where multi_query; Persimmon's, its
    keys normed per head after it), GPT-2's c_attn side by side (a Conv1D: its weight's columns), Ergo's qkv_proj side
    by side, its keys normed per head after it; Falcon's query_key_value each KV head's queries, then its key and value."""
    attention, config = attention_at(model, layer), text_config(model)
    if getattr(attention, "new_decoder_architecture", False):
        fused, head_dim = attention.query_key_value, config.hidden_size // config.num_attention_heads
        grouped = torch.arange(fused.out_features).view(config.num_kv_heads, -1, head_dim)
        keys, values = grouped[:, -2].flatten(), grouped[:, -1].flatten()
        return (fused, keys, fused, keys), (fused, values, fused, values)
    in_turn = getattr(attention, "query_key_value", None)
    if getattr(attention, "multi_query", None) is False:
        in_turn = attention.c_attn
    if in_turn is not None:
        head_dim = config.hidden_size // config.num_attention_heads
        per_head = torch.arange(3 * config.hidden_size).view(config.num_attention_heads, 3, head_dim)
        keys, values = per_head[:, 1].flatten(), per_head[:, 2].flatten()
        normed = getattr(attention, "k_layernorm", None)
        key_source = (normed, slice(None)) if normed is not None else (in_turn, keys)
        return (*key_source, in_turn, keys), (in_turn, values, in_turn, values)
    if hasattr(attention, "mp_num"):  # CodeGen's qkv_proj: q, v and k side by side within each of its shards
        fused, shards = attention.qkv_proj, attention.mp_num
        per_shard = torch.arange(3 * config.hidden_size).view(shards, 3, config.hidden_size // shards)
        keys, values = per_shard[:, 2].flatten(), per_shard[:, 1].flatten()
        return (fused, keys, fused, keys), (fused, values, fused, values)
    if hasattr(attention, "c_attn"):  # (GPT-BigCode's multi-query: one KV head)
        fused, q, kv = attention.c_attn, config.hidden_size, getattr(attention, "kv_dim", config.hidden_size)
        keys, values = slice(q, q + kv), slice(q + kv, None)
        return (fused, keys, fused, keys), (fused, values, fused, values)
    if hasattr(attention, "kv_proj"):  # JetMoE's k and v side by side
        kv = config.num_key_value_heads * config.kv_channels
        keys, values = slice(0, kv), slice(kv, None)
        return (attention.kv_proj, keys, attention.kv_proj, keys), (attention.kv_proj, values, attention.kv_proj, values)
    fused = getattr(attention, "qkv_proj", None) or getattr(attention, "Wqkv", None)  # Phi-3's, DBRX's, Ergo's
    if fused is not None:
        head_dim = config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        keys, values = slice(q, q + kv), slice(q + kv, None)
        normed = getattr(attention, "k_norm", None)  # Ergo's: its keys normed per head after it
        key_source = (normed, slice(None)) if normed is not None else (fused, keys)
        return (*key_source, fused, keys), (fused, values, fused, values)
    # after RoPE: Llama 4 Scout's qk_norm, called on q then k (its last output is the post-RoPE key; Muse's before RoPE,
    # the pre-RoPE key), NanoChat's k_norm
    # Hunyuan's key_layernorm, after RoPE too (with a scale: kvcal reads its output as a key without RoPE)
    key_source = (getattr(attention, "k_norm", None) or getattr(attention, "k_layernorm", None)
                  or getattr(attention, "qk_norm", None) or getattr(attention, "key_layernorm", None) or attention.k_proj)
    value_source = getattr(attention, "v_norm", None) or attention.v_proj  # Gemma 3n: its values normed
    every = slice(None)
    return (key_source, every, attention.k_proj, every), (value_source, every, attention.v_proj, every)


def models_rope(model, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decoder's own apply_rotary_pos_emb on the channels its cos/sin cover (the first ones, where it rotates part of
    each head; gpt-oss's cover a pair each), the rest as they are. Gemma 3n's rotates one tensor at a time."""
    rotary_dims = cos.shape[-1] * (2 if text_config(model).model_type == "gpt_oss" else 1)
    apply_rotary_pos_emb = importlib.import_module(type(decoder_of(model)).__module__).apply_rotary_pos_emb
    if text_config(model).model_type in ("gptj", "codegen"):  # its rotary gives (sin, cos) of half the rotated
        # channels, its apply_rotary_pos_emb rotates one tensor of (batch, tokens, heads, channels)
        sin, cos = cos, sin
        rotary_dims = 2 * cos.shape[-1]
        rotated = apply_rotary_pos_emb(heads[..., :rotary_dims].transpose(1, 2), sin, cos).transpose(1, 2)
        return torch.cat((rotated, heads[..., rotary_dims:]), dim=-1)
    if text_config(model).model_type in ("gemma3n_text", "gemma4_text", "gemma4_unified_text"):
        rotated = apply_rotary_pos_emb(heads[..., :rotary_dims], cos, sin)
    else:
        _, rotated = apply_rotary_pos_emb(heads[..., :rotary_dims], heads[..., :rotary_dims], cos, sin)
    return torch.cat((rotated, heads[..., rotary_dims:]), dim=-1)


def llama4_rope(model, layer: int, heads: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Llama 4's own apply_rotary_emb on (batch, heads, tokens, head_dim) at positions from 0 (`inverse`: by the
    conjugate frequencies, rotating back); its rotary gives complex frequencies, and it takes (batch, tokens, heads, ...)."""
    frequencies = models_rotary(model, layer)(heads, torch.arange(heads.shape[2])[None])
    apply_rotary_emb = importlib.import_module(type(decoder_of(model)).__module__).apply_rotary_emb
    heads = heads.transpose(1, 2)
    return apply_rotary_emb(heads, heads, frequencies.conj() if inverse else frequencies)[1].transpose(1, 2)


def independent_reference(model, batch: torch.Tensor):
    """Per window: ||dL/dW_k||, ||dL/dW_v|| and dL/dK, dL/dV by torch.autograd.grad, and the post-RoPE keys that the
    model's own apply_rotary_pos_emb produces, the keys in kvcal's channel order (its rotation's, checked in
    test_rope). Falcon-H1's keys are its k_proj output times its config's key_multiplier, MiMo-V2-Flash's values its
    v_proj output times its v_scale, DBRX's keys its Wqkv output clamped at clip_qkv (dL/dK there its output's, 0 where
    clamped), OLMo's and OLMoE's clamped in place likewise; where RoPE leaves channels
    alone and scales cos/sin, dL/dK there is the projection's gradient times that scaling (unrotated_scale). Where q and
    k are normed after RoPE (Llama 4 Scout, NanoChat), the norm's output is the post-RoPE key and dL/dK its gradient
    rotated back. Where the value is made from k_proj's output (Gemma 4's attention_k_eq_v), the layer is given a v_proj, a
    copy of k_proj, for the reference: the values are the same, and autograd gives the value path's dL/dW_v as that
    copy's gradient."""
    adapter = adapt(model)
    copied = [attention for attention in (attention_at(model, m) for m in adapter.model_layers)
              if getattr(attention, "v_proj", 0) is None]
    for attention in copied:
        attention.v_proj = copy.deepcopy(attention.k_proj)
    try:
        return _autograd_reference(model, adapter, batch)
    finally:
        for attention in copied:
            attention.v_proj = None


def _autograd_reference(model, adapter, batch: torch.Tensor):
    positions = (torch.arange(SEQLEN) + adapter.first_position)[None]  # (RoPE's: PaliGemma's count from 1)
    layers, kinds = range(len(adapter.layers)), adapter.layer_types  # the attention layers (hybrids have others)
    sources = [key_and_value_sources(model, adapter.model_layers[i]) for i in layers]
    # the keys are the key source's output times Falcon-H1's key_multiplier, or on Ergo's full layers its qk_scale
    key_multipliers = [float(getattr(attention_at(model, adapter.model_layers[i]), "qk_scale", None)
                             or getattr(text_config(model), "key_multiplier", 1.0)) for i in layers]
    norms = torch.zeros(2, len(layers), dtype=torch.float64)
    key_grads, value_grads, post_rope = [], [], []
    for window in batch:
        outputs = {}
        handles = []
        for i in layers:
            for side, (module, *_) in zip("kv", sources[i]):
                handles.append(module.register_forward_hook(lambda m, a, out, key=(side, i): outputs.__setitem__(key, out)))
        ids = window[None]
        loss = model(input_ids=ids, labels=ids, use_cache=False, **text_inputs(model, ids)).loss
        for h in handles:
            h.remove()
        projections = [sources[i][side][2] for side in (0, 1) for i in layers]
        activations = [outputs[side, i] for side in "kv" for i in layers]
        grads = torch.autograd.grad(loss, [projection.weight for projection in projections] + activations)
        n = len(layers)
        if text_config(model).model_type == "chameleon":  # its key norm sees (batch * tokens, heads, head_dim)
            grads = (*grads[: 2 * n], *(g.unflatten(0, (1, SEQLEN)) for g in grads[2 * n : 3 * n]), *grads[3 * n :])
            outputs.update({("k", i): outputs["k", i].unflatten(0, (1, SEQLEN)) for i in layers})
        clip = getattr(text_config(model), "clip_qkv", None)  # OLMo's, OLMoE's: clamped in place after the activations,
        if clip is not None:  # so autograd gives the gradient after the clamp, kvcal's hooks the one before (0 there)
            grads = (*grads[: 2 * n], *(g * (a.abs() < clip) for g, a in zip(grads[2 * n :], activations)))
        columns = [sources[i][side][1] for side in (0, 1) for i in layers]  # of the activations
        weight_rows = [sources[i][side][3] for side in (0, 1) for i in layers]
        rows = [g[:, r] if isinstance(projection, Conv1D) else g[r]  # (Conv1D: weight (inputs, outputs))
                for g, r, projection in zip(grads[: 2 * n], weight_rows, projections)]
        norms[0] += torch.stack([r.double().norm() for r in rows[:n]])
        norms[1] += torch.stack([r.double().norm() for r in rows[n:]])
        # their key norms see (batch, heads, tokens, head_dim)
        heads_first = text_config(model).model_type in ("gemma3_text", "exaone4", "exaone_moe", "kolibri1", "apertus",
                                                         "apertus1p5_text", "stablelm", "hy_v3",
                                                         "nanochat", "hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text",
                                                         *NORMED_BEFORE_ROPE)
        normed_after_rope = [(hasattr(attention_at(model, adapter.model_layers[i]), "qk_norm")
                              and text_config(model).model_type not in NORMED_BEFORE_ROPE)
                             or text_config(model).model_type == "nanochat" for i in layers]
        key_grads.append([adapter.rows_in_rope_order(
            (g[0].transpose(0, 1) if heads_first else g[0]).flatten(1)[:, c] / key_multipliers[i]
            * unrotated_scale(model, adapter.model_layers[i], adapter.head_dims[i]).repeat(adapter.kv_heads[i]), i)
            for i, (g, c) in enumerate(zip(grads[2 * n : 3 * n], columns[:n]))])
        for i in (i for i in layers if normed_after_rope[i]):  # dL/dK_post, rotated back
            heads = grads[2 * n + i] if heads_first else grads[2 * n + i].transpose(1, 2)  # (batch, heads, tokens, head_dim)
            if text_config(model).model_type == "nanochat":
                cos, sin = models_rotary(model, adapter.model_layers[i])(heads, positions)
                rotated_back = models_rope(model, heads, cos, -sin)
            else:
                rotated_back = llama4_rope(model, adapter.model_layers[i], heads, inverse=True)
            key_grads[-1][i] = adapter.rows_in_rope_order(rotated_back[0].transpose(0, 1).flatten(1), i)
        value_grads.append([g[0].flatten(1)[:, c] / getattr(attention_at(model, adapter.model_layers[i]), "v_scale", 1.0)
                            for i, (g, c) in enumerate(zip(grads[3 * n :], columns[n:]))])
        rotated = []
        for i in layers:  # Gemma 3's and OLMo 3's rotary takes the layer's type, whose frequencies it uses
            layer_type = [kinds[i]] if kinds[i] is not None else []
            keys = outputs["k", i].detach() * key_multipliers[i]
            keys = keys if heads_first else keys.flatten(2)[..., sources[i][0][1]]
            clip = (getattr(attention_at(model, adapter.model_layers[i]), "clip_qkv", None)  # DBRX's, OLMo's, OLMoE's
                    or getattr(text_config(model), "clip_qkv", None))
            keys = keys if clip is None else keys.clamp(-clip, clip)
            head_dim = getattr(attention_at(model, adapter.model_layers[i]), "head_dim", None) or getattr(
                attention_at(model, adapter.model_layers[i]), "head_size")  # GPT-NeoX's
            heads = keys if heads_first else keys.reshape(1, SEQLEN, -1, head_dim).transpose(1, 2)
            if normed_after_rope[i] or text_config(model).model_type in SCALED_NORMS_AFTER_ROPE:
                pass  # the norm's output, rotated already
            elif applies_rope(model, adapter.model_layers[i]) and text_config(model).model_type == "llama4_text":
                heads = llama4_rope(model, adapter.model_layers[i], heads)
            elif applies_rope(model, adapter.model_layers[i]):
                rotary = models_rotary(model, adapter.model_layers[i])
                # a multimodal RoPE's text positions: the same on every axis (before 5.19 its rotary takes them so alone)
                axes = positions.expand(3, -1, -1) if hasattr(rotary, "mrope_section") else positions
                cos, sin = rotary(keys, axes, *layer_type)
                heads = models_rope(model, heads, cos, sin)
            k_rot = heads
            rotated.append(adapter.rows_in_rope_order(k_rot.transpose(1, 2)[0].flatten(1), i))
        post_rope.append(rotated)
    return norms / len(batch), key_grads, value_grads, post_rope


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_importance_fisher_and_rope_match_independent_autograd(model_type):
    # Gemma 4: the reference's copied v_proj sums the hidden states' gradient in another order (last bits)
    assert_capture_matches_autograd(tiny_model(model_type), atol=1e-12 if model_type in GEMMA4 else 1e-14)


@pytest.mark.parametrize("model_type", ("olmo", "olmoe"))
def test_clamped_q_k_v_capture_matches_independent_autograd(model_type):
    """OLMo 1.7's and OLMoE's clip_qkv (0.25 here: many elements clamped) clamp in place after kvcal's hooks: the keys
    captured are clamped as the model's, their Fisher is the projection's (or norm's) output gradient's."""
    assert_capture_matches_autograd(tiny_model(model_type, clip_qkv=0.25), atol=1e-14)


def test_llama4_maverick_capture_matches_independent_autograd():
    """Maverick's config norms no q and k (the tiny llama4_text is Scout's, which does after RoPE)."""
    assert_capture_matches_autograd(tiny_model("llama4_text", use_qk_norm=False), atol=1e-14)


def test_gpt_bigcode_without_multi_query_capture_matches_independent_autograd():
    """GPT-BigCode's c_attn without multi_query holds each head's q, k and v in turn (the tiny one: multi_query)."""
    model = tiny_model("gpt_bigcode", multi_query=False)
    assert adapt(model).kv_heads == [4, 4]
    assert_capture_matches_autograd(model, atol=1e-14)


@pytest.mark.parametrize("model_type, partial", LONGROPE)
def test_longrope_capture_matches_independent_autograd(model_type, partial):
    """Phi-3.5's LongRoPE past its switch (16 tokens here; the windows: 48): its long frequencies rotate the keys.
    Phi-4-mini's covers 0.75 of each head and scales cos/sin: the channels it leaves alone are read divided by the
    scaling (LayerHandles.unrotated_scale), their gradient multiplied by it. Phi-3.5-MoE's rotates by its short
    frequencies and scales by its mscale."""
    model = tiny_model(model_type, **longrope(16, partial, model_type=model_type))
    assert (adapt(model).layers[0].unrotated_scale is None) == (partial == 1.0)
    assert_capture_matches_autograd(model, atol=1e-14)


def assert_capture_matches_autograd(model, atol: float) -> None:
    batch = windows()
    result = profile_gradients(model, adapt(model), batch, CaptureSettings(sink=1, max_tokens_per_layer=40, store_windows=1, seed=0))
    norms, key_grads, value_grads, post_rope = independent_reference(model, batch)

    torch.testing.assert_close(result.importance_k, norms[0].float(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(result.importance_v, norms[1].float(), rtol=1e-5, atol=1e-8)
    rows_window = result.tensors["samples.window"].long()
    rows_position = result.tensors["samples.position"].long()
    assert len(rows_window) == 40 and int(rows_position.min()) >= 1  # sink excluded
    for layer in range(len(adapt(model).layers)):
        expected_fk = torch.stack([key_grads[w][layer][p] for w, p in zip(rows_window, rows_position)]).square()
        expected_fv = torch.stack([value_grads[w][layer][p] for w, p in zip(rows_window, rows_position)]).square()
        expected_post = torch.stack([post_rope[w][layer][p] for w, p in zip(rows_window, rows_position)])
        torch.testing.assert_close(result.tensors[f"layers.{layer}.k_pre.fisher"], expected_fk, rtol=1e-4, atol=atol)
        torch.testing.assert_close(result.tensors[f"layers.{layer}.v.fisher"], expected_fv, rtol=1e-4, atol=atol)
        torch.testing.assert_close(result.tensors[f"layers.{layer}.k_post.samples"], expected_post, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_capture_matches_independent_autograd(model_type):
    """MLA (kvcal.adapters.LatentAttention): KVmix's dL/dW_k and dL/dW_v are kv_a_proj_with_mqa's gradient rows of the
    rotated key and of the latent; the key's Fisher is of the rotated key before RoPE (kv_a_proj_with_mqa's last
    qk_rope_head_dim outputs; dots.note3's normed by k_rope_only_layernorm), the value's of the latent (kv_a_layernorm's
    output, through both its paths: scores and outputs), each at its own width (dots.note3's sliding layers'
    narrower); the post-RoPE keys are what transformers' cache holds; no whole windows are kept (their attention would
    need the queries absorbed into the latent)."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    layers, ranks = len(adapter.layers), adapter.value_dims
    batch = windows()
    result = profile_gradients(model, adapter, batch, CaptureSettings(sink=1, max_tokens_per_layer=40, store_windows=1))
    norms = torch.zeros(2, layers, dtype=torch.float64)
    key_grads, value_grads, post_rope = [], [], []
    for window in batch:
        outputs = {}
        attentions = [attention_at(model, m) for m in adapter.model_layers]  # (Kimi Linear's after KDA layers)
        # (the rotated key before RoPE: kv_a_proj_with_mqa's last outputs, or the norm of them, (batch, 1, tokens, width))
        key_norms = [getattr(attention, "k_rope_only_layernorm", None) for attention in attentions]
        hooks = [module.register_forward_hook(lambda m, a, out, key=(name, i): outputs.__setitem__(key, out))
                 for i in range(layers) for name, module in (("key", key_norms[i] or attentions[i].kv_a_proj_with_mqa),
                                                             ("latent", attentions[i].kv_a_layernorm))]
        ids = window[None]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        for hook in hooks:
            hook.remove()
        weights = [attention.kv_a_proj_with_mqa.weight for attention in attentions]
        grads = torch.autograd.grad(loss, weights + [outputs["key", i] for i in range(layers)]
                                    + [outputs["latent", i] for i in range(layers)])
        norms[0] += torch.stack([g[rank:].double().norm() for g, rank in zip(grads[:layers], ranks)])
        norms[1] += torch.stack([g[:rank].double().norm() for g, rank in zip(grads[:layers], ranks)])
        key_grads.append([adapter.rows_in_rope_order(g[0, 0] if key_norms[i] is not None else g[0, :, ranks[i]:], i)
                          for i, g in enumerate(grads[layers : 2 * layers])])
        # (LongCat-Flash's value: the latent times mla_scale_kv_lora; dots.note3's times kv_lora_scale)
        value_grads.append([g[0] / getattr(attention, "mla_scale_kv_lora", getattr(attention, "kv_lora_scale", 1.0))
                            for g, attention in zip(grads[2 * layers :], attentions)])
        with torch.no_grad():
            cache = getattr(model(ids, use_cache=True), CACHE_ARGUMENT)
        cached = [cache.layers[m].values[0, 0] for m in adapter.model_layers]
        post_rope.append([rows if adapter.layers[i].latent.rope_in_order else adapter.rows_in_rope_order(rows, i)
                          for i, rows in enumerate(cached)])
    torch.testing.assert_close(result.importance_k, (norms[0] / NSAMPLES).float(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(result.importance_v, (norms[1] / NSAMPLES).float(), rtol=1e-5, atol=1e-8)
    window_of, position_of = result.tensors["samples.window"].long(), result.tensors["samples.position"].long()
    for layer in range(layers):
        at_rows = lambda per_window: torch.stack([per_window[w][layer][p] for w, p in zip(window_of, position_of)])  # noqa: E731
        assert result.tensors[f"layers.{layer}.k_pre.samples"].shape == (40, adapter.head_dims[layer])  # (0: NoPE)
        assert result.tensors[f"layers.{layer}.v.samples"].shape == (40, ranks[layer])
        torch.testing.assert_close(result.tensors[f"layers.{layer}.k_pre.fisher"], at_rows(key_grads).square(), rtol=1e-4,
                                   atol=1e-14)
        torch.testing.assert_close(result.tensors[f"layers.{layer}.v.fisher"], at_rows(value_grads).square(), rtol=1e-4,
                                   atol=1e-14)
        # (a sliding layer's cache holds its window's last tokens: the samples of those)
        first = batch.shape[1] - post_rope[0][layer].shape[0]
        held = position_of >= first
        assert bool(held.any())
        torch.testing.assert_close(result.tensors[f"layers.{layer}.k_post.samples"][held],
                                   torch.stack([post_rope[w][layer][p - first] for w, p in zip(window_of[held],
                                                                                                position_of[held])]),
                                   rtol=1e-5, atol=1e-5)
    assert result.counts["stored_windows"] == 0 and "layers.0.windows.q" not in result.tensors


@pytest.mark.parametrize("per_token", (2, 1))
def test_jetmoes_stored_queries_are_those_its_attention_is_handed_grouped_by_kv_head(per_token):
    """JetMoE's queries come out of its attention experts' map(), which no module's call returns: the profile makes
    them again from the attention's input, each KV head's query heads together: rotated by RoPE, the queries its
    attention is handed, where head e * 2 + h (expert e of a token's `per_token`) reads KV head h of 2."""
    from transformers import AttentionInterface

    model = tiny_model("jetmoe", num_experts_per_tok=per_token)
    adapter = adapt(model)
    sdpa, handed = AttentionInterface._global_mapping["sdpa"], {}

    def keep_queries(module, query, *args, **kwargs):
        handed.setdefault(module, query.detach())
        return sdpa(module, query, *args, **kwargs)

    AttentionInterface.register("sdpa", keep_queries)
    try:
        result = profile_gradients(model, adapter, windows()[:1], CaptureSettings(store_windows=1))
    finally:
        AttentionInterface.register("sdpa", sdpa)
    by_kv_head = [expert * 2 + kv_head for kv_head in range(2) for expert in range(per_token)]
    for i, handles in enumerate(adapter.layers):
        query = handed[handles.attention][0, by_kv_head]  # (heads, tokens, 16)
        stored = result.tensors[f"layers.{i}.windows.q"][0].float()
        rotated = rotate_keys(stored, torch.arange(SEQLEN), 2 * per_token, adapter.layer_inv_freq(i),
                              adapter.layer_rope_scaling(i))
        torch.testing.assert_close(rotated, query.transpose(0, 1).flatten(1), atol=2e-3, rtol=2e-3)  # (stored fp16)


def test_forward_and_backward_passes_equal_nsamples():
    model = tiny_model("llama")
    calls = {"forward": 0, "backward": 0}
    model.register_forward_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1))
    model.lm_head.register_full_backward_hook(lambda *a: calls.__setitem__("backward", calls["backward"] + 1))
    result = profile_gradients(model, adapt(model), windows(), CaptureSettings())
    assert calls == {"forward": NSAMPLES, "backward": NSAMPLES}
    assert result.counts["forward_passes"] == result.counts["backward_passes"] == NSAMPLES


def test_statistics_cover_every_non_sink_token_and_windows_are_stored():
    model = tiny_model("qwen2")
    batch = windows()
    seen = []
    attention = attention_at(model, 1)
    handle = attention.v_proj.register_forward_hook(lambda m, a, out: seen.append(out.detach()[0]))
    result = profile_gradients(model, adapt(model), batch, CaptureSettings(sink=4, store_windows=2))
    handle.remove()
    values = torch.cat([v[4:] for v in seen])
    torch.testing.assert_close(result.tensors["layers.1.v.min"], values.amin(0))
    torch.testing.assert_close(result.tensors["layers.1.v.max"], values.amax(0))
    torch.testing.assert_close(result.tensors["layers.1.v.absmax"], values.abs().amax(0))
    assert result.tensors["layers.1.windows.q"].shape == (2, SEQLEN, 64)
    assert result.tensors["layers.1.windows.v"].shape == (2, SEQLEN, 32)
    torch.testing.assert_close(result.tensors["layers.1.windows.v"][1].float(), seen[1].half().float())
    assert torch.equal(result.tensors["windows.input_ids"], batch[:2].int())


def test_capture_restores_requires_grad_and_leaves_no_gradients():
    model = tiny_model("mistral")
    profile_gradients(model, adapt(model), windows(), CaptureSettings())
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_callers_no_grad_profiles_as_without_it_and_inference_mode_is_refused():
    """A profile called under the caller's torch.no_grad() computes its gradients all the same (the same tensors);
    under torch.inference_mode(), which forbids backward passes, it is refused with what to do."""
    model = tiny_model("llama")
    expected = profile_gradients(model, adapt(model), windows(), CaptureSettings()).tensors
    with torch.no_grad():
        got = profile_gradients(model, adapt(model), windows(), CaptureSettings()).tensors
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    with torch.inference_mode(), pytest.raises(KvcalError, match="forbids: profile outside that block"):
        profile_gradients(model, adapt(model), windows(), CaptureSettings())


def test_same_seed_same_tensors_other_seed_other_rows():
    model = tiny_model("llama")
    settings = CaptureSettings(max_tokens_per_layer=30, seed=0)
    first = profile_gradients(model, adapt(model), windows(), settings)
    second = profile_gradients(model, adapt(model), windows(), settings)
    assert first.tensors.keys() == second.tensors.keys()
    for name in first.tensors:
        assert torch.equal(first.tensors[name], second.tensors[name]), name
    other = select_rows(NSAMPLES, SEQLEN, 1, 30, seed=1)
    assert not torch.equal(other, select_rows(NSAMPLES, SEQLEN, 1, 30, seed=0))


def test_select_rows_is_bounded_sorted_and_skips_the_sink():
    rows = select_rows(nsamples=5, seqlen=100, sink=3, limit=64, seed=0)
    assert rows.shape == (64, 2)
    flat = rows[:, 0] * 100 + rows[:, 1]
    assert torch.all(flat[1:] > flat[:-1]) and int(rows[:, 1].min()) >= 3
    everything = select_rows(nsamples=2, seqlen=10, sink=2, limit=1000, seed=0)
    assert everything.shape == (16, 2)


def test_default_rows_are_every_row_past_the_sink_within_the_sample_budget(monkeypatch):
    import kvcal.capture as capture

    model = tiny_model("llama")
    adapter = adapt(model)
    result = profile_gradients(model, adapter, windows(), CaptureSettings(sink=2))
    assert result.counts["sampled_rows"] == NSAMPLES * (SEQLEN - 2)
    per_row = len(capture.SAMPLE_TENSORS) * sum(adapter.kv_widths) * 4
    monkeypatch.setattr(capture, "SAMPLE_BUDGET_BYTES", 50 * per_row + per_row // 2)
    assert CaptureSettings().row_limit(adapter.kv_widths, adapter.value_widths) == 50
    assert profile_gradients(model, adapter, windows(), CaptureSettings(sink=2)).counts["sampled_rows"] == 50
    assert CaptureSettings(max_tokens_per_layer=7).row_limit(adapter.kv_widths, adapter.value_widths) == 7
    # MLA's rows: three key-wide tensors (64 channels) and two latent-wide ones (96) a layer
    assert CaptureSettings().row_limit([64, 64], [96, 96]) == capture.SAMPLE_BUDGET_BYTES // (4 * 2 * (3 * 64 + 2 * 96))
