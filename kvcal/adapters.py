"""Architecture adapter: finds, per decoder layer, the projections kvcal hooks, by structure.

Every supported model's attention is q/k/v/o projections + RoPE as kvcal.rope computes it, up to the order of each
head's channels (tests/test_adapters.py checks each against the model's own cached keys); nothing here forks a
modeling file:
- Llama, Mistral, Ministral, Ministral 3, Mixtral, Qwen2 (k/v bias), Qwen2-MoE, SmolLM3, Granite (and its MoEs,
  and Granite SWASH), Seed-OSS, Cohere, Cohere 2 (and its MoE), ERNIE 4.5 (and its MoE), Helium, GLM, GLM-4,
  Nemotron, StarCoder2, Arcee, CWM, Gemma, Gemma 2, VaultGemma, InternLM3, Solar Open, Jais 2, HyperCLOVA X, OLMo (the
  first), BitNet: separate q/k/v_proj (the MoE models' experts are in the MLP only);
- Qwen3, Qwen3-MoE, Gemma 3, EXAONE 4, K-EXAONE (exaone_moe), Kolibri-1 (kolibri1), Apertus, Hy3 (hy_v3), dots.llm1
  (dots1), GLM-4.5 (glm4_moe), Command R+ (cohere), StableLM 2 12B and Persimmon (q/k_layernorm), Mellum, AFMoE, and
  the attention layers of Qwen3.5, Qwen3-Next, LFM2 and LFM3: q/k norms per head before RoPE; OLMo 2 and 3, OLMoE,
  FlexOlmo, OLMo Hybrid, MiniMax-M2: over the whole projection. The pre-RoPE key is the tensor RoPE consumes: the key
  norm's output where the model has one, else the k_proj output;
- Phi-3, Phi-4 and Phi-4-multimodal: q, k and v side by side in one fused qkv_proj's output (LayerHandles.columns),
  DBRX in its Wqkv's, clamped (clip_qkv: `LayerHandles.clip`), its attention inside a norm_attn_norm block; GPT-NeoX
  (Pythia) and Persimmon: each head's q, k and v in turn in one query_key_value; Falcon in its query_key_value each
  KV head's queries, then its key and value (new_decoder_architecture), or q, k and v side by side (multi_query), its
  attention self_attention; CodeGen in its qkv_proj q, v and k side by side within each of its 4 shards; Phi (Phi-2),
  GPT-NeoX, Persimmon and Falcon name the output projection dense, LFM2, DBRX, GPT-J and CodeGen out_proj.
RoPE pairs channel i with i + head_dim/2 on most; Cohere, ERNIE 4.5, Helium, GLM, GPT-J and CodeGen pair neighbours (2i,
2i+1), and GLM, GLM-4.5, MiniMax-M2, StableLM, Nemotron, Phi-2, GPT-NeoX, Persimmon, Phi-4-mini, GPT-J and CodeGen
rotate only the first channels of each head (partial_rotary_factor, rotary_dim). kvcal reads queries and keys of those
in its own order (kvcal.rope.rotate_half_order: `LayerHandles.rope_order`, recorded in the fingerprint), where the
channels RoPE leaves alone have a frequency of zero; Laguna's full layers rotate half of each head and its sliding ones
all of it, so each layer has its own order (the fingerprint's layer_rope_orders where they differ). Laguna's layers also
have their own number of query heads (`query_heads`, the fingerprint's layer_num_heads where they differ) over the same
KV heads.
Qwen3.5 (qwen3_5_text: its checkpoints load as the text model), Qwen3.5-MoE and Qwen3-Next are hybrid: gated DeltaNet
layers (layer type linear_attention) hold a recurrent state, not keys and values; `layers` are the attention layers
only (`model_layers`: their decoder indices, the fingerprint's attention_layers), whose q_proj is twice as wide (a
gate beside each head's query: the query is the q norm's output). Other hybrids: OLMo Hybrid, its gated DeltaNet
layers as well; LFM2 and LFM2-MoE, their short convolution layers (conv) keeping a state; Granite 4.0-H
(granitemoehybrid), Nemotron-H, Jamba and Bamba, their Mamba layers (linear_attention; Nemotron-H's MLP and MoE blocks are
layers of their own, holding nothing, and its attention is a block's mixer); MiniMax-Text-01 and MiniMax-M1 (minimax),
their lightning attention layers (linear_attention), whose states its decoder keeps in a cache class of its own
(kvcal.model_caches). Falcon-H1 runs Mamba 2 beside the
attention of every layer (layer type hybrid: `keeps_state`) and scales its keys by key_multiplier
(`LayerHandles.key_multiplier`: kvcal's key is the k_proj output times it); MiMo-V2-Flash scales its values by v_scale
(`value_multiplier`), narrower than its keys (`value_dims`). Where the config leaves RoPE out (Granite
4.0-H's position_embedding_type, OLMo Hybrid's missing rope_theta) and always on Nemotron-H and Jamba, the decoder has
no rotary module and every layer is NoPE.
Gemma 3n (gemma3n_text) shares KV: its last num_kv_shared_layers layers (kv_sharing_modes "reuse") read the keys
and values of the last earlier layer of their type and have no k/v projections (`readers`, ReaderLayer); its values
are the output of a norm (`LayerHandles.v_norm`, value_source). Gemma 4 (gemma4_text; gemma4 beside its vision and
audio towers) shares KV likewise and has layers of two shapes (transformers' per-layer config): its full-attention
layers' heads are global_head_dim wide, fewer where num_global_key_value_heads says (`kv_heads`, `head_dims`: one a
layer, the fingerprint's layer_kv_heads and layer_head_dims where they differ), and where attention_k_eq_v they have
no v_proj: the value is the v norm of k_proj's output (`LayerHandles.value_from_key_projection`). Gemma 4 Unified
(gemma4_unified_text; gemma4_unified beside its vision and audio embedders: Gemma 4 12B) has Gemma 4's attention.
Gemma 3 4B-27B (gemma3), Gemma 4 (gemma4) and Gemma 4 Unified are their text decoder beside a vision tower, Mistral
3 (mistral3: Mistral Small 3.x, Ministral 3) a mistral or ministral3 decoder beside one, LLaVA, InternVL, SmolVLM,
Idefics3 and Aya Vision a Llama, Mistral, Qwen2, Qwen3 or Cohere 2 one, Aria (aria) its MoE aria_text one, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE a Qwen2 or Qwen3 decoder whose RoPE takes (time, height, width) positions,
equal for text, as North Micro Vision (cohere_compass) its cohere_compass_text one (RoPE per layer type) and
Qwen3.5 (qwen3_5, qwen3_5_moe) its hybrid qwen3_5_text one (named as it: _served_name), Kimi K2.5 (kimi_k25) a
deepseek_v3 one (MLA), Llama 4
(llama4) a llama4_text one, which is a causal LM of its own (artifacts name the composite as it: _served_name): kvcal
reads and serves the decoder.
All but those below read an image's tokens causally, as text (`images_as_tokens`: kvcal wires the decoder alone
and caches them; Phi-4-multimodal's image and audio encoders sit inside its decoder, whose text config alone kvcal
switches: `encoders_inside`; Qwen's at three positions, which keys stored before RoPE cannot hold:
kvcal.wiring.multimodal_refusal).
Gemma 3's and Gemma 4's decoders (Gemma 4's where use_bidirectional_attention is "vision") attend to an image's tokens
both ways (`image_blocks`: wired alone, the step's mask says which tokens see later ones, kvcal.wiring.own_tokens_ahead);
Molmo 2's (molmo2) is read alike, its mm_token_type_ids asking it to, though transformers' mask for it stays causal;
PaliGemma's (paligemma) its whole prompt (token type 0), its text alone read as what it writes (`text_inputs`), its
RoPE positions counted from 1 (`first_position`).
Llama 3.2 Vision's (mllama; its checkpoints load as MllamaForCausalLM, mllama_text_model) cross_attention_layers attend
across to an image instead of to the text: kvcal serves the others and leaves those to the model's attention over
transformers' own cache layers (`cross_attention`; kvcal.wiring.left_to_the_model), as a hybrid's state layers.
gpt-oss and Granite SWA add a learned sink logit per query head to each row's softmax (`LayerHandles.sinks`, passed
to attention as s_aux): kvcal.kv.softmax_with_sinks in the simulation, the fits and the torch reference; both decode
kernels' callers. Granite SWA keeps a rotary module per RoPE base (`ModelAdapter.layer_rotaries`), a layer's base in
config.layer_rope_theta (0: no RoPE); Molmo 2 a scaled one for its rope_scaling_layers and an unscaled one.
Gemma 2 and VaultGemma soft-cap their scaled scores (attn_logit_softcapping, `ModelAdapter.softcap`, passed to
attention as softcap): kvcal.kv.softcapped in the simulation, the fits and the torch reference; both kernels.
Gemma 2's and 3's, Ministral's, OLMo 3's, EXAONE 4's, Kolibri-1's, Cohere 2's, CWM's, Mellum's and AFMoE's layers
are of two types (`layer_types`: sliding-window and full attention); where the two rotate with their own frequencies
(Gemma 3, OLMo 3, Mellum) the rotary module holds `<type>_inv_freq` for each, where the others hold one `inv_freq`
(and their cos/sin scaling: OLMo 3 scales its full layers' by YaRN's). Llama 4's layers (llama4_text: Scout's and
Maverick's) attend in chunks (`chunks`: attention_chunk_size on its chunked_attention layers;
kvcal.spans.AttentionSpan) but every 4th, which is full and leaves RoPE out (`no_rope_layers`, as SmolLM3's); its
RoPE pairs neighbours, and it scales the queries of its full layers by position before the attention call (as
Ministral 3 does). Scout's RoPE layers then norm q and k (use_qk_norm: an RMS norm per head without a scale,
`LayerHandles.rope_norms`), which commutes with RoPE: kvcal reads the norm of the projections' output as the
pre-RoPE query and key, and takes the key's gradient after the norm, rotated back (kvcal.capture). NanoChat norms q
and k so too (its q_norm and k_norm, seen heads first), and its RoPE rotates by minus the angle: kvcal's rotation of
each pair's halves in the other order (kvcal.rope.rotate_half_order). Muse Spark and Muse Glimmer (muse_spark,
muse_glimmer: their decoder beside a vision tower) norm q and k by one such norm before RoPE, read alike
(`norms_before_rope`: the key's gradient after the norm needs no rotating back), and leave RoPE out of every fourth
layer (layer_rope_theta 0), a full one among sliding ones. Chameleon (chameleon) norms q and k before RoPE with a scale
and a bias, on rows of batch and tokens flattened into one, read alike (_FLAT_NORMS_BEFORE_ROPE); an image reaches it
as its VQ-GAN's codes, tokens of its vocabulary, as it reaches Emu3 (emu3; its checkpoints load as Emu3ForCausalLM,
emu3_text_model). SmolLM3 leaves RoPE out of some layers
(`no_rope_layers`, 0 for those), EXAONE 4, Kolibri-1, K-EXAONE, Cohere 2 and AFMoE out of their full-attention ones
(Cohere 2 MoE but its dense prefix layers, where it forces RoPE), Granite SWA out of those of RoPE base 0, Beam out
of those whose type's rope parameters are None (its full ones, whose queries it scales by position as Llama 4 does):
their keys are stored as if rotated by frequencies of zero and cos/sin scaled by 1, the identity, which every fit,
decode backend and artifact reads. Hunyuan (hunyuan_v1_dense, hunyuan_v1_moe) norms q and k after RoPE with a scale
per channel (its query_layernorm and key_layernorm), which does not commute with RoPE: kvcal reads the norms' output
as a model's without RoPE, its keys stored as the attention reads them (no pre-RoPE keys: KVQuant's recipe quantizes
the rotated ones there).
Scores are scaled by the attention module's `scaling`: head_dim ** -0.5 on most, query_pre_attn_scalar ** -0.5 on
Gemma 3 (168 ** -0.5 at 27B, where head_dim is 128), attention_multiplier on Granite and HyperCLOVA X; profiles record
it (`score_scale`) for the fits. Ministral 3 scales its queries by position past original_max_position_embeddings
before the attention call: the runtime reads them as scaled, the fits' captured queries are not (exact for windows
shorter than that). LongRoPE (Phi-3.5's, Phi-4-mini's) rotates by two sets of frequencies: a forward whose positions
reach past original_max_position_embeddings rotates every token by its long set (`long_rope`), a shorter one by its
short set, and generate recomputes the sequence when it first crosses over (kvcal.runtime.cache follows); PhiMoE's
(Phi-3.5-MoE's), as transformers runs it, rotates by its short set at any length and scales cos/sin by its mscale
(LongRope.scaling; served where its short and long mscales are equal). Refused,
beside other architectures: frequencies that change with every sequence length (dynamic NTK).
Multi-head latent attention (DeepSeek-V2's MLA: LATENT_ATTENTION_TYPES) caches per token one latent that every head
shares and one key that RoPE rotates: kvcal reads one KV head whose key is that rotated key and whose value is the
latent (`value_dims`), attended over exactly as cached (LatentAttention); calibrated, simulated and served by the
quantized cache (decoded by the CPU kernel or the torch reference), refused by Cocktail's cache and the exports
(ModelAdapter.refuse_latent). Kimi Linear's and bailing_hybrid's MLA layers sit among gated DeltaNet ones; Kimi
Linear's apply no RoPE. LongCat-Flash's decoder layers each hold two MLA, each a cache layer of its own
(_ATTENTION_SUBLAYERS), caching the latent times mla_scale_kv_lora. DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5,
Hy V4, A.X K2) gives MLA layers an indexer (LayerHandles.indexer) that keeps keys of its own and picks the tokens
each query attends to (Hy V4's shared layers attend to an earlier layer's pick): kvcal keeps its keys as the model
computes them and attends over the tokens it picks (kvcal.wiring.chosen_columns). MiniMax-M3's block-sparse layers
give GQA such an indexer, which picks blocks of keys per KV head (LayerHandles.pick_block), kept and attended alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.pytorch_utils import Conv1D

from kvcal.errors import KvcalError
from kvcal.rope import (in_order, padded_inv_freq, parity_merged, rotate_half_order, rows_in_order, stored_inv_freq,
                        stored_rope_scaling)
from kvcal.spans import AttentionSpan, attention_span
from kvcal.version import transformers_from, transformers_version

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                         "olmo2", "olmo3", "smollm3", "granite", "phi3", "exaone4", "seed_oss", "apertus", "cohere",
                         "cohere2", "ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "glm4_moe", "stablelm",
                         "nemotron", "starcoder2", "granitemoe", "granitemoeshared", "arcee", "cwm", "olmoe",
                         "minimax_m2", "gpt_oss", "gemma3_text", "gemma3", "gemma", "internlm3", "iquestcoder",
                         "ministral3", "solar_open", "mellum", "flex_olmo", "jais2", "hyperclovax", "exaone_moe",
                         "afmoe", "mistral3", "gemma2", "vaultgemma", "phi", "gpt_neox", "qwen3_5_text", "qwen3_5_moe_text",
                         "qwen3_next", "hy_v3", "dots1", "lfm2", "granitemoehybrid", "nemotron_h", "olmo_hybrid",
                         "lfm2_moe", "jamba", "falcon_h1", "gemma3n_text", "olmo", "bitnet", "qwen2_vl", "qwen2_5_vl",
                         "qwen3_vl", "qwen3_vl_moe", "llava", "internvl", "smolvlm", "idefics3", "aya_vision",
                         "gemma4_text", "gemma4", "cohere2_moe", "granite_swa", "granitemoe_swa", "llama4_text", "llama4",
                         "nanochat", "kolibri1", "gemma4_unified_text", "gemma4_unified", "beam", "opt", "gpt2",
                         "gpt_bigcode", "persimmon", "lfm3", "bamba", "minimax", "flint", "mimo_v2_flash",
                         "phimoe", "hunyuan_v1_dense", "hunyuan_v1_moe", "dbrx", "laguna",
                         "phi4_multimodal", "aria_text", "aria", "cohere_compass_text", "cohere_compass", "qwen3_5",
                         "qwen3_5_moe", "minimax_m3_vl_text", "minimax_m3_vl", "llava_next", "llava_onevision",
                         "idefics2", "lfm2_vl", "cohere2_vision", "lighton_ocr", "exaone4_5", "glm4v", "glm46v",
                         "glm4v_moe", "glm_ocr", "lfm3_vl", "vipllava", "llava_next_video", "video_llava",
                         "paddleocr_vl", "hyperclovax_vision_v2", "ernie4_5_vl_moe", "hunyuan_vl",
                         "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "muse_spark", "muse_glimmer", "step3p7",
                         "deepseek_vl", "janus", "qianfan_ocr", "cosmos3_omni", "granite_docling", "ovis2",
                         "video_llama_3", "cosmos3_edge", "deepseek_ocr2", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr",
                         "deepseek_vl_hybrid", "glmga", "molmo2", "nemotron_h_omni", "granite4_vision",
                         "mllama", "mllama_text_model", "biogpt", "got_ocr2", "fuyu", "chameleon", "emu3",
                         "emu3_text_model", "paligemma", "exaone", "param2moe", "sarvam_moe", "minicpm5_moe",
                         "lara_mini", "llava_onevision1_5", "ovis2_5", "ergo", "apertus1p5_text", "apertus1p5", "falcon",
                         "gptj", "codegen")
# multi-head latent attention (DeepSeek-V2's MLA: LatentAttention; Kimi K2.5's: its DeepSeek-V3 decoder beside a vision
# tower): Cocktail's cache and the exports refuse these so far (ModelAdapter.refuse_latent)
LATENT_ATTENTION_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "minicpm3", "kimi_k25",
                          "glm4_moe_lite", "youtu", "axk1", "kimi_linear", "bailing_hybrid", "mistral4", "longcat_flash",
                          "sarvam_mla", "hy_v4_vl")
# the decoders of composites served as MLA above whose type is no model of its own (Hy V4 VL's)
_LATENT_DECODERS = ("hy_v4_vl_text",)
# MLA whose RoPE pairs neighbouring channels (2i, 2i+1): DeepSeek-V2's leaves them so, these de-interleave them into
# kvcal's order always (DeepSeek-V3's where rope_interleave, and its kin's)
_DEINTERLEAVED_LATENT_ROPE = ("bailing_hybrid", "deepseek_v32", "glm_moe_dsa", "axk2", "longcat_flash")
# ... and from transformers 5.25 on (before, Hy V4's attention rotated halves)
_DEINTERLEAVED_LATENT_ROPE_FROM_5_25 = ("hy_v4", "hy_v4_vl_text")
# decoder layers holding this many attention sublayers (`self_attn` a ModuleList), each a layer of the cache of its own
# (LongCat-Flash's two MLA: cache layers 2i and 2i + 1 of decoder layer i, config.num_hidden_layers counting them)
_ATTENTION_SUBLAYERS = {"longcat_flash": 2}
# LongRoPE whose rotary rotates by its short frequencies at any length and scales cos/sin by the config's mscales
# (transformers' PhiMoE: its rope_init_fn is called without the forward's length)
_MSCALED_LONGROPE = ("phimoe",)
# where q/k norms see (batch, heads, tokens, head_dim) (the projections' output transposed first), not (batch, tokens,
# heads, head_dim): the norms' output shape alone cannot tell the two apart when tokens == heads
_HEADS_FIRST_NORMS = ("gemma3_text", "exaone4", "exaone_moe", "kolibri1", "apertus", "stablelm", "phi", "hy_v3",
                      "nanochat", "hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text", "muse_spark_text",
                      "muse_glimmer_text", "apertus1p5_text")
# RoPE in pairs of neighbouring channels (2i, 2i+1), as GLM first did; the others rotate halves (i, i + rotary dims/2)
_INTERLEAVED_ROPE = ("cohere", "cohere2", "cohere2_moe", "ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "llama4_text",
                     "glm4v_text", "glm_ocr_text", "ernie4_5_vl_moe_text", "ergo", "gptj", "codegen")
# a rotary module holding each position's sines, then cosines (`embed_positions`), of frequencies base 10000 over its
# width (GPT-J's and CodeGen's create_sinusoidal_positions), instead of inv_freq
_SINUSOID_TABLE_ROPE = ("gptj", "codegen")
# q and k normed per head after RoPE, without a scale (Llama 4 Scout's use_qk_norm: the attention's qk_norm; NanoChat's
# q_norm and k_norm)
_NORMED_AFTER_ROPE = ("llama4_text", "nanochat")
# q and k normed per head before RoPE by one norm without a scale (Muse Spark's and Muse Glimmer's qk_norm): read as
# _NORMED_AFTER_ROPE's, a norm without a scale commuting with RoPE, but its output is the pre-RoPE key
_SHARED_NORM_BEFORE_ROPE = ("muse_spark_text", "muse_glimmer_text")
# q and k normed per head before RoPE (with a scale and a bias) on rows whose batch and tokens the attention flattens
# into one dimension (Chameleon's q_norm and k_norm): their output tells no sequence apart, so kvcal reads the
# projections' output and norms it itself, as _SHARED_NORM_BEFORE_ROPE's
_FLAT_NORMS_BEFORE_ROPE = ("chameleon",)
# multimodal RoPE whose rotary keeps its height and width sections' frequencies split by parity, which its forward
# interleaves back (ERNIE 4.5 VL's: ModelAdapter.parity_split)
_PARITY_SPLIT_ROPE = ("ernie4_5_vl_moe_text",)
# RoPE rotating by minus the angle, its halves' roles swapped (NanoChat's rotate_half): kvcal's rotation of the halves
# in the other order
_HALVES_SWAPPED_ROPE = ("nanochat",)
# attention sinks: a learned logit per query head beside every row's scores (`sinks`, passed to attention as s_aux)
_SINKS = ("gpt_oss", "granite_swa", "granitemoe_swa", "flint", "hy_v4", "hy_v4_vl_text", "mimo_v2_flash")
# values of their own width (config.v_head_dim) beside wider keys, outside MLA (MiMo-V2-Flash's), and twice the KV heads
# on sliding layers as on full ones
_NARROW_VALUES = ("mimo_v2_flash",)
_SLIDING_KV_HEADS_DOUBLED = ("mimo_v2_flash",)
# one rotary module per RoPE base (`rotary_embs`), each layer rotating by its config.layer_rope_theta (0: none)
_ROTARY_PER_BASE = ("granite_swa", "granitemoe_swa")
# a scaled rotary module (`rotary_emb`) rotating the layers of config.rope_scaling_layers, an unscaled one
# (`rotary_emb_unscaled`, of rope_type default) the others (Molmo 2's)
_ROTARY_SCALED_BY_LAYER = ("molmo2_text",)
# composites whose decoder attends over image tokens causally, as over text: kvcal wires their decoder alone, the vision
# tower runs its own attention, and the cache holds image tokens as text (Qwen-VL's at multimodal RoPE positions, which
# keys stored before RoPE cannot hold: kvcal.wiring.multimodal_refusal)
_IMAGES_AS_TOKENS = ("mistral3", "llava", "internvl", "smolvlm", "idefics3", "aya_vision", "aria", "cohere_compass",
                     "qwen3_5", "qwen3_5_moe", "kimi_k25", "qwen2_vl", "qwen2_5_vl",
                     "qwen3_vl", "qwen3_vl_moe", "llama4", "minimax_m3_vl", "llava_next", "llava_onevision",
                     "idefics2", "lfm2_vl", "cohere2_vision", "lighton_ocr", "exaone4_5", "glm4v", "glm46v", "glm4v_moe",
                     "glm_ocr", "lfm3_vl", "vipllava", "llava_next_video", "video_llava", "paddleocr_vl",
                     "hyperclovax_vision_v2", "ernie4_5_vl_moe", "hunyuan_vl", "qwen2_5_omni_thinker",
                     "qwen3_omni_moe_thinker", "muse_spark", "muse_glimmer", "step3p7", "deepseek_vl", "janus",
                     "qianfan_ocr", "cosmos3_omni", "granite_docling", "ovis2", "video_llama_3", "cosmos3_edge",
                     "deepseek_ocr2", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "deepseek_vl_hybrid",
                     "glmga", "nemotron_h_omni", "granite4_vision", "got_ocr2", "fuyu", "chameleon", "emu3",
                     "llava_onevision1_5", "ovis2_5", "hy_v4_vl", "apertus1p5")
# composites whose decoder attends to an image's tokens both ways (token_type_ids; Molmo 2's mm_token_type_ids, which
# transformers' mask does not honour so far): wired alone as the above, the step's mask saying which tokens see later ones
_IMAGE_BLOCKS = ("gemma3", "gemma4", "gemma4_unified", "molmo2", "paligemma")
# composites whose decoder attends its prompt both ways, told which tokens are the prompt's by token_type_ids 0
# (PaliGemma's: its attention modules not causal, use_bidirectional_attention): read as _IMAGE_BLOCKS', by the step's
# mask; text alone is read as what it writes, causally (token_type_ids 1: text_inputs), and a step of several tokens
# handed no mask, which it would attend both ways, is refused (kvcal.wiring.refuse_unmasked_step)
_PREFIX_LM = ("paligemma",)
# models whose RoPE positions count from 1, not 0 (PaliGemma's position_ids): the simulation and the profile rotate by
# them (first_position); the runtime cache reads each sequence's first position from the model's position ids
_POSITIONS_FROM_ONE = ("paligemma",)
# models whose image and audio encoders sit inside the decoder's own module, their configs sub-configs of its text
# config (Phi-4-multimodal's embed_tokens_extend): their images' tokens read causally, as text, once embedded
_ENCODERS_INSIDE = ("phi4_multimodal",)
# q and k normed per head after RoPE with a learned scale per channel (Hunyuan's query_layernorm and key_layernorm): the
# norm's scale does not commute with RoPE, so kvcal stores the key the attention reads, rotated and normed, as a
# model's without RoPE (its rotary left out; the norms are its q and k norms)
_SCALED_NORMS_AFTER_ROPE = ("hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text")
# where their decoder has no rotary module, these apply no RoPE at all (Granite 4.0-H: position_embedding_type not
# "rope"; OLMo Hybrid: no rope_theta, as released; Nemotron-H, Jamba and Kimi Linear, whose MLA's "rotated" key is
# not rotated, always): every layer is NoPE
_NOPE_WITHOUT_ROTARY = ("granitemoehybrid", "nemotron_h", "jamba", "olmo_hybrid", "opt", "gpt2", "gpt_bigcode",
                        "kimi_linear", "biogpt")
# Nemotron-H: its attention blocks' mixer; Mllama: its cross-attention layers' cross_attn
_ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn", "mixer", "cross_attn")
# decoder layers of these types hold no keys and values but a recurrent state (Qwen3-Next's and Qwen3.5's gated
# DeltaNet, LFM2's convolutions, Granite 4.0-H's and Nemotron-H's Mamba 2) or nothing (Nemotron-H's MLP and MoE
# blocks): kvcal quantizes the other layers' cache and leaves theirs to transformers' own
_STATE_LAYER_TYPES = ("linear_attention", "conv", "mlp", "moe")
# decoder layers attending over another sequence (Mllama's cross-attention layers: over an image's tokens, their keys
# and values made once from the vision tower's output, when the model is given one): kvcal leaves them, and their
# cache layer, to transformers, as the above (ModelAdapter.cross_attention)
_CROSS_ATTENTION = "cross_attention"
# layers that attend and also run a recurrent mixer beside their attention (Falcon-H1's Mamba 2), whose state
# transformers' cache layer keeps next to the keys and values
_ATTENTION_AND_STATE_TYPES = ("hybrid",)
# DeepSeek Sparse Attention's layers: MLA whose queries attend to the tokens an indexer picks (LayerHandles.sparse)
_INDEXED_ATTENTION = "indexed_attention"
# MiniMax-M3's block-sparse layers (GQA whose queries attend to the key blocks a lightning indexer picks), by kvcal's name
_LAYER_TYPE_NAMES = {"minimax_m3_sparse": _INDEXED_ATTENTION}
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", _INDEXED_ATTENTION,
                          *_ATTENTION_AND_STATE_TYPES)
# where a refusal sends a user for the types kvcal serves (a list of them all would bury the refusal's line)
_SERVED_ONES = (f"`kvcal models` lists the {len(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES)} model types kvcal "
                "serves")
# Keys of config.to_dict() that change with how a model was saved or loaded, not with what it computes
# (`architectures` is filled in by save_pretrained; the class name is in the fingerprint already).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures"}


def _canonical(config: dict) -> dict:
    """A config's dict without what loading it changes (_VOLATILE_CONFIG_KEYS), in its sub-configs too (DBRX's
    attn_config: its dtype None as made, the weights' once loaded)."""
    return {k: _canonical(v) if isinstance(v, dict) else v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}


