"""The model types kvcal serves, and what each one's attention does that the adapter cannot see in its modules: one
table a trait, keyed by the decoder's model_type (a composite's own where the trait is the composite's: how it reads
images). docs/models.md says, type by type, what each trait is and what kvcal does about it."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

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
                         "gptj", "codegen", "qwen4_exp_text", "qwen4_exp", "modernbert-decoder", "jetmoe")
# multi-head latent attention (DeepSeek-V2's MLA: LatentAttention; Kimi K2.5's: its DeepSeek-V3 decoder beside a vision
# tower): Cocktail's cache and the exports refuse these so far (ModelAdapter.refuse_latent)
LATENT_ATTENTION_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "minicpm3", "kimi_k25",
                          "glm4_moe_lite", "youtu", "axk1", "kimi_linear", "bailing_hybrid", "mistral4", "longcat_flash",
                          "sarvam_mla", "hy_v4_vl", "mistral_large4", "glm5_next", "dots3_note_text", "dots3_note")
# the decoders of composites served as MLA above, which load as no causal LM of their own (Hy V4 VL's, Mistral Large
# 4's, GLM-5 Next's)
LATENT_DECODERS = ("hy_v4_vl_text", "mistral_large4_text", "glm5_next_text")
# MLA whose RoPE pairs neighbouring channels (2i, 2i+1): DeepSeek-V2's leaves them so, these de-interleave them into
# kvcal's order always (DeepSeek-V3's where rope_interleave, and its kin's)
DEINTERLEAVED_LATENT_ROPE = ("bailing_hybrid", "deepseek_v32", "glm_moe_dsa", "axk2", "longcat_flash",
                             "mistral_large4_text", "dots3_note_text")
# ... and from transformers 5.25 on (before, Hy V4's attention rotated halves)
DEINTERLEAVED_LATENT_ROPE_FROM_5_25 = ("hy_v4", "hy_v4_vl_text")
# decoder layers holding this many attention sublayers (`self_attn` a ModuleList), each a layer of the cache of its own
# (LongCat-Flash's two MLA: cache layers 2i and 2i + 1 of decoder layer i, config.num_hidden_layers counting them)
ATTENTION_SUBLAYERS = {"longcat_flash": 2}
# LongRoPE whose rotary rotates by its short frequencies at any length and scales cos/sin by the config's mscales
# (transformers' PhiMoE: its rope_init_fn is called without the forward's length)
MSCALED_LONGROPE = ("phimoe",)
# where q/k norms see (batch, heads, tokens, head_dim) (the projections' output transposed first), not (batch, tokens,
# heads, head_dim): the norms' output shape alone cannot tell the two apart when tokens == heads
HEADS_FIRST_NORMS = ("gemma3_text", "exaone4", "exaone_moe", "kolibri1", "apertus", "stablelm", "phi", "hy_v3",
                     "nanochat", "hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text", "muse_spark_text",
                     "muse_glimmer_text", "apertus1p5_text")
# RoPE in pairs of neighbouring channels (2i, 2i+1), as GLM first did; the others rotate halves (i, i + rotary dims/2)
INTERLEAVED_ROPE = ("cohere", "cohere2", "cohere2_moe", "ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "llama4_text",
                    "glm4v_text", "glm_ocr_text", "ernie4_5_vl_moe_text", "ergo", "gptj", "codegen")
# a rotary module holding each position's sines, then cosines (`embed_positions`), of frequencies base 10000 over its
# width (GPT-J's and CodeGen's create_sinusoidal_positions), instead of inv_freq
SINUSOID_TABLE_ROPE = ("gptj", "codegen")
# q and k normed per head after RoPE, without a scale (Llama 4 Scout's use_qk_norm: the attention's qk_norm; NanoChat's
# q_norm and k_norm)
NORMED_AFTER_ROPE = ("llama4_text", "nanochat")
# q and k normed per head before RoPE by one norm without a scale (Muse Spark's and Muse Glimmer's qk_norm): read as
# NORMED_AFTER_ROPE's, a norm without a scale commuting with RoPE, but its output is the pre-RoPE key
SHARED_NORM_BEFORE_ROPE = ("muse_spark_text", "muse_glimmer_text")
# q and k normed per head before RoPE (with a scale and a bias) on rows whose batch and tokens the attention flattens
# into one dimension (Chameleon's q_norm and k_norm): their output tells no sequence apart, so kvcal reads the
# projections' output and norms it itself, as SHARED_NORM_BEFORE_ROPE's
FLAT_NORMS_BEFORE_ROPE = ("chameleon",)
# multimodal RoPE whose rotary keeps its height and width sections' frequencies split by parity, which its forward
# interleaves back (ERNIE 4.5 VL's: ModelAdapter.parity_split)
PARITY_SPLIT_ROPE = ("ernie4_5_vl_moe_text",)
# RoPE rotating by minus the angle, its halves' roles swapped (NanoChat's rotate_half): kvcal's rotation of the halves
# in the other order
HALVES_SWAPPED_ROPE = ("nanochat",)
# attention sinks: a learned logit per query head beside every row's scores (`sinks`, passed to attention as s_aux)
SINKS = ("gpt_oss", "granite_swa", "granitemoe_swa", "flint", "hy_v4", "hy_v4_vl_text", "mimo_v2_flash")
# values of their own width (config.v_head_dim) beside wider keys, outside MLA (MiMo-V2-Flash's), and twice the KV heads
# on sliding layers as on full ones
NARROW_VALUES = ("mimo_v2_flash",)
SLIDING_KV_HEADS_DOUBLED = ("mimo_v2_flash",)
# one rotary module per RoPE base (`rotary_embs`), each layer rotating by its config.layer_rope_theta (0: none)
ROTARY_PER_BASE = ("granite_swa", "granitemoe_swa")
# a scaled rotary module (`rotary_emb`) rotating the layers of config.rope_scaling_layers, an unscaled one
# (`rotary_emb_unscaled`, of rope_type default) the others (Molmo 2's)
ROTARY_SCALED_BY_LAYER = ("molmo2_text",)
# composites whose decoder attends over image tokens causally, as over text: kvcal wires their decoder alone, the vision
# tower runs its own attention, and the cache holds image tokens as text (Qwen-VL's at multimodal RoPE positions, which
# keys stored before RoPE cannot hold: kvcal.wiring.multimodal_refusal)
IMAGES_AS_TOKENS = ("mistral3", "llava", "internvl", "smolvlm", "idefics3", "aya_vision", "aria", "cohere_compass",
                    "qwen3_5", "qwen3_5_moe", "kimi_k25", "qwen2_vl", "qwen2_5_vl",
                    "qwen3_vl", "qwen3_vl_moe", "llama4", "minimax_m3_vl", "llava_next", "llava_onevision",
                    "idefics2", "lfm2_vl", "cohere2_vision", "lighton_ocr", "exaone4_5", "glm4v", "glm46v", "glm4v_moe",
                    "glm_ocr", "lfm3_vl", "vipllava", "llava_next_video", "video_llava", "paddleocr_vl",
                    "hyperclovax_vision_v2", "ernie4_5_vl_moe", "hunyuan_vl", "qwen2_5_omni_thinker",
                    "qwen3_omni_moe_thinker", "muse_spark", "muse_glimmer", "step3p7", "deepseek_vl", "janus",
                    "qianfan_ocr", "cosmos3_omni", "granite_docling", "ovis2", "video_llama_3", "cosmos3_edge",
                    "deepseek_ocr2", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "deepseek_vl_hybrid",
                    "glmga", "nemotron_h_omni", "granite4_vision", "got_ocr2", "fuyu", "chameleon", "emu3",
                    "llava_onevision1_5", "ovis2_5", "hy_v4_vl", "apertus1p5", "mistral_large4", "qwen4_exp",
                    "glm5_next", "dots3_note")
# composites whose decoder attends to an image's tokens both ways (token_type_ids; Molmo 2's mm_token_type_ids, which
# transformers' mask does not honour so far): wired alone as the above, the step's mask saying which tokens see later ones
IMAGE_BLOCKS = ("gemma3", "gemma4", "gemma4_unified", "molmo2", "paligemma")
# composites whose decoder attends its prompt both ways, told which tokens are the prompt's by token_type_ids 0
# (PaliGemma's: its attention modules not causal, use_bidirectional_attention): read as IMAGE_BLOCKS', by the step's
# mask; text alone is read as what it writes, causally (token_type_ids 1: text_inputs), and a step of several tokens
# handed no mask, which it would attend both ways, is refused (kvcal.wiring.refuse_unmasked_step)
PREFIX_LM = ("paligemma",)
# models whose RoPE positions count from 1, not 0 (PaliGemma's position_ids): the simulation and the profile rotate by
# them (first_position); the runtime cache reads each sequence's first position from the model's position ids
POSITIONS_FROM_ONE = ("paligemma",)
# models whose image and audio encoders sit inside the decoder's own module, their configs sub-configs of its text
# config (Phi-4-multimodal's embed_tokens_extend): their images' tokens read causally, as text, once embedded
ENCODERS_INSIDE = ("phi4_multimodal",)
# q and k normed per head after RoPE with a learned scale per channel (Hunyuan's query_layernorm and key_layernorm): the
# norm's scale does not commute with RoPE, so kvcal stores the key the attention reads, rotated and normed, as a
# model's without RoPE (its rotary left out; the norms are its q and k norms)
SCALED_NORMS_AFTER_ROPE = ("hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text")
# where their decoder has no rotary module, these apply no RoPE at all (Granite 4.0-H: position_embedding_type not
# "rope"; OLMo Hybrid: no rope_theta, as released; Nemotron-H, Jamba and Kimi Linear, whose MLA's "rotated" key is
# not rotated, always; GLM-5 Next, whose MLA has no rotated key): every layer is NoPE
NOPE_WITHOUT_ROTARY = ("granitemoehybrid", "nemotron_h", "jamba", "olmo_hybrid", "opt", "gpt2", "gpt_bigcode",
                       "kimi_linear", "biogpt", "glm5_next_text")
# Nemotron-H: its attention blocks' mixer; Mllama: its cross-attention layers' cross_attn
ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn", "mixer", "cross_attn")
# decoder layers of these types hold no keys and values but a recurrent state (Qwen3-Next's and Qwen3.5's gated
# DeltaNet, LFM2's convolutions, Granite 4.0-H's and Nemotron-H's Mamba 2) or nothing (Nemotron-H's MLP and MoE
# blocks): kvcal quantizes the other layers' cache and leaves theirs to transformers' own
STATE_LAYER_TYPES = ("linear_attention", "conv", "mlp", "moe")
# decoder layers attending over another sequence (Mllama's cross-attention layers: over an image's tokens, their keys
# and values made once from the vision tower's output, when the model is given one): kvcal leaves them, and their
# cache layer, to transformers, as the above (ModelAdapter.cross_attention)
CROSS_ATTENTION = "cross_attention"
# layers that attend and also run a recurrent mixer beside their attention (Falcon-H1's Mamba 2), whose state
# transformers' cache layer keeps next to the keys and values
ATTENTION_AND_STATE_TYPES = ("hybrid",)
# DeepSeek Sparse Attention's layers: MLA whose queries attend to the tokens an indexer picks (LayerHandles.sparse)
INDEXED_ATTENTION = "indexed_attention"
# MiniMax-M3's block-sparse layers (GQA whose queries attend to the key blocks a lightning indexer picks), by kvcal's name
LAYER_TYPE_NAMES = {"minimax_m3_sparse": INDEXED_ATTENTION}
# indexed GQA layers whose indexer hands its pick to the attention inside the mask, ANDed with the step's (Qwen4-Exp's
# QSA: the tokens of its top compressed key blocks, and those of the last block not yet complete)
PICK_IN_MASK = ("qwen4_exp_text",)
# MLA layers whose indexer returns its pick, the columns of the tokens each query attends (-1: none), which their
# attention turns into its mask over the keys the cache hands back (GLM-5 Next's k-pool indexer, keeping a token's key,
# its pool gate's scores and whether it is real: 2 index_head_dim + 1 channels); a "shared" layer (no indexer) is handed
# an earlier layer's as prev_topk_indices
PICK_RETURNED = ("glm5_next_text",)
# models whose indexers hand the cache their keys in fp32 whatever the model's dtype (dots.note3's: its rotary runs on
# fp32 inputs for the indexed layers, and the indexer's keys keep the dtype of their rotation)
INDEXER_KEYS_FP32 = ("dots3_note_text",)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", INDEXED_ATTENTION,
                         *ATTENTION_AND_STATE_TYPES)
# where a refusal sends a user for the types kvcal serves (a list of them all would bury the refusal's line)
SERVED_ONES = (f"`kvcal models` lists the {len(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES)} model types kvcal "
               "serves")


# decoders transformers has that kvcal does not serve yet (by their text config's type, a composite's too), each with
# why: the refusal the adapter would reach through their modules names a symptom (no q, k and v it knows, a type it
# does not serve), not this (docs/models.md)
NOT_TAKEN_YET = {
    "kolibri1_1": "Kolibri 1.1 is not served yet: its sparse layers attend to keys and values the model rounds to "
                  "NVFP4 after handing them to the cache, where kvcal's attention would read the cache's",
    "inkling2_loop_text": "Inkling 2 Loop is not served yet: its looped layers (loop_layer_index_start to "
                          "loop_layer_index_end) run loop_num_passes times a step, where kvcal keeps one cache layer "
                          "per decoder layer",
    "dory": "Dory is not served yet: its recurrent section runs the same decoder layers several times "
            "(n_recurrent_loops), each pass caching apart or reading the last one's, where kvcal keeps one cache layer "
            "per decoder layer",
    "deepseek_v4": "DeepSeek-V4 is not served yet: its layers attend to keys compressed over windows of tokens "
                   "(compressed sparse and heavily compressed attention), which its cache builds as tokens arrive, "
                   "beside a sliding window of plain ones",
    **dict.fromkeys(("inkling_text", "inkling2_text"),
                    "Inkling is not served yet: its scores add a relative-position bias made from each query's hidden "
                    "state, its keys and values pass a short convolution whose state the cache keeps, and its full "
                    "layers scale queries and bias by position"),
    "zaya": "ZAYA is not served yet: its compressed convolutional attention mixes queries and keys over time by a "
            "convolution and carries a recurrent value state, where kvcal reads keys and values from projections",
    **dict.fromkeys(("gpt_neo", "xglm"), "its attention computes its scores itself, not through transformers' attention "
                                         "functions, which kvcal replaces to read its cache"),
}


# model types whose layers may read another layer's cache (KV sharing), and whose every layer runs a recurrent mixer
# beside its attention (Falcon-H1): what an artifact's fingerprint tells of its decoder with its attention_layers
KV_SHARING_TYPES = ("gemma3n_text", "gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
STATE_BESIDE_ATTENTION_TYPES = ("falcon_h1",)
CROSS_ATTENDING_TYPES = ("mllama", "mllama_text_model")  # (Mllama's composite is served as its causal LM)


# model types served from a transformers release on, before which their classes differ from what kvcal follows
# (DeepSeek Sparse Attention's before 5.18 caches keys and values expanded per head, not the latent; HunYuan VL's
# before 5.20: kvcal finds its RoPE and its key norms' layout otherwise there, and profiling it fails; Falcon's,
# GPT-J's and CodeGen's before 5.25 attend without transformers' attention functions, which kvcal replaces; Qwen4-Exp's
# before 5.22 keeps its indexers' positions on the cache object, not on its first indexed layer, as kvcal's cache does)
SERVED_FROM = {**dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"), (5, 18)),
               "hunyuan_vl": (5, 20), "hunyuan_vl_text": (5, 20), **dict.fromkeys(("falcon", "gptj", "codegen"), (5, 25)),
               "qwen4_exp_text": (5, 22), "qwen4_exp": (5, 22)}


def served_by_installed_transformers(model_type: str) -> bool:
    """Whether kvcal serves `model_type` under the installed transformers release (SERVED_FROM)."""
    return model_type not in SERVED_FROM or transformers_from(*SERVED_FROM[model_type])


def served_types() -> list[tuple[str, str, str]]:
    """Every model type kvcal serves, sorted, each with how its decoder is read and what the installed transformers
    lacks to load it ("" where nothing): (model_type, kind, missing)."""
    def kind(model_type: str) -> str:
        latent = "multi-head latent attention" if model_type in LATENT_ATTENTION_TYPES else ""
        beside = ("decoder beside a vision tower, images cached as tokens" if model_type in IMAGES_AS_TOKENS else
                  "decoder beside a vision tower, its prompt attended both ways" if model_type in PREFIX_LM else
                  "decoder beside a vision tower, images attended both ways" if model_type in IMAGE_BLOCKS else
                  "decoder with image and audio encoders inside" if model_type in ENCODERS_INSIDE else
                  "decoder attending across to an image in some layers" if model_type in CROSS_ATTENDING_TYPES else "")
        return "; ".join(part for part in (latent, beside) if part) or "decoder"

    def missing(model_type: str) -> str:
        if model_type not in CONFIG_MAPPING_NAMES:
            return f"not in transformers {transformers_version()}"
        return "" if served_by_installed_transformers(model_type) else "needs transformers {}.{}".format(
            *SERVED_FROM[model_type])

    return [(model_type, kind(model_type), missing(model_type))
            for model_type in sorted(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES)]