@dataclass
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2's MLA). A token caches one latent c (kv_lora_rank channels, the
    kv_a_layernorm output) shared by every head, and one key k_rope of qk_rope_head_dim channels that RoPE rotates;
    head h's key is [W_UK^h c ; k_rope] and its value W_UV^h c (kv_b_proj's rows: per head nope_dim of W_UK, then
    value_dim of W_UV). Attention is exact over the cache as stored: q . key = (q_nope W_UK^h) . c + q_rope . k_rope,
    and the output is W_UV^h (p . c). kvcal caches k_rope as the key (one KV head) and the latent as the value."""

    kv_b_proj: nn.Linear
    nope_dim: int  # the channels of each head's query and key that RoPE leaves alone, before its rotated ones
    value_dim: int  # the channels of each head's output
    # RoPE leaves the query's and key's rotated channels in kvcal's order (rope_interleave de-interleaves them), not the
    # model's: the query attention is handed, and the rotated key transformers' cache is handed
    rope_in_order: bool

    def _per_head(self) -> torch.Tensor:
        """(heads, nope_dim + value_dim, latent channels): W_UK^h above W_UV^h."""
        return self.kv_b_proj.weight.unflatten(0, (-1, self.nope_dim + self.value_dim))

    def latent_query(self, query: torch.Tensor) -> torch.Tensor:
        """(..., heads, tokens, nope_dim) -> (..., heads, tokens, latent channels): q_nope W_UK^h, in float32."""
        return query.float() @ self._per_head()[:, : self.nope_dim].float()

    def head_outputs(self, latent_outputs: torch.Tensor) -> torch.Tensor:
        """(..., heads, tokens, latent channels) -> (..., heads, tokens, value_dim): W_UV^h (p . c), in float32."""
        return latent_outputs.float() @ self._per_head()[:, self.nope_dim :].float().transpose(-1, -2)


@dataclass
class LayerHandles:
    index: int
    attention: nn.Module
    q_proj: nn.Module  # where q, k and v come from one fused linear (Phi-3's qkv_proj), that one for each
    k_proj: nn.Module  # nn.Linear, or GPT-2's Conv1D (its weight (inputs, outputs))
    v_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    v_norm: nn.Module | None = None  # a norm of each value head (Gemma 3n's, without a scale): the value is its output
    # the norms of each query head and each key head after RoPE, without a scale (Llama 4 Scout's one qk_norm for both,
    # NanoChat's q_norm and k_norm): they commute with RoPE, a rotation, so the pre-RoPE query and key are their output
    # on the projections' output (source_rows)
    rope_norms: tuple[nn.Module, nn.Module] | None = None
    # rope_norms run before RoPE (Muse Spark's; Chameleon's, with a scale): their output is the pre-RoPE key
    norms_before_rope: bool = False
    head_dim: int = 0  # the channels of each head, which rope_norms norm together
    heads_first: bool = False  # the q/k norms' output is (batch, heads, tokens, head_dim)
    rope_order: tuple[int, ...] | None = None  # per head, the model's channel at each of kvcal's (kvcal.rope); None: the same
    sinks: torch.Tensor | None = None  # (heads,) the attention sinks' logits (gpt-oss), None where it has none
    key_multiplier: float = 1.0  # the key is the key source's output times this (Falcon-H1's key_multiplier, Ergo's)
    query_multiplier: float = 1.0  # the query is the query source's output times this (Ergo's qk_scale)
    value_multiplier: float = 1.0  # the value is the value source's output times this (MiMo-V2-Flash's v_scale)
    # q, k and v are their source's output clamped to [-clip, clip] (DBRX's, OLMo 1.7's and OLMoE's clip_qkv; OLMo's
    # and OLMoE's clamp in place after the hooks read it); None: not clamped. The gradient with respect to the output
    # is 0 where the model clamps (a hook on it sees the gradient before an in-place clamp): Fisher weighs those 0
    clip: float | None = None
    # (head_dim,) in kvcal's order: 1 / the cos/sin scaling on the channels RoPE leaves alone, 1 on the others, where RoPE
    # covers part of each head and scales cos/sin (Phi-4-mini's LongRoPE): kvcal's rotation scales every channel (by
    # frequency 0 on those), so the pre-RoPE query and key it reads hold those channels divided by it; None: no such
    unrotated_scale: torch.Tensor | None = None
    # the value is v_norm of k_proj's output, the key k_norm of it (Gemma 4's attention_k_eq_v): v_proj is k_proj
    value_from_key_projection: bool = False
    # each of q, k, v: its output columns of its projection (all of them, but in a fused one: a slice where the three lie
    # side by side, an index where they alternate by head)
    columns: dict[str, slice | torch.Tensor] = field(default_factory=lambda: dict.fromkeys("qkv", slice(None)))
    latent: LatentAttention | None = None  # MLA: k_proj and v_proj are kv_a_proj_with_mqa, v_norm its kv_a_layernorm
    # sparse attention: its attention is handed the columns of the mask each query attends, picked by its own indexer,
    # which keeps keys of its own, or by an earlier layer's (Hy V4's shared layers: indexer None). DeepSeek Sparse
    # Attention's (MLA): the top index_topk tokens by the indexer's scores (`indices`; Cache.update_indexer); MiniMax-M3's
    # (GQA): per KV head, the top blocks of `pick_block` keys (`block_indices`; its cache layer's update_index)
    sparse: bool = False
    indexer: nn.Module | None = None
    pick_block: int = 1

    @property
    def query_source(self) -> nn.Module:
        """The module whose output holds the pre-RoPE query."""
        return self.q_norm if self.q_norm is not None else self.q_proj

    @property
    def key_source(self) -> nn.Module:
        """The module whose output holds the pre-RoPE key."""
        return self.k_norm if self.k_norm is not None else self.k_proj

    @property
    def value_source(self) -> nn.Module:
        """The module whose output holds the value."""
        return self.v_norm if self.v_norm is not None else self.v_proj

    def source_rows(self, kind: str, output: torch.Tensor, gradient: bool = False) -> torch.Tensor:
        """The query (kind "q"), key ("k") or value ("v") in its source's output (query_source, key_source, value_source),
        or the gradient with respect to it in the gradient with respect to that output (`gradient`), as (batch,
        tokens, heads * head_dim)."""
        if self.heads_first and output.dim() == 4:
            rows = output.transpose(1, 2).flatten(2)
        else:
            normed = {"q": self.q_norm, "k": self.k_norm, "v": self.v_norm}[kind] is not None
            rows = output.flatten(2) if normed else output.flatten(2)[..., self.columns[kind]]
        if self.clip is not None and not gradient:
            rows = rows.clamp(-self.clip, self.clip)
        multiplier = {"q": self.query_multiplier, "k": self.key_multiplier}.get(kind, 1.0)
        if multiplier != 1.0:  # key = output * m, so dL/dkey = dL/doutput / m (a query likewise)
            rows = rows / multiplier if gradient else rows * multiplier
        if kind != "v" and self.rope_norms is not None:
            if gradient:  # the norm's Jacobian drops the gradient along the key: capture takes it after the norm
                raise ValueError("the gradient with respect to a key normed after RoPE is not in its projection's")
            # forward, not __call__: the norm's hooks (capture's) see the model's own calls only
            rows = self.rope_norms["qk".index(kind)].forward(rows.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        if kind == "v":
            if self.value_multiplier != 1.0:  # value = output * m, so dL/dvalue = dL/doutput / m
                rows = rows / self.value_multiplier if gradient else rows * self.value_multiplier
            return rows
        rows = rows_in_order(rows, self.rope_order)
        if self.unrotated_scale is not None:  # read = output * scale, so dL/dread = dL/doutput / scale
            if self.unrotated_scale.device != rows.device:  # moved once: a copy from the host would wait for the device
                self.unrotated_scale = self.unrotated_scale.to(rows.device)
            scale = self.unrotated_scale.to(rows.dtype).repeat(rows.shape[-1] // len(self.unrotated_scale))
            rows = rows / scale if gradient else rows * scale
        return rows

    def weight_gradient(self, kind: str) -> torch.Tensor:
        """dL/dW_k (kind "k") or dL/dW_v ("v"): the gradient's rows of that projection (both: the one projection's
        where the value is made from k_proj's output, value_from_key_projection)."""
        projection = self.k_proj if kind == "k" else self.v_proj
        if isinstance(projection, Conv1D):
            return projection.weight.grad[:, self.columns[kind]].T
        return projection.weight.grad[self.columns[kind]]


@dataclass(frozen=True)
class LongRope:
    """LongRoPE's second set of frequencies: a forward whose positions reach past `switch` (the config's
    original_max_position_embeddings) rotates every token by `long_inv_freq`, a shorter forward by the rotary's own
    (transformers' longrope update)."""

    switch: int
    long_inv_freq: torch.Tensor  # (rotated channels / 2,) float32 on the CPU, as the rotary holds its own
    scaling: float | None = None  # the cos/sin scaling of every forward where the rotary's own is not it (PhiMoE's)

    def check_prefill_steps(self, tokens: int, step: int) -> None:
        """Refuse a prefill of `tokens` tokens in steps of `step` that ends past the switch and whose first step does
        not: its steps would rotate by both sets, as no forward of the model over those tokens does."""
        if step <= self.switch < tokens:
            raise KvcalError(f"a prefill of {tokens} tokens in steps of {step} rotates its first steps by LongRoPE's short "
                             f"frequencies and the others by its long ones, past {self.switch}; give a prefill chunk of "
                             f"more than {self.switch} tokens, or none")


@dataclass
class ReaderLayer:
    """A decoder layer that attends over another layer's keys and values, keeping none of its own (KV sharing: Gemma
    3n's last layers read those of the last earlier layer of their type)."""

    decoder_index: int
    attention: nn.Module
    source: int  # the adapter layer (an index into ModelAdapter.layers) whose cache it reads


@dataclass
class ModelAdapter:
    architecture: str
    model_type: str
    layers: list[LayerHandles]
    query_heads: list[int]  # per layer, its query heads (Laguna: more on its sliding-window layers)
    kv_heads: list[int]  # per layer, its KV heads (Gemma 4: fewer on its full-attention layers)
    head_dims: list[int]  # per layer, the channels of each of its heads, query and KV (Gemma 4: twice as many on full ones)
    # per layer, the channels of each of its KV heads' values: head_dims but where the latent is the value (MLA)
    value_dims: list[int]
    max_positions: int
    rotary: nn.Module | None  # None: no layer applies RoPE (_NOPE_WITHOUT_ROTARY)
    config_dict: dict
    layer_types: list[str | None]  # per layer, the rotary's name for its frequencies (None: its one `inv_freq`)
    windows: list[int | None]  # per layer, its sliding window (transformers' cache keeps its last window - 1 tokens), or None
    chunks: list[int | None]  # per layer, its attention chunk (Llama 4's chunked layers), or None
    rotated: list[bool]  # per layer, whether it applies RoPE (not SmolLM3's NoPE layers, EXAONE 4's full ones)
    score_scale: float  # what the attention multiplies q . k by
    softcap: float | None = None  # scaled scores soft-capped to (-softcap, softcap) (Gemma 2), or None
    # the decoder layer of each of `layers` (its layer_idx); a hybrid model's others hold a recurrent state instead
    model_layers: tuple[int, ...] = ()
    num_model_layers: int = 0
    # per layer, whether a recurrent mixer beside its attention keeps a state in the same cache layer (Falcon-H1)
    keeps_state: list[bool] = field(default_factory=list)
    readers: tuple[ReaderLayer, ...] = ()  # the decoder layers reading the cache of one of `layers` (KV sharing)
    images_as_tokens: bool = False  # a composite whose decoder reads image tokens as text (_IMAGES_AS_TOKENS)
    image_blocks: bool = False  # a composite whose decoder attends to an image's tokens both ways (_IMAGE_BLOCKS)
    encoders_inside: bool = False  # image and audio encoders inside the decoder's module (_ENCODERS_INSIDE)
    # per layer, the module holding its frequencies where the model keeps several (_ROTARY_PER_BASE: one per RoPE base,
    # None for a layer without RoPE; _ROTARY_SCALED_BY_LAYER); empty: `rotary` holds every layer's
    layer_rotaries: tuple[nn.Module | None, ...] = ()
    long_rope: LongRope | None = None  # LongRoPE's long frequencies and where they take over, None for other RoPE
    # the first frequencies the rotary keeps split by parity (kvcal.rope.parity_merged: ERNIE 4.5 VL's height and width
    # sections), 0: none
    parity_split: int = 0
    # decoder layer -> attention module of the layers attending over another sequence (_CROSS_ATTENTION), which run the
    # model's own attention over transformers' cache layer
    cross_attention: dict[int, nn.Module] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        """Whether some decoder layers keep no keys and values of their own (a recurrent state, transformers' to keep;
        or another layer's cache, which they read)."""
        return len(self.model_layers) != self.num_model_layers

    @property
    def spans(self) -> list[AttentionSpan | None]:
        """Per layer, the earlier tokens its queries see where not all: its sliding window or attention chunk."""
        return [attention_span(window, chunk) for window, chunk in zip(self.windows, self.chunks)]

    @property
    def prefix_lm(self) -> bool:
        """Whether the decoder attends its prompt both ways, told by token types (_PREFIX_LM: PaliGemma)."""
        return self.model_type in _PREFIX_LM

    @property
    def first_position(self) -> int:
        """The RoPE position of a sequence's first token (first_position of its fingerprint)."""
        return first_position({"model_type": self.model_type})

    @property
    def decoder_kind(self) -> str:
        """What the decoder holds besides its layers' KV caches (decoder_kind of its fingerprint)."""
        return decoder_kind(self.fingerprint())

    def refuse_latent(self, what: str) -> None:
        """Refuse `what` (Cocktail's cache, an export) for an MLA model, which kvcal calibrates, evaluates in simulation
        and serves in its quantized cache so far."""
        if self.latent:
            raise KvcalError(f"{self.model_type}: kvcal serves its multi-head latent attention (MLA) in calibration, "
                             f"`kvcal eval ppl` and its quantized cache so far; {what} does not take it yet")

    def readers_of(self, layer: int) -> list[ReaderLayer]:
        return [reader for reader in self.readers if reader.source == layer]

    @property
    def kv_widths(self) -> list[int]:
        """Per layer, the channels of one token's keys (and values, but of MLA): its KV heads side by side."""
        return [kv_heads * head_dim for kv_heads, head_dim in zip(self.kv_heads, self.head_dims)]

    @property
    def value_widths(self) -> list[int]:
        """Per layer, the channels of one token's values: its KV heads side by side."""
        return [kv_heads * value_dim for kv_heads, value_dim in zip(self.kv_heads, self.value_dims)]

    @property
    def picks_key_blocks(self) -> bool:
        """Whether a layer attends to the key blocks an indexer picks by cache column (MiniMax-M3's, beside GQA)."""
        return any(handles.sparse and handles.latent is None for handles in self.layers)

    @property
    def index_widths(self) -> list[int]:
        """Per layer, the channels of one token's indexer key (a sparse layer's), 0 where it has no indexer."""
        return [handles.indexer.head_dim if handles.indexer is not None else 0 for handles in self.layers]

    def index_bytes(self, dtype: torch.dtype) -> list[int]:
        """Per layer, the bytes of one token's indexer key kept in `dtype` (the model's: kvcal keeps them as computed)."""
        return [width * dtype.itemsize for width in self.index_widths]

    @property
    def latent(self) -> bool:
        """Whether the model's attention is multi-head latent attention (LatentAttention), its values the latent."""
        return self.layers[0].latent is not None

    @property
    def rope_orders(self) -> list[tuple[int, ...] | None]:
        """Per layer, the model's channel at each of kvcal's in each head (kvcal.rope); None: the same."""
        return [handles.rope_order for handles in self.layers]

    def in_rope_order(self, heads: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s queries or keys (..., head_dim) of the model in kvcal's channel order
        (kvcal.rope.rotate_half_order)."""
        return in_order(heads, self.layers[layer].rope_order)

    def rows_in_rope_order(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s queries or keys (..., heads * head_dim), the heads side by side, in kvcal's channel order."""
        return rows_in_order(rows, self.layers[layer].rope_order)

    def layer_inv_freq(self, layer: int, tokens: int = 0) -> torch.Tensor:
        """Layer `layer`'s RoPE frequencies (head_dim/2,) in kvcal's channel order, float32 on the CPU, in a forward
        whose last position is below `tokens`: LongRoPE's long set past its switch, else its short set, which its
        rotary keeps as `original_inv_freq` (its `inv_freq` holds the last forward's)."""
        if not self.rotated[layer]:
            return torch.zeros(self.head_dims[layer] // 2)
        rotary = self._layer_rotary(layer)
        if self.long_rope is None:
            inv_freq = _rotary_inv_freq(rotary, self.layer_types[layer])
        else:
            inv_freq = self.long_rope.long_inv_freq if tokens > self.long_rope.switch else rotary.original_inv_freq
        inv_freq = inv_freq.detach().float().cpu()
        if self.parity_split:
            inv_freq = parity_merged(inv_freq, self.parity_split)
        return padded_inv_freq(inv_freq, self.head_dims[layer])

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies of a forward within LongRoPE's switch (of any forward, for other RoPE), as artifacts store
        them: (head_dim/2,) shared by every layer, else (layers, largest head_dim/2) (kvcal.rope.stored_inv_freq)."""
        return stored_inv_freq([self.layer_inv_freq(i) for i in range(len(self.layers))])

    def layer_rope_scaling(self, layer: int) -> float:
        """Layer `layer`'s cos/sin scaling (YaRN's, for one; PhiMoE's mscale; 1 where the layer applies no RoPE)."""
        if not self.rotated[layer]:
            return 1.0
        if self.long_rope is not None and self.long_rope.scaling is not None:
            return self.long_rope.scaling
        return float(getattr(self._layer_rotary(layer), _rotary_name(self.layer_types[layer], "attention_scaling"), 1.0))

    def _layer_rotary(self, layer: int) -> nn.Module | None:
        return self.layer_rotaries[layer] if self.layer_rotaries else self.rotary

    @property
    def rope_scaling(self) -> float | list[float]:
        """The cos/sin scaling artifacts record: one number shared by every layer, else one a layer."""
        return stored_rope_scaling([self.layer_rope_scaling(i) for i in range(len(self.layers))])

    def check_seqlen(self, seqlen: int) -> None:
        if self.max_positions and seqlen > self.max_positions:
            raise KvcalError(f"--seqlen {seqlen} is above the model's maximum of {self.max_positions} positions")

    def fingerprint(self) -> dict:
        """What an artifact records to refuse being used with another model."""
        digest = hashlib.sha256(json.dumps(_canonical(self.config_dict), sort_keys=True, default=str).encode()).hexdigest()
        rope = self.config_dict.get("rope_parameters") or {
            "rope_theta": self.config_dict.get("rope_theta"),
            "rope_scaling": self.config_dict.get("rope_scaling"),
        }
        fingerprint = {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": len(self.layers),
            "num_heads": self.query_heads[0],
            "num_kv_heads": self.kv_heads[0],
            "head_dim": self.head_dims[0],
            "max_positions": self.max_positions,
            "rope": rope,
            "config_sha256": digest[:16],
        }
        orders = self.rope_orders
        if len(set(orders)) > 1:  # the channel order of each layer's keys and queries an artifact holds (rope_orders)
            fingerprint["layer_rope_orders"] = [list(order) if order is not None else None for order in orders]
        elif orders[0] is not None:  # ... of every layer's
            fingerprint["rope_order"] = list(orders[0])
        if self.hybrid:  # which decoder layers an artifact's layers are
            fingerprint["attention_layers"] = list(self.model_layers)
        if len(set(zip(self.kv_heads, self.head_dims))) > 1:  # each layer's, where they differ (kv_shapes reads either)
            fingerprint.update(layer_kv_heads=list(self.kv_heads), layer_head_dims=list(self.head_dims))
        if len(set(self.query_heads)) > 1:  # ... and query_heads
            fingerprint["layer_num_heads"] = list(self.query_heads)
        if self.latent:  # MLA: its values (the latent) are as wide as no head
            fingerprint["value_dim"] = self.value_dims[0]
        elif self.value_dims != self.head_dims:  # values narrower than keys (MiMo-V2-Flash's)
            fingerprint["layer_value_dims"] = list(self.value_dims)
        if any(self.index_widths):  # DeepSeek Sparse Attention: the indexer keys the cache keeps beside K and V
            fingerprint["layer_index_dims"] = self.index_widths
        return fingerprint


def query_heads(fingerprint: dict) -> list[int]:
    """Per layer of an artifact's model, its query heads: the fingerprint's layer_num_heads where its layers differ
    (Laguna), its one num_heads else."""
    return fingerprint.get("layer_num_heads", [fingerprint["num_heads"]] * fingerprint["num_layers"])


def rope_orders(fingerprint: dict) -> list[tuple[int, ...] | None]:
    """Per layer of an artifact's model, the model's channel at each of kvcal's in each head of its keys and queries
    (kvcal.rope; None: the same): the fingerprint's layer_rope_orders where its layers differ (Laguna's rotate their
    own share of channels), its one rope_order else."""
    if "layer_rope_orders" in fingerprint:
        return [tuple(order) if order is not None else None for order in fingerprint["layer_rope_orders"]]
    order = fingerprint.get("rope_order")
    return [tuple(order) if order is not None else None] * fingerprint["num_layers"]


def kv_shapes(fingerprint: dict, kind: str = "k") -> list[tuple[int, int]]:
    """Per layer of an artifact's model, (KV heads, channels of each head's keys (kind "k") or values ("v")): the
    fingerprint's per-layer lists where its layers differ (Gemma 4), its one num_kv_heads and head_dim else; MLA's
    values are its latent, value_dim wide; values narrower than keys are layer_value_dims wide (MiMo-V2-Flash's)."""
    layers = fingerprint["num_layers"]
    kv_heads = fingerprint.get("layer_kv_heads", [fingerprint["num_kv_heads"]] * layers)
    head_dims = fingerprint.get("layer_head_dims", [fingerprint["head_dim"]] * layers)
    if kind == "v" and latent_attention(fingerprint):
        head_dims = [fingerprint["value_dim"]] * layers
    elif kind == "v" and "layer_value_dims" in fingerprint:
        head_dims = fingerprint["layer_value_dims"]
    return list(zip(kv_heads, head_dims))


# model types whose layers may read another layer's cache (KV sharing), and whose every layer runs a recurrent mixer
# beside its attention (Falcon-H1): what an artifact's fingerprint tells of its decoder with its attention_layers
_KV_SHARING_TYPES = ("gemma3n_text", "gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
_STATE_BESIDE_ATTENTION_TYPES = ("falcon_h1",)
_CROSS_ATTENDING_TYPES = ("mllama", "mllama_text_model")  # (Mllama's composite is served as its causal LM)


def first_position(fingerprint: dict) -> int:
    """The RoPE position of a sequence's first token in an artifact's model (_POSITIONS_FROM_ONE: 1; others 0)."""
    return 1 if fingerprint["model_type"] in _POSITIONS_FROM_ONE else 0


def decoder_kind(fingerprint: dict) -> str:
    """What an artifact's model's decoder holds besides its layers' KV caches, as engines tell models apart (vLLM's
    TurboQuant boundary layers): "dense" (nothing), "recurrent" (a Mamba, DeltaNet or convolution state: hybrids,
    Falcon-H1), "shared" (layers reading another's cache: Gemma 3n, Gemma 4 E2B / E4B) or "cross" (layers attending
    across to an image, their cache transformers' to keep: Mllama)."""
    if "attention_layers" in fingerprint and fingerprint["model_type"] in _KV_SHARING_TYPES:
        return "shared"
    if fingerprint["model_type"] in _CROSS_ATTENDING_TYPES:
        return "cross"
    if "attention_layers" in fingerprint or fingerprint["model_type"] in _STATE_BESIDE_ATTENTION_TYPES:
        return "recurrent"
    return "dense"


def served_types() -> list[tuple[str, str, str]]:
    """Every model type kvcal serves, sorted, each with how its decoder is read and what the installed transformers
    lacks to load it ("" where nothing): (model_type, kind, missing)."""
    def kind(model_type: str) -> str:
        latent = "multi-head latent attention" if model_type in LATENT_ATTENTION_TYPES else ""
        beside = ("decoder beside a vision tower, images cached as tokens" if model_type in _IMAGES_AS_TOKENS else
                  "decoder beside a vision tower, its prompt attended both ways" if model_type in _PREFIX_LM else
                  "decoder beside a vision tower, images attended both ways" if model_type in _IMAGE_BLOCKS else
                  "decoder with image and audio encoders inside" if model_type in _ENCODERS_INSIDE else
                  "decoder attending across to an image in some layers" if model_type in _CROSS_ATTENDING_TYPES else "")
        return "; ".join(part for part in (latent, beside) if part) or "decoder"

    def missing(model_type: str) -> str:
        if model_type not in CONFIG_MAPPING_NAMES:
            return f"not in transformers {transformers_version()}"
        return "" if served_by_installed_transformers(model_type) else "needs transformers {}.{}".format(
            *_SERVED_FROM[model_type])

    return [(model_type, kind(model_type), missing(model_type))
            for model_type in sorted(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES)]


def latent_attention(fingerprint: dict) -> bool:
    """Whether an artifact's model's attention is MLA (LatentAttention): its fingerprint gives its latent's width."""
    return "value_dim" in fingerprint


def kv_widths(fingerprint: dict, kind: str = "k") -> list[int]:
    """Per layer of an artifact's model, the channels of one token's keys (kind "k") or values ("v")."""
    return [kv_heads * head_dim for kv_heads, head_dim in kv_shapes(fingerprint, kind)]


def index_widths(fingerprint: dict) -> list[int]:
    """Per layer of an artifact's model, the channels of one token's indexer key (DeepSeek Sparse Attention's; 0: none)."""
    return fingerprint.get("layer_index_dims", [0] * fingerprint["num_layers"])


def prefix_lm(model: nn.Module) -> bool:
    """Whether `model` attends its prompt both ways, told which tokens are the prompt's by token types (_PREFIX_LM)."""
    return getattr(model.config, "model_type", None) in _PREFIX_LM


def text_inputs(model: nn.Module, ids: torch.Tensor) -> dict:
    """What a forward of `model` over text alone (ids) takes besides them: a prefix LM's token_type_ids of 1, its text
    read causally as it writes it, nothing for others."""
    return {"token_type_ids": torch.ones_like(ids)} if prefix_lm(model) else {}


def decoder_of(model: nn.Module) -> nn.Module:
    """The model's text decoder, without its head (and a composite's vision tower): get_decoder(), but where that is
    a causal LM, its decoder (Llama4ForCausalLM's get_decoder() finds none under its base_model_prefix and returns the
    model, which Llama4ForConditionalGeneration's returns)."""
    decoder = model.get_decoder()
    return decoder.model if isinstance(decoder, GenerationMixin) else decoder


def chunk_positions(start: int, ids: torch.Tensor) -> torch.Tensor:
    """The position ids of a chunk `ids` (batch, tokens) of prompts from their token `start` on, which a prefill in
    chunks gives the decoder as generate() gives them: a model may count from 0 in every call given none (Bamba)."""
    return torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def _served_name(model: nn.Module, text_config) -> tuple[str, str]:
    """(architecture, model_type) that artifacts name the model by: its own, or where AutoModelForCausalLM loads a
    composite's checkpoints as a causal LM of their text decoder alone (Llama 4's Llama4ForCausalLM, Qwen3.5's
    Qwen3_5ForCausalLM), that LM's, so that one bundle serves both."""
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.config.model_type, type(model).__name__)
    if causal_lm != type(model).__name__ and text_config is not model.config:
        return causal_lm, text_config.model_type
    return type(model).__name__, model.config.model_type


def _cache_layer_attention(layers: nn.ModuleList, m: int, sublayers: int, where: str) -> tuple[nn.Module, str]:
    """The attention of the cache's layer `m` and where it is, for messages: decoder layer m's, or where each decoder
    layer holds `sublayers` attentions (_ATTENTION_SUBLAYERS), the (m % sublayers)-th of decoder layer m // sublayers."""
    if sublayers == 1:
        return _find_attention(layers[m], f"{where}: decoder layer {m}"), f"{where}: decoder layer {m}"
    where = f"{where}: decoder layer {m // sublayers}"
    attentions = _find_attention(layers[m // sublayers], where)
    if not isinstance(attentions, nn.ModuleList) or len(attentions) != sublayers:
        raise KvcalError(f"{where}: its attention is not a list of {sublayers} attention sublayers")
    return attentions[m % sublayers], f"{where}'s attention {m % sublayers}"


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise KvcalError(f"{type(model).__name__}: could not find a list of {num_layers} decoder layers")


def _find_attention(layer: nn.Module, where: str) -> nn.Module:
    block = getattr(layer, "norm_attn_norm", layer)  # DBRX's: a norm, its attention and a norm in one module
    for name in _ATTENTION_NAMES:
        attention = getattr(block, name, None)
        if attention is not None:
            return attention
    children = ", ".join(name for name, _ in layer.named_children())
    raise KvcalError(f"{where} has no attention module ({'/'.join(_ATTENTION_NAMES)}); found {children}; {_SERVED_ONES}")


def _decoder_layer_types(config, num_layers: int) -> list[str]:
    """Each decoder layer's type: the config's layer_types (by kvcal's name, _LAYER_TYPE_NAMES), full_attention where it
    has none."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    crossing = getattr(config, "cross_attention_layers", None) or ()
    types = [_CROSS_ATTENTION if i in crossing else kind for i, kind in enumerate(types)]
    return [_LAYER_TYPE_NAMES.get(kind, kind) for kind in types][:num_layers]


def _attention_layers(types: list[str], where: str) -> list[int]:
    """The decoder layers that attend, by each one's type (_decoder_layer_types): all, or a hybrid model's layers whose
    type is not one of _STATE_LAYER_TYPES; refuses layer types that are neither."""
    other = sorted(set(types) - set(_ATTENTION_LAYER_TYPES) - {*_STATE_LAYER_TYPES, _CROSS_ATTENTION})
    if other:
        raise KvcalError(f"{where}: its layer types {other} are not ones kvcal serves ({', '.join(_ATTENTION_LAYER_TYPES)}, "
                         f"beside {', '.join(_STATE_LAYER_TYPES)} layers, whose state transformers keeps)")
    attending = [i for i, kind in enumerate(types) if kind in _ATTENTION_LAYER_TYPES]
    if not attending:
        raise KvcalError(f"{where}: none of its layers attends (layer types {sorted(set(types))}): it keeps no KV cache")
    return attending


def _layer_handles(attention: nn.Module, index: int, where: str, heads_first: bool, q_width: int, kv_width: int,
                   head_dim: int, sinks: bool, unscaled_norms: str | None) -> LayerHandles:
    """The handles of `attention` (at `where`), the adapter's layer `index`; `unscaled_norms` "after": its qk_norm, or
    its q_norm and k_norm, where it has them, norm q and k after RoPE (_NORMED_AFTER_ROPE); "before": they norm them
    before RoPE, read from the projections' output (_SHARED_NORM_BEFORE_ROPE, _FLAT_NORMS_BEFORE_ROPE)."""
    linear = {name: module for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "Wqkv", "query_key_value", "o_proj",
                                        "dense", "out_proj") if isinstance(module := getattr(attention, name, None), nn.Linear)}
    for name in ("dense", "out_proj"):  # Phi's and GPT-NeoX's output projection; LFM2's and DBRX's
        if name in linear:
            linear.setdefault("o_proj", linear.pop(name))
    if "Wqkv" in linear:  # DBRX's q, k and v side by side
        linear.setdefault("qkv_proj", linear.pop("Wqkv"))
    query_columns = slice(None)
    gated = getattr(attention, "q_gate_proj", None)
    if "q_proj" not in linear and isinstance(gated, nn.Linear) and gated.out_features == 2 * q_width:
        # MiniCPM5-MoE's: each head's query, then its output gate
        linear["q_proj"] = gated
        query_columns = _block_columns(2 * q_width, q_width // head_dim, q=(0, head_dim))["q"]
    fused = getattr(attention, "c_attn", None)
    if isinstance(fused, (Conv1D, nn.Linear)):  # GPT-2's (Conv1D: its weight (inputs, outputs)), GPT-BigCode's
        # q, k and v side by side (GPT-2; GPT-BigCode with multi_query), or each head's in turn (GPT-BigCode's others)
        side_by_side = isinstance(fused, Conv1D) or getattr(attention, "multi_query", False)
        linear.update({"qkv_proj" if side_by_side else "query_key_value": fused, "o_proj": attention.c_proj})
    if getattr(attention, "new_decoder_architecture", False) and "query_key_value" in linear:  # Falcon-40B's
        linear["grouped_qkv"] = linear.pop("query_key_value")
    elif getattr(attention, "multi_query", False) and "query_key_value" in linear:  # Falcon-7B's: side by side
        linear["qkv_proj"] = linear.pop("query_key_value")
    # StableLM's q_layernorm, Hunyuan's query_layernorm
    names = {"q": ("q_norm", "q_layernorm", "query_layernorm"), "k": ("k_norm", "k_layernorm", "key_layernorm"),
             "v": ("v_norm", "v_layernorm")}
    norms = {f"{kind}_norm": next((norm for name in names[kind] if (norm := getattr(attention, name, None)) is not None),
                                  None) for kind in "qkv"}
    if unscaled_norms:  # Llama 4 Scout's qk_norm (none in its NoPE layers, nor in Maverick's), NanoChat's q/k_norm,
        # Chameleon's
        shared = getattr(attention, "qk_norm", None)
        rope_norms = (shared, shared) if shared is not None else (norms["q_norm"], norms["k_norm"])
        norms.update(q_norm=None, k_norm=None, rope_norms=None if None in rope_norms else rope_norms,
                     norms_before_rope=unscaled_norms == "before")
    norms.update(heads_first=heads_first, sinks=attention.sinks if sinks else None, head_dim=head_dim,
                 **_qk_multipliers(attention),
                 value_multiplier=float(getattr(attention, "v_scale", 1.0)),
                 # DBRX's attention holds its clip_qkv, OLMo's and OLMoE's config (they clamp in place, after the hooks)
                 clip=getattr(attention, "clip_qkv", None) or getattr(getattr(attention, "config", None), "clip_qkv", None))
    if norms["key_multiplier"] == 0.0:
        raise KvcalError(f"{where}: its key_multiplier is 0: every key is zero, and no cache is worth keeping")
    # no v_proj: the value is the v norm of k_proj's output (Gemma 4's attention_k_eq_v)
    value_from_key = getattr(attention, "v_proj", 0) is None and norms["v_norm"] is not None
    if "o_proj" in linear and "q_proj" in linear and "k_proj" in linear and ("v_proj" in linear or value_from_key):
        if linear["k_proj"].out_features != kv_width:
            raise KvcalError(f"{where}: k_proj has {linear['k_proj'].out_features} outputs, expected {kv_width} (KV heads x head_dim)")
        return LayerHandles(index, attention, linear["q_proj"], linear["k_proj"], linear.get("v_proj", linear["k_proj"]),
                            **norms, value_from_key_projection=value_from_key,
                            columns=dict(q=query_columns, k=slice(None), v=slice(None)))
    if "o_proj" in linear and "qkv_proj" in linear and hasattr(attention, "mp_num"):  # CodeGen's: q, v and k side by
        # side within each of the mp_num shards it was trained in
        fused, shards = linear["qkv_proj"], attention.mp_num
        if q_width != kv_width or fused.out_features != 3 * q_width or q_width % shards:
            raise KvcalError(f"{where}: qkv_proj has {fused.out_features} outputs for {q_width // head_dim} query and "
                             f"{kv_width // head_dim} KV heads; kvcal reads it as {shards} shards of q, v and k")
        local = q_width // shards
        columns = _block_columns(fused.out_features, shards, q=(0, local), v=(local, local), k=(2 * local, local))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "qkv_proj" in linear:  # q, k, v side by side in its output (Phi-3)
        fused = linear["qkv_proj"]
        outputs = fused.nf if isinstance(fused, Conv1D) else fused.out_features
        if outputs != q_width + 2 * kv_width:
            raise KvcalError(f"{where}: qkv_proj has {outputs} outputs, expected {q_width} + 2 x {kv_width} (q, k, v)")
        columns = dict(q=slice(0, q_width), k=slice(q_width, q_width + kv_width), v=slice(q_width + kv_width, None))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "grouped_qkv" in linear:  # each KV head's queries, then its key and value (Falcon-40B)
        fused, group = linear["grouped_qkv"], q_width // kv_width
        if fused.out_features != q_width + 2 * kv_width:
            raise KvcalError(f"{where}: query_key_value has {fused.out_features} outputs, expected {q_width} + 2 x "
                             f"{kv_width} (q, k, v)")
        columns = _block_columns(fused.out_features, kv_width // head_dim, q=(0, group * head_dim),
                                 k=(group * head_dim, head_dim), v=((group + 1) * head_dim, head_dim))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "query_key_value" in linear:  # each head's q, k and v in turn (GPT-NeoX)
        fused = linear["query_key_value"]
        if q_width != kv_width or fused.out_features != 3 * q_width:
            raise KvcalError(f"{where}: query_key_value has {fused.out_features} outputs for {q_width // head_dim} query and "
                             f"{kv_width // head_dim} KV heads; kvcal reads it as q, k and v of every head in turn")
        columns = _block_columns(fused.out_features, q_width // head_dim, q=(0, head_dim), k=(head_dim, head_dim),
                                 v=(2 * head_dim, head_dim))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    children = ", ".join(n for n, _ in attention.named_children())
    raise KvcalError(f"{where}: could not find separate q_proj, k_proj, v_proj (or one qkv_proj or query_key_value) and o_proj "
                     f"(or dense) linear layers in its attention (found: {children}); {_SERVED_ONES}")


def _qk_multipliers(attention: nn.Module) -> dict[str, float]:
    """What the attention multiplies its query and key sources' output by (LayerHandles.query_multiplier,
    key_multiplier): both by Ergo's qk_scale on its global layers (after their NoPE norms), the key alone by Falcon-H1's
    key_multiplier, else 1."""
    scale = getattr(attention, "qk_scale", None)
    if isinstance(scale, torch.Tensor):
        return dict(query_multiplier=float(scale), key_multiplier=float(scale))
    return dict(query_multiplier=1.0, key_multiplier=float(getattr(attention, "key_multiplier", 1.0)))


def _block_columns(outputs: int, blocks: int, **parts: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The columns of a fused projection's `outputs` made of `blocks` equal blocks (one a head, KV head or shard), each
    holding every part (q, k, v) at its (offset, width) in the block: per part, its columns of every block in turn."""
    starts = torch.arange(0, outputs, outputs // blocks)[:, None]
    return {kind: (starts + offset + torch.arange(width)).flatten() for kind, (offset, width) in parts.items()}


def _latent_rope(config) -> str:
    """How an MLA model's RoPE pairs channels: "halves" (i, i + d/2, rotate_half), "interleaved" (2i, 2i+1, left so:
    DeepSeek-V2's complex rotation) or "de-interleaved" (2i, 2i+1, rotated into halves order: where rope_interleave
    says so, and always on _DEINTERLEAVED_LATENT_ROPE)."""
    if config.model_type == "deepseek_v2":
        return "interleaved"
    if (config.model_type in _DEINTERLEAVED_LATENT_ROPE or getattr(config, "rope_interleave", False)
            or config.model_type in _DEINTERLEAVED_LATENT_ROPE_FROM_5_25 and transformers_from(5, 25)):
        return "de-interleaved"
    return "halves"


def _latent_handles(attention: nn.Module, index: int, where: str, config, indexed: bool) -> LayerHandles:
    """The handles of an MLA attention (LatentAttention): its key is the rotated part of kv_a_proj_with_mqa's output,
    its value the latent, kv_a_layernorm's output; its query q_proj's output, or q_b_proj's (a low-rank query), or each
    head's first channels of q_gate_proj's (A.X K2's: a head's query, then its output gate); `indexed`: its attention
    is DeepSeek Sparse Attention's. LongCat-Flash caches its latent times mla_scale_kv_lora (value_multiplier); its
    queries' mla_scale_q_lora is in the query its attention is handed (capture keeps no MLA queries)."""
    parts = {name: getattr(attention, name, None)
             for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
    query = getattr(attention, "q_proj", None) or getattr(attention, "q_b_proj", None)
    query_columns = slice(None)
    if query is None and getattr(attention, "q_gate_proj", None) is not None:
        query, per_head = attention.q_gate_proj, config.qk_nope_head_dim + config.qk_rope_head_dim
        heads = query.out_features // (per_head + config.v_head_dim)
        query_columns = _block_columns(query.out_features, heads, q=(0, per_head))["q"]
    if query is None or None in parts.values():
        children = ", ".join(n for n, _ in attention.named_children())
        raise KvcalError(f"{where}: could not find q_proj (or q_b_proj, q_gate_proj), kv_a_proj_with_mqa, kv_a_layernorm, "
                         f"kv_b_proj and o_proj in its latent attention (found: {children})")
    rank, rotated = config.kv_lora_rank, config.qk_rope_head_dim
    if parts["kv_a_proj_with_mqa"].out_features != rank + rotated:
        raise KvcalError(f"{where}: kv_a_proj_with_mqa has {parts['kv_a_proj_with_mqa'].out_features} outputs, expected "
                         f"{rank} + {rotated} (kv_lora_rank + qk_rope_head_dim)")
    latent = LatentAttention(parts["kv_b_proj"], config.qk_nope_head_dim, config.v_head_dim,
                             rope_in_order=_latent_rope(config) == "de-interleaved")
    projection = parts["kv_a_proj_with_mqa"]
    indexer = getattr(attention, "indexer", None) if indexed else None
    if indexer is not None and not isinstance(getattr(indexer, "head_dim", None), int):
        raise KvcalError(f"{where}: its attention's indexer has no head_dim (the channels of its keys)")
    return LayerHandles(index, attention, query, projection, projection, None, None, v_norm=parts["kv_a_layernorm"],
                        columns=dict(q=query_columns, k=slice(rank, rank + rotated), v=slice(0, rank)), latent=latent,
                        sparse=indexed, indexer=indexer, sinks=attention.sinks if config.model_type in _SINKS else None,
                        value_multiplier=float(getattr(attention, "mla_scale_kv_lora", 1.0)))


def _pick_key_blocks(handles: LayerHandles, query_heads: int, where: str) -> None:
    """Make a GQA layer's handles sparse, as MiniMax-M3's block-sparse layers: its attention's indexer (head_dim: the
    channels of its one key head; block_size: the keys of a block) picks key blocks per group of query heads."""
    indexer = getattr(handles.attention, "indexer", None)
    heads, head_dim, block = (getattr(indexer, name, None) for name in ("num_heads", "head_dim", "block_size"))
    if not all(isinstance(number, int) and number > 0 for number in (heads, head_dim, block)) or query_heads % heads:
        raise KvcalError(f"{where}: an indexed layer whose attention has no indexer of key blocks (num_heads dividing its "
                         f"{query_heads} query heads, head_dim, block_size), which kvcal serves (MiniMax-M3's)")
    handles.sparse, handles.indexer, handles.pick_block = True, indexer, block


def _rotary_name(kind: str | None, name: str) -> str:
    """The rotary module's attribute `name` for layers of type `kind` (None: the one set of every layer)."""
    return name if kind is None else f"{kind}_{name}"


def _rotary_inv_freq(rotary: nn.Module, kind: str | None) -> torch.Tensor:
    """The frequencies `rotary` rotates layers of type `kind` (None: every layer) by: its inv_freq, or those its table of
    sines and cosines was made of (_SINUSOID_TABLE_ROPE: computed as the model computes them)."""
    table = getattr(rotary, "embed_positions", None)
    if isinstance(table, torch.Tensor) and not hasattr(rotary, "inv_freq"):
        width = table.shape[-1]
        return 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.int64, device=table.device) / width))
    return getattr(rotary, _rotary_name(kind, "inv_freq"))


def _find_rotary(model: nn.Module, kinds: list[str | None], where: str, optional: bool = False,
                 table: bool = False) -> nn.Module | None:
    """The module holding the frequencies of every layer type (`inv_freq`, or `<type>_inv_freq` per type; `table`:
    `embed_positions`, _SINUSOID_TABLE_ROPE's); None where there is none and that is `optional` (a model whose
    attention then applies no RoPE)."""
    names = {"embed_positions"} if table else {_rotary_name(kind, "inv_freq") for kind in kinds}
    for module in model.modules():
        if all(isinstance(getattr(module, name, None), torch.Tensor) for name in names):
            return module
    if optional:
        return None
    raise KvcalError(f"{where}: could not find a rotary position embedding (a module with {', '.join(sorted(names))})")


def _rope_orders(rotary: nn.Module, kinds: list[str | None], head_dims: list[int], rope_free: set, interleaved: bool,
                 swapped: bool, where: str) -> list[tuple[int, ...] | None]:
    """Per layer, kvcal's channel order of the model's RoPE (kvcal.rope.rotate_half_order; None: the model's own): a
    rotating layer's by the channels its type rotates (Laguna's full layers rotate half of each head, its sliding ones
    all), a layer of a type RoPE leaves out (`rope_free`) the rotating layers' where they share one, else the model's.
    Refused: RoPE kvcal cannot store: more rotated channels than a head has, frequencies that change with every
    sequence length, LongRoPE given per layer type."""
    orders = {}
    for kind, head_dim in zip(kinds, head_dims):
        if kind in rope_free:
            continue
        rotated = 2 * _rotary_inv_freq(rotary, kind).numel()
        if rotated > head_dim:
            raise KvcalError(f"{where}: its RoPE rotates {rotated} of a head's {head_dim} channels; kvcal takes up to "
                             "head_dim")
        order = rotate_half_order(head_dim, rotated, interleaved, swapped)
        orders[kind, head_dim] = tuple(order) if order is not None else None
    rope_types = getattr(rotary, "rope_type", "default")
    for rope_type in rope_types.values() if isinstance(rope_types, dict) else [rope_types]:
        if "dynamic" in rope_type:  # transformers' dynamic_rope_update
            raise KvcalError(f"{where}: its RoPE (rope_type '{rope_type}') changes its frequencies with every sequence "
                             "length, and kvcal stores one set; use a static rope_type (default, linear, llama3, yarn) or "
                             "longrope")
        if rope_type == "longrope" and isinstance(rope_types, dict):
            raise KvcalError(f"{where}: its layer types rotate by RoPE of their own, one of them LongRoPE; kvcal serves "
                             "LongRoPE shared by every layer")
    shared = set(orders.values())
    unrotated = shared.pop() if len(shared) == 1 else None
    return [orders[kind, head_dim] if kind not in rope_free else
            unrotated if unrotated is None or len(unrotated) == head_dim else None
            for kind, head_dim in zip(kinds, head_dims)]


def _unrotated_scale(adapter: ModelAdapter, layer: int) -> torch.Tensor | None:
    """LayerHandles.unrotated_scale of the adapter's layer `layer`."""
    scaling, half = adapter.layer_rope_scaling(layer), adapter.head_dims[layer] // 2
    if scaling == 1.0:
        return None
    pairs = _rotary_inv_freq(adapter._layer_rotary(layer), adapter.layer_types[layer]).numel()
    if pairs == half:
        return None
    one_half = torch.cat((torch.ones(pairs), torch.full((half - pairs,), 1.0 / scaling)))
    return torch.cat((one_half, one_half))


def _long_rope(rotary: nn.Module) -> LongRope | None:
    """The rotary's LongRoPE long frequencies, as transformers makes them for a forward past the switch. PhiMoE's
    rotary rotates by its short set at any length and scales cos/sin by the config's short_mscale, or long_mscale
    past the switch: served where the two are equal (the released Phi-3.5-MoE's are), refused where they are not."""
    if getattr(rotary, "rope_type", None) != "longrope":  # (per layer type: refused by _rope_orders)
        return None
    parameters = rotary.config.rope_parameters
    switch = int(parameters["original_max_position_embeddings"])
    if rotary.config.model_type in _MSCALED_LONGROPE:
        if parameters["short_mscale"] != parameters["long_mscale"]:
            raise KvcalError(f"{rotary.config.model_type}'s RoPE scales cos/sin by short_mscale {parameters['short_mscale']} "
                             f"up to {switch} positions and by long_mscale {parameters['long_mscale']} past them, which "
                             "kvcal does not follow: serve a config whose two are equal, as the released model's are")
        return LongRope(switch, rotary.original_inv_freq.detach().float().cpu(), float(parameters["short_mscale"]))
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, "cpu", seq_len=switch + 1)
    return LongRope(switch, long_inv_freq.float())


def _rope_free_types(config) -> set[str]:
    """The layer types whose rope parameters are None: layers of these apply no RoPE (Beam's full-attention ones)."""
    rope = getattr(config, "rope_parameters", None)
    return {kind for kind, parameters in rope.items() if parameters is None} if isinstance(rope, dict) else set()


def _layer_types(config, num_layers: int) -> list[str | None]:
    """Per layer, the name its frequencies go by: the config's layer type where the rope parameters are per type (of
    the attention layers: a hybrid's state layers have none)."""
    types, rope = getattr(config, "layer_types", None), getattr(config, "rope_parameters", None)
    if types and isinstance(rope, dict) and all(kind in rope for kind in types if kind not in _STATE_LAYER_TYPES):
        return list(types)[:num_layers]
    return [None] * num_layers


def _sliding_windows(config, num_layers: int) -> list[int | None]:
    """Per layer, the sliding window transformers' cache keeps for it, or None: the config's sliding_window on its
    sliding layers, on every layer where it names a window but no layer_types (Mistral), as transformers reads it.
    Read from the config, not transformers' get_layer_types_and_kwargs, whose return shape changed (one dict up to
    5.17, a dict per layer since)."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) or ["sliding_attention" if window is not None else "full_attention"] * num_layers
    return [window if kind == "sliding_attention" else None for kind in types][:num_layers]


def _attention_chunks(config, decoder_types: list[str]) -> list[int | None]:
    """Per decoder layer (of these types), its attention chunk (config.attention_chunk_size on Llama 4's
    chunked_attention layers), or None."""
    chunk = getattr(config, "attention_chunk_size", None)
    return [chunk if kind == "chunked_attention" else None for kind in decoder_types]


def _rotated_layers(config, model_type: str, num_layers: int, rope_free: set[str]) -> list[bool]:
    """Per layer, whether it applies RoPE: not SmolLM3's no_rope_layers (0 there), not EXAONE 4's, EXAONE MoE's and
    Kolibri-1's and Flint's full-attention layers where they have sliding ones (their "global NoPE"; Flint's none
    without a window), Cohere 2's sliding layers
    only (none without a window) and Cohere 2 MoE's besides its dense layers where
    prefix_dense_sliding_window_pattern is 1 (its force_rope), AFMoE's and Lara Mini's sliding layers only, Granite
    SWA's, Muse Spark's and Muse Glimmer's of a non-zero layer_rope_theta, Beam's of a type with rope parameters (not of
    `rope_free`, _rope_free_types); every layer elsewhere."""
    if model_type in ("cohere2", "cohere2_moe"):
        window = getattr(config, "sliding_window", None) is not None
        forced = [model_type == "cohere2_moe" and mlp == "dense" and config.prefix_dense_sliding_window_pattern == 1
                  for mlp in getattr(config, "mlp_layer_types", None) or [None] * num_layers]
        return [(kind == "sliding_attention" and window) or force
                for kind, force in zip(config.layer_types, forced)][:num_layers]
    if getattr(config, "layer_rope_theta", None) is not None:  # 0: NoPE (Granite SWA's, Muse Spark's)
        return [bool(theta) for theta in config.layer_rope_theta][:num_layers]
    if rope_free:
        return [kind not in rope_free for kind in config.layer_types][:num_layers]
    window = getattr(config, "sliding_window", None) is not None
    global_nope = model_type in ("exaone4", "exaone_moe", "kolibri1", "flint") and window
    if global_nope or model_type in ("afmoe", "lara_mini"):
        return [kind == "sliding_attention" for kind in config.layer_types][:num_layers]
    return [bool(flag) for flag in getattr(config, "no_rope_layers", None) or [1] * num_layers][:num_layers]


# model types served from a transformers release on, before which their classes differ from what kvcal follows
# (DeepSeek Sparse Attention's before 5.18 caches keys and values expanded per head, not the latent; HunYuan VL's
# before 5.20: kvcal finds its RoPE and its key norms' layout otherwise there, and profiling it fails; Falcon's,
# GPT-J's and CodeGen's before 5.25 attend without transformers' attention functions, which kvcal replaces)
_SERVED_FROM = {**dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"), (5, 18)),
                "hunyuan_vl": (5, 20), "hunyuan_vl_text": (5, 20), **dict.fromkeys(("falcon", "gptj", "codegen"), (5, 25))}


def served_by_installed_transformers(model_type: str) -> bool:
    """Whether kvcal serves `model_type` under the installed transformers release (_SERVED_FROM)."""
    return model_type not in _SERVED_FROM or transformers_from(*_SERVED_FROM[model_type])


def adapt(model: nn.Module) -> ModelAdapter:
    """Build the adapter for a loaded causal LM, or refuse it naming what is missing. A model whose text decoder is
    one part of it (Gemma 3 4B-27B: Gemma3ForConditionalGeneration, model_type gemma3) is read by that decoder and its
    text config, and served for text."""
    model_type = getattr(model.config, "model_type", "?")
    where = f"unsupported architecture {type(model).__name__} (model_type '{model_type}')"
    config = model.config.get_text_config(decoder=True)
    text_type = getattr(config, "model_type", model_type)  # what the decoder's attention is
    unserved = next((kind for kind in (model_type, text_type) if not served_by_installed_transformers(kind)), None)
    if unserved is not None:
        major, minor = _SERVED_FROM[unserved]
        raise KvcalError(f"{where}: kvcal serves it from transformers {major}.{minor}, whose classes it follows; "
                         f"upgrade transformers (pip install 'transformers>={major}.{minor}')")
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise KvcalError(f"{where}: its config has no num_hidden_layers")
    query_heads, kv_heads, head_dims = _layer_geometry(config, num_layers, where)
    latent = text_type in LATENT_ATTENTION_TYPES + _LATENT_DECODERS
    if latent:  # one KV head: the rotated key every head shares, beside the latent (LatentAttention)
        kv_heads, head_dims = [1] * num_layers, [config.qk_rope_head_dim] * num_layers
    if text_type in _SLIDING_KV_HEADS_DOUBLED:
        kv_heads = [2 * heads if kind == "sliding_attention" else heads
                    for heads, kind in zip(kv_heads, _decoder_layer_types(config, num_layers))]
    value_dims = ([config.kv_lora_rank] * num_layers if latent else [config.v_head_dim] * num_layers
                  if text_type in _NARROW_VALUES else head_dims)
    decoder = decoder_of(model)  # not a vision tower's layers, whatever their number
    sublayers = _ATTENTION_SUBLAYERS.get(text_type, 1)
    layers = _find_decoder_layers(decoder, num_layers // sublayers)
    heads_first = text_type in _HEADS_FIRST_NORMS
    sinks = text_type in _SINKS
    decoder_types = _decoder_layer_types(config, num_layers)
    sharing = _kv_sharing_modes(config, num_layers)
    attending = [m for m in _attention_layers(decoder_types, where) if sharing[m] != "reuse"]
    located = [_cache_layer_attention(layers, m, sublayers, where) for m in attending]
    handles = [_latent_handles(attention, i, at, config, decoder_types[m] == _INDEXED_ATTENTION) if latent else
               _layer_handles(attention, i, at, heads_first, query_heads[m] * head_dims[m], kv_heads[m] * head_dims[m],
                              head_dims[m], sinks, "after" if text_type in _NORMED_AFTER_ROPE else
                              "before" if text_type in (*_SHARED_NORM_BEFORE_ROPE, *_FLAT_NORMS_BEFORE_ROPE) else None)
               for i, (m, (attention, at)) in enumerate(zip(attending, located))]
    for handle, m, (_, at) in zip(handles, attending, located):
        if decoder_types[m] == _INDEXED_ATTENTION and not latent:
            _pick_key_blocks(handle, query_heads[m], at)
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):  # MPT's, Falcon's
        raise KvcalError(f"{where}: its positions are ALiBi biases on the scores, which kvcal's attention does not "
                         "add; kvcal serves RoPE models and ones with learned or no positions")
    if model_type not in SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES:
        raise KvcalError(f"{where}: kvcal does not serve its model type; {_SERVED_ONES}")
    attending_only = lambda per_layer: [per_layer[m] for m in attending]  # noqa: E731
    kinds, query_heads, kv_heads, head_dims, value_dims = map(attending_only, (_layer_types(config, num_layers), query_heads,
                                                                               kv_heads, head_dims, value_dims))
    layer_rotaries = (tuple(attending_only(_rotaries_per_base(decoder, config, num_layers))) if text_type in _ROTARY_PER_BASE
                      else tuple(attending_only(_rotaries_scaled_by_layer(decoder, config, num_layers)))
                      if text_type in _ROTARY_SCALED_BY_LAYER else ())
    rope_free = _rope_free_types(config)
    rotating_kinds = [kind for kind in kinds if kind not in rope_free]
    rotary = (next((module for module in layer_rotaries if module is not None), None) if layer_rotaries else
              None if text_type in _SCALED_NORMS_AFTER_ROPE else
              _find_rotary(decoder, rotating_kinds, where, optional=text_type in _NOPE_WITHOUT_ROTARY,
                           table=text_type in _SINUSOID_TABLE_ROPE))
    interleaved = text_type in _INTERLEAVED_ROPE or latent and _latent_rope(config) != "halves"
    orders = (_rope_orders(rotary, kinds, head_dims, rope_free, interleaved, text_type in _HALVES_SWAPPED_ROPE, where)
              if rotary is not None else [None] * len(handles))
    for handle, order in zip(handles, orders):
        handle.rope_order = order
    rotated = (attending_only(_rotated_layers(config, text_type, num_layers, rope_free)) if rotary is not None
               else [False] * len(handles))
    readers = _reader_layers(layers, sharing, decoder_types, attending, where)
    if model_type not in _PREFIX_LM and any(getattr(layer.attention, "is_causal", True) is False
                                            for layer in [*handles, *readers]):  # bidirectional attention
        raise KvcalError(f"{where}: its attention is bidirectional (is_causal False), and kvcal's cache serves causal "
                         "decoders")
    scales = {float(getattr(attention, "scaling", head_dims[layer] ** -0.5))
              for attention, layer in [*((h.attention, h.index) for h in handles), *((r.attention, r.source) for r in readers)]}
    if len(scales) > 1:
        raise KvcalError(f"{where}: its layers scale attention scores differently ({sorted(scales)}); kvcal's fits take one scale")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and config._attn_implementation == "sdpa":
        raise KvcalError(f"{where}: it soft-caps its attention scores, which transformers' SDPA attention leaves out "
                         "(transformers before 5.21 chose it by default); load the model with attn_implementation='eager'")
    architecture, served_type = _served_name(model, config)
    adapter = ModelAdapter(
        architecture=architecture,
        model_type=served_type,
        layers=handles,
        query_heads=query_heads,
        kv_heads=kv_heads,
        head_dims=head_dims,
        value_dims=value_dims,
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        rotary=rotary,
        config_dict=config.to_dict(),
        layer_types=kinds,
        windows=attending_only(_sliding_windows(config, num_layers)),
        chunks=attending_only(_attention_chunks(config, decoder_types)),
        rotated=rotated,
        score_scale=scales.pop(),
        softcap=softcap,
        model_layers=tuple(attending),
        num_model_layers=num_layers,
        keeps_state=[kind in _ATTENTION_AND_STATE_TYPES for kind in attending_only(decoder_types)],
        readers=tuple(readers),
        images_as_tokens=model_type in _IMAGES_AS_TOKENS,
        image_blocks=model_type in _IMAGE_BLOCKS,
        encoders_inside=model_type in _ENCODERS_INSIDE,
        layer_rotaries=layer_rotaries,
        long_rope=_long_rope(rotary) if rotary is not None else None,
        parity_split=sum(rotary.mrope_section[:2]) if text_type in _PARITY_SPLIT_ROPE else 0,
        cross_attention={m: _find_attention(layers[m], f"{where}: decoder layer {m}")
                         for m, kind in enumerate(decoder_types) if kind == _CROSS_ATTENTION},
    )
    for handle in handles:
        handle.unrotated_scale = _unrotated_scale(adapter, handle.index)
    scaled = sorted({adapter.layer_rope_scaling(h.index) for h in handles
                     if h.rope_norms is not None and not h.norms_before_rope} - {1.0})
    if scaled:  # the norm takes cos/sin's scaling out of the keys it makes, where kvcal's rotation would put it back
        raise KvcalError(f"{where}: it norms q and k after a RoPE that scales cos/sin by {scaled[0]:.4g}; kvcal serves q "
                         "and k normed after RoPE where cos/sin are unscaled (rope_type default, linear, llama3)")
    return adapter


def _rotaries_per_base(decoder: nn.Module, config, num_layers: int) -> list[nn.Module | None]:
    """Per decoder layer, the rotary module of its RoPE base (config.layer_rope_theta; None for 0, no RoPE): Granite
    SWA keeps one per base (`rotary_embs`), its `rotary_emb` left unused."""
    by_base = {float(module.config.rope_parameters["rope_theta"]): module for module in decoder.rotary_embs}
    return [by_base[float(theta)] if theta else None for theta in config.layer_rope_theta[:num_layers]]


def _rotaries_scaled_by_layer(decoder: nn.Module, config, num_layers: int) -> list[nn.Module]:
    """Per decoder layer, Molmo 2's scaled rotary module where config.rope_scaling_layers lists it, else its unscaled one."""
    scaled = set(config.rope_scaling_layers)
    return [decoder.rotary_emb if m in scaled else decoder.rotary_emb_unscaled for m in range(num_layers)]


def _layer_geometry(config, num_layers: int, where: str) -> tuple[list[int], list[int], list[int]]:
    """Per decoder layer, its query heads, KV heads and head_dim: transformers' per-layer config where the config is
    heterogeneous (Gemma 4's full-attention layers: fewer KV heads, twice the head_dim), the query heads of
    num_attention_heads_per_layer where the config has it (Laguna), else the config's."""
    per_layer = (config.per_layer_config if getattr(config, "is_heterogeneous", False) else [config] * num_layers)[:num_layers]
    query_heads = list(getattr(config, "num_attention_heads_per_layer", None) or
                       [layer.num_attention_heads for layer in per_layer])[:num_layers]
    if len(query_heads) < num_layers:
        raise KvcalError(f"{where}: its config gives {len(query_heads)} query-head counts (num_attention_heads_per_layer) "
                         f"for {num_layers} layers; give one a layer")
    # (GPT-BigCode: one KV head where multi_query)
    kv_heads = [getattr(layer, "num_key_value_heads", None) or (1 if getattr(layer, "multi_query", False) else heads)
                for layer, heads in zip(per_layer, query_heads)]
    head_dims = [getattr(layer, "head_dim", None) or layer.hidden_size // heads for layer, heads in zip(per_layer, query_heads)]
    return query_heads, kv_heads, head_dims


def _kv_sharing_modes(config, num_layers: int) -> list[str | None]:
    """Each decoder layer's KV sharing mode, "reuse" for the last num_kv_shared_layers (the layers reading an earlier
    layer's cache): transformers' kv_sharing_modes from 5.23, the same count read from the config before it."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        shared = getattr(config, "num_kv_shared_layers", 0) or 0
        modes = [None] * (num_layers - shared) + ["reuse"] * shared
    return list(modes)[:num_layers]


def _reader_layers(layers: nn.ModuleList, sharing: list[str | None], types: list[str], attending: list[int],
                   where: str) -> list[ReaderLayer]:
    """The decoder layers whose KV sharing mode is "reuse" (the last ones), each reading the cache of the last earlier
    layer of its type (as transformers' kv_sharing_modes picks it, which checks that there is one)."""
    first = next((m for m, mode in enumerate(sharing) if mode == "reuse"), len(sharing))
    return [ReaderLayer(m, _find_attention(layers[m], f"{where}: decoder layer {m}"),
                        max(i for i, a in enumerate(attending) if a < first and types[a] == types[m]))
            for m, mode in enumerate(sharing) if mode == "reuse"]


def attention_sinks(model_config: dict, layer: int) -> torch.Tensor | None:
    """Layer `layer`'s attention sinks' logits (heads,) from an artifact's `model` config (profiles record them for the
    fits' attention outputs), None for a model without sinks."""
    sinks = model_config.get("attention_sinks")
    return torch.tensor(sinks[layer], dtype=torch.float32) if sinks is not None else None


def attention_softcap(model_config: dict) -> float | None:
    """The profiled model's score soft-cap (Gemma 2's attn_logit_softcapping), from an artifact's `model` config, or
    None for a model that does not cap its scores."""
    return model_config.get("attention_softcap")


def score_scale(model_config: dict) -> float:
    """The profiled model's attention score scale, from an artifact's `model` config. Artifacts written before it was
    recorded came from models that kvcal only accepted when they scaled by head_dim ** -0.5."""
    return float(model_config.get("score_scale", model_config["fingerprint"]["head_dim"] ** -0.5))
