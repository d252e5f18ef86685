"""Tiny random models of every architecture kvcal serves, built from configs (nothing downloaded): their configs
(tiny_config: small shapes and the traits of the released checkpoints), the groups of model types tests run over, the
marks of what a later transformers release began, and random prompts for them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from kvcal.adapters import LATENT_ATTENTION_TYPES, SUPPORTED_MODEL_TYPES, decoder_of, served_by_installed_transformers
from kvcal.version import transformers_from

TINY_VOCAB = 512


def known(kinds):
    """Those of the model types `kinds` (a tuple, or a dict by type) that kvcal serves under the installed transformers:
    the test extra's knows every one; an older release's quick run leaves out the types it has not, or whose classes
    kvcal follows from a later one (kvcal.adapters.served_by_installed_transformers)."""
    here = lambda kind: kind in CONFIG_MAPPING_NAMES and served_by_installed_transformers(kind)  # noqa: E731
    if isinstance(kinds, dict):
        return {kind: value for kind, value in kinds.items() if here(kind)}
    return tuple(kind for kind in kinds if here(kind))


def from_transformers(major: int, minor: int, what: str):
    """A mark skipping, on a transformers release before major.minor, a test of what that release began (`what`)."""
    return pytest.mark.skipif(not transformers_from(major, minor), reason=f"{what} from transformers {major}.{minor}")


TINY_ARCHITECTURES = known(SUPPORTED_MODEL_TYPES)  # a tiny random model of every architecture kvcal serves (tiny_config)
LATENT = known(LATENT_ATTENTION_TYPES)  # and of every one with multi-head latent attention (MLA)
# MLA with DeepSeek Sparse Attention's indexer
DSA = known(("deepseek_v32", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "axk2", "mistral_large4"))
HY_V4 = ("hy_v4", "hy_v4_vl")  # of them, Hy V4's decoder: its layer 1 attends to layer 0's pick, keeping no indexer
# MLA whose indexer returns its pick to the attention (GLM-5 Next's k-pool indexer); its layer 2 reuses layer 1's
GLM5_NEXT = known(("glm5_next",))
# MLA whose sliding layers have widths of their own, beside DeepSeek Sparse Attention's layers (dots.note3's)
DOTS3_NOTE = known(("dots3_note_text", "dots3_note"))
SPARSE_LATENTS = from_transformers(5, 18, "DeepSeek Sparse Attention caching its latents")  # (kvcal serves it so)
MISTRAL_LARGE4 = pytest.mark.skipif("mistral_large4" not in LATENT, reason="Mistral Large 4 is new in transformers 5.25")
TINY_INDEX_TOPK = 8
# MiniMax-M3's text decoder and the model beside its vision tower: block-sparse attention on their layer 0
MINIMAX_M3 = ("minimax_m3_vl_text", "minimax_m3_vl")
MINIMAX_M3_BLOCK = 4  # the keys of a block its indexer picks
QSA_BLOCKS, QSA_BLOCK = 2, 4  # Qwen4-Exp's QSA: the blocks its indexer picks, the keys of a block
QWEN4_EXP = pytest.mark.skipif("qwen4_exp_text" not in TINY_ARCHITECTURES, reason="kvcal serves Qwen4-Exp from "
                               "transformers 5.22")
MUSE = ("muse_spark", "muse_glimmer")  # q and k normed by one norm without a scale before RoPE
# Gemma 4's text model, its decoder beside a vision tower, and Gemma 4 Unified's two (12B: no per-layer inputs, images
# attended both ways by default)
GEMMA4 = ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
GEMMA4_READERS_ON_KEPT_TOKENS = from_transformers(5, 23, "Gemma 4 runs its layers reading another's cache on the kept "
                                                  "logits' tokens alone")
# their tiny models' layer 0 slides over TINY_WINDOW tokens (tests run past it), layer 1 is full
ALTERNATING = known(("ministral", "olmo3", "exaone4", "exaone_moe", "kolibri1", "beam", "cohere2", "cohere2_moe", "cwm", "gpt_oss", "flint", "mellum", "afmoe",
               "gemma2", "vaultgemma", "gemma3_text", "gemma3", "gemma3n_text", *GEMMA4, "granite_swa",
               "granitemoe_swa", "laguna", "cohere_compass_text", "cohere_compass", "step3p7", "ergo"))
GRANITE_SWA = ("granite_swa", "granitemoe_swa")  # attention sinks, one rotary module per RoPE base
TINY_WINDOW = 16
# the attention implementation of a tiny model, where it is not SDPA (which has no sinks and no soft-cap)
OWN_ATTENTION = {"gpt_oss": "eager", "flint": "eager", "hy_v4": "eager", "hy_v4_vl": "eager", "mimo_v2_flash": "eager", "gemma2": "eager", "vaultgemma": "eager", "granite_swa": "eager", "granitemoe_swa": "eager",
                 "gpt_neo": "eager", "mpt": "eager", "got_ocr2": "eager",  # (GOT-OCR2's SAM tower: no SDPA)
                 "apertus1p5": "eager"}  # (nor Apertus 1.5's image tokenizer)
GLM = ("glm", "glm4", "glm4_moe")
# decoder layers of attention and of a recurrent state: gated DeltaNet, LFM2's convolutions, MiniMax's lightning
# attention, Mamba (Jamba's, and Granite 4.0-H's, Nemotron-H's and Bamba's Mamba 2; Nemotron-H's MLP blocks hold nothing)
# RoPE as released Qwen3.5 configs give it: frequencies interleaved over (time, height, width) position sections
QWEN3_5_MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                     mrope_interleaved=True)
# vision-language models whose decoder reads an image's tokens as text, and that decoder's type
IMAGE_TOWERS = known({"llava": "llama", "internvl": "qwen2", "smolvlm": "llama", "idefics3": "llama", "aya_vision": "cohere2",
                "aria": "aria_text", "llava_next": "llama", "llava_onevision": "qwen2", "idefics2": "mistral",
                "lfm2_vl": "lfm2", "cohere2_vision": "cohere2", "lighton_ocr": "qwen3", "exaone4_5": "exaone4",
                "lfm3_vl": "lfm3", "vipllava": "llama", "llava_next_video": "llama", "video_llava": "llama",
                "hyperclovax_vision_v2": "hyperclovax", "deepseek_vl": "llama", "janus": "llama", "qianfan_ocr": "qwen3",
                "ovis2": "qwen2", "video_llama_3": "qwen2", "deepseek_vl_hybrid": "llama", "got_ocr2": "qwen2",
                "llava_onevision1_5": "qwen3", "ovis2_5": "qwen3"})
# Qwen's vision-language models, served for text: their decoder's RoPE takes (3, batch, tokens) positions
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "cosmos3_omni")  # (Cosmos 3 Omni: NVIDIA's Qwen3-VL)
# GLM-4.1V, GLM-4.6V, GLM-4.5V and GLM-OCR: a GLM decoder with multimodal RoPE as Qwen-VL's beside a Qwen-VL-like tower
GLM_VL = ("glm4v", "glm46v", "glm4v_moe", "glm_ocr", "glmga")  # (GLM-4.1V Thinking's glmga: GLM-4.6V's model)
# Qwen2.5-Omni's and Qwen3-Omni's thinkers: a Qwen2 / Qwen3-MoE decoder with multimodal RoPE beside vision and audio
# encoders
QWEN_OMNI = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
# PaddleOCR-VL: an ERNIE 4.5 decoder with multimodal RoPE as Qwen-VL's beside a SigLIP tower of its own; ERNIE 4.5 VL:
# ERNIE 4.5's MoE decoder with multimodal RoPE in neighbouring pairs beside a Qwen-VL-like tower
# Qwen3.5's and Qwen3.5-MoE's checkpoints: their hybrid decoder beside a vision tower (AutoModelForCausalLM reads the
# decoder alone, as the text types qwen3_5_text and qwen3_5_moe_text)
QWEN3_5_VL = ("qwen3_5", "qwen3_5_moe")
# MiniCPM-V 4.6, 4.7 and MiniCPM-OCR: Qwen3.5's hybrid decoder at text positions beside a SigLIP-like tower
MINICPM_V = ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr")
# Llama 3.2 Vision's decoder, beside its vision tower and as its causal LM: layers attending across to an image's
# tokens (the tower's output) among those attending to the text
CROSS_ATTENDING = ("mllama", "mllama_text_model")
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", *QWEN3_5_VL, *MINICPM_V, "qwen3_next", "olmo_hybrid", "lfm2", "lfm2_vl", "lfm2_moe", "lfm3", "lfm3_vl",
          "granitemoehybrid",
          "nemotron_h", "nemotron_h_omni", "jamba", "bamba", "minimax", "lara_mini", "qwen4_exp_text", "qwen4_exp")


def longrope(switch: int, partial: float = 1.0, head_dim: int = 16, model_type: str = "phi3") -> dict:
    """A tiny Phi-3's config overrides for LongRoPE as Phi-3.5 and Phi-4-mini (partial 0.75) give it: its short set of
    frequencies up to `switch` tokens (original_max_position_embeddings; the real ones: 4096), its long set past it.
    A tiny PhiMoE's (Phi-3.5-MoE) add its cos/sin scalings short_mscale and long_mscale, equal as the released
    model's."""
    pairs = int(head_dim * partial) // 2
    mscales = dict(short_mscale=1.25, long_mscale=1.25) if model_type == "phimoe" else {}
    return dict(original_max_position_embeddings=switch, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=switch, partial_rotary_factor=partial,
        short_factor=[1.0 + 0.1 * i for i in range(pairs)], long_factor=[2.0 + 3.0 * i for i in range(pairs)], **mscales))


# (model type, partial) of the tiny LongRoPE models: Phi-3.5's, Phi-4-mini's (over 0.75 of each head), Phi-3.5-MoE's,
# Phi-4-multimodal's
LONGROPE = [("phi3", 1.0), ("phi3", 0.75), ("phimoe", 1.0), ("phi4_multimodal", 0.75)]
# Phi-3's generate drops the cache where the sequence first reaches past the switch: from 5.20 it calls the model on
# the whole sequence then (which kvcal's cache serves), before on the uncached tokens alone (which kvcal refuses)
LONGROPE_PREFILLED_AGAIN = from_transformers(5, 20, "Phi-3's generate prefills the whole sequence at LongRoPE's switch")


# a tiny Phi-4-mini at head_dim 64: LongRoPE over 0.75 of each head (cos/sin scaled), switching at 16 tokens
PHI4_MINI = dict(hidden_size=256, **longrope(16, 0.75, head_dim=64))
HEAD_DIM_256 = dict(head_dim=256, query_pre_attn_scalar=256)  # the tiny Gemma 3 at Gemma's head_dim


def composite_text(max_positions: int, rope: dict, **settings) -> dict:
    """The text config of a tiny composite whose decoder type has no tiny config of its own: the tiny shapes (head_dim
    16), token ids within TINY_VOCAB, RoPE of theta 10000 with `rope`'s parameters (its multimodal sections), and
    `settings` over them."""
    return {**dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions, pad_token_id=None,
                   bos_token_id=1, eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0, **rope)),
            **settings}


def tiny_latent_widths(model_type: str) -> tuple[list[int], list[int], list[int]]:
    """Per layer of a tiny MLA model (tiny_config), the channels of its rotated key (64; none on Mistral Large 4's layer
    1 and GLM-5 Next's, without RoPE; 32 on dots.note3's sliding layers), of its latent (96; 64 on dots.note3's sliding
    layers) and of what its indexer keeps a token: DeepSeek Sparse Attention's key (80; none on Hy V4's layer 1, reading
    layer 0's pick, nor on dots.note3's sliding layers), GLM-5 Next's key, pool gate scores and real-token flag (2 x 16
    + 1 on its layer 1; none on layer 2, reading layer 1's pick)."""
    if model_type in GLM5_NEXT:
        return [0, 0], [96, 96], [33, 0]
    if model_type in DOTS3_NOTE:
        return [64, 64, 32, 32], [96, 96, 64, 64], [80, 80, 0, 0]
    keys = [64, 0] if model_type == "mistral_large4" else [64, 64]
    return keys, [96, 96], ([80, 0] if model_type in HY_V4 else [80, 80]) if model_type in DSA else [0, 0]


def tiny_config(model_type: str, max_positions: int = 256, **overrides):
    from transformers import AutoConfig

    if model_type == "gemma3":  # Gemma 3 4B-27B: the text decoder beside a vision tower, here of as many layers
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                      patch_size=14)
        text = tiny_config("gemma3_text", max_positions, **overrides).to_dict()
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)
    if model_type in ("gemma4", "gemma4_unified"):  # Gemma 4 E2B to 31B, 12B: the text decoder beside a vision tower (no
        # audio tower: 26B, 31B)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=16, patch_size=14, pooling_kernel_size=2)
        text = tiny_config(f"{model_type}_text", max_positions, **overrides).to_dict()
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, audio_config=None)
    if model_type == "llama4":  # Llama 4 Scout / Maverick: the decoder beside a vision tower, whose pixel shuffle merges 2 x 2
        # patches into a token (4 of an image of 56 x 56 pixels)
        vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                      patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        text = tiny_config("llama4_text", max_positions, **overrides).to_dict()
        return AutoConfig.for_model("llama4", text_config=text, vision_config=vision, image_token_index=TINY_VOCAB - 1)
    if model_type == "mistral3":  # Ministral 3: its decoder beside a Pixtral vision tower, here of as many layers
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                      image_size=28, patch_size=14)
        text = tiny_config("ministral3", max_positions, **overrides).to_dict()
        return AutoConfig.for_model("mistral3", text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1)
    if model_type == "mistral_large4":  # Mistral Large 4: its MLA decoder (below) beside a Pixtral vision tower whose
        # patch merger makes one token of 2 x 2 patches
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                      image_size=56, patch_size=14)
        text = tiny_config("mistral_large4_text", max_positions, **overrides).to_dict()
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=TINY_VOCAB - 1)
    if model_type == "glm5_next":  # GLM-5 Next: its decoder (below) beside a vision tower (its image and video ids
        # and their start and end ones the vocabulary's last six)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      projection_intermediate_size=64)
        text = tiny_config("glm5_next_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        ids = dict(zip(("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                        "video_start_token_id", "video_end_token_id"), range(TINY_VOCAB - 1, TINY_VOCAB - 7, -1)))
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)
    if model_type == "dots3_note":  # dots.note3: its decoder (below) beside a vision tower and an audio one (its image,
        # video and audio ids the vocabulary's last three)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, adapter_in_dim=32,
                      adapter_out_dim=64, mlp_layer_types=["dense"], patch_size=14)
        audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     downsample_hidden_size=16, adapter_input_size=32, adapter_out_dim=64)
        text = tiny_config("dots3_note_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, audio_config=audio,
                                    image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2,
                                    audio_token_id=TINY_VOCAB - 3)
    if model_type in IMAGE_TOWERS:  # a decoder (IMAGE_TOWERS) beside a vision tower (CLIP, InternViT, SigLIP)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                      patch_size=14)
        # their images' patches merged into a quarter of the tokens (LLaVA's: one each; LLaVA-NeXT's and OneVision's one
        # tile of the image's size beside the whole image, a row of each ending in a newline token)
        # (Aria's projector: 4 queries of an image's 4 patches; Idefics2's perceiver: 4 latents an image)
        tiles = dict(image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1)
        extra = dict(llava=dict(vision_feature_layer=-1), internvl=dict(downsample_ratio=0.5), smolvlm=dict(scale_factor=2),
                     idefics3=dict(scale_factor=2), aya_vision=dict(downsample_factor=2),
                     aria=dict(projector_patch_to_query_dict={4: 4}), llava_next=tiles, llava_onevision=tiles,
                     idefics2=dict(perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                                         resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1)),
                     lfm2_vl=dict(downsample_factor=2, projector_hidden_size=64), cohere2_vision=dict(downsample_factor=2),
                     lighton_ocr=dict(spatial_merge_size=2), exaone4_5={}, lfm3_vl={},
                     vipllava=dict(vision_feature_layers=[-2, -1]),
                     llava_next_video=dict(tiles, video_token_index=TINY_VOCAB - 2),
                     video_llava=dict(vision_feature_layer=-1, video_token_index=TINY_VOCAB - 2),
                     hyperclovax_vision_v2=dict(video_token_id=TINY_VOCAB - 2), deepseek_vl={}, janus={},
                     qianfan_ocr={}, video_llama_3={}, got_ocr2={}, llava_onevision1_5={},
                     ovis2_5=dict(video_token_id=TINY_VOCAB - 2, image_start_token_id=TINY_VOCAB - 3,
                                  image_end_token_id=TINY_VOCAB - 4, video_start_token_id=TINY_VOCAB - 5,
                                  video_end_token_id=TINY_VOCAB - 6),
                     # (DeepSeek-VL Hybrid's SAM tower reading the image again at 64 x 64 pixels)
                     deepseek_vl_hybrid=dict(high_res_vision_config=dict(
                         hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                         patch_size=16, window_size=2, global_attn_indexes=[1])),
                     # (Ovis2's visual tokens embedded by a table of the decoder's width, its indicator tokens' ids)
                     ovis2=dict(hidden_size=64, vocab_size=TINY_VOCAB,
                                visual_indicator_token_ids=list(range(TINY_VOCAB - 10, TINY_VOCAB - 5))))[model_type]
        if model_type == "internvl":
            vision.update(image_size=[28, 28], patch_size=[14, 14])
        if model_type == "lighton_ocr":  # (Pixtral's, as Mistral 3's)
            vision["head_dim"] = 16
        if model_type == "janus":  # its aligner's output: the decoder's width
            vision["projection_dim"] = 64
        if model_type == "qianfan_ocr":  # InternViT-like: 2 x 2 patches merged into a token
            vision["image_size"] = 56
        if model_type == "ovis2":  # its visual vocabulary, which an image's patches are soft tokens of
            vision["vocab_size"] = 64
        if model_type == "got_ocr2":  # a SAM tower, 8 x 8 patches of 16 x 16 pixels, and a neck whose two strided
            # convolutions leave 2 x 2 of them: 4 tokens
            vision = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=128,
                          patch_size=16, window_size=2, global_attn_indexes=[1], mlp_dim=64)
        if model_type in ("exaone4_5", "hyperclovax_vision_v2"):  # a Qwen2.5-VL-like tower (EXAONE 4.5's: GQA in its
            # attention), 2 x 2 patches merged into a token
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=2,
                          out_hidden_size=64, patch_size=14, fullatt_block_indexes=[1])
        if model_type == "llava_onevision1_5":  # a Qwen2.5-VL-like tower (a class token prepended to each image's
            # patches), 2 x 2 patches merged into a token
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        if model_type == "ovis2_5":  # a SigLIP-like tower over a grid of patches, 2 x 2 of them merged into a token
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                          num_patches=16)
        if model_type == "lfm3_vl":  # its tower's convolution and attention layers, 2 x 2 patches merged into a token
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, patch_size=14, layer_types=["conv", "full_attention"])
        text = tiny_config(IMAGE_TOWERS[model_type], max_positions, **overrides).to_dict()  # its model_type kept (the
        # composites read it before 5.20)
        image_token = ("image_token_index" if model_type in ("aya_vision", "llava_next", "llava_onevision", "vipllava",
                                                             "llava_next_video", "video_llava", "got_ocr2")
                       else "image_token_id")
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **{image_token: TINY_VOCAB - 1},
                                    **extra)
    if model_type in QWEN_VL:  # Qwen2-VL to Qwen3-VL: a Qwen2 or Qwen3 decoder with multimodal RoPE beside a vision tower
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        if model_type == "qwen2_vl":  # its vision config names the tower's width embed_dim, its output hidden_size
            vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        decoder = {"qwen3_vl_moe": "qwen3_moe", "cosmos3_omni": "qwen3"}.get(model_type, model_type[:5])
        text = tiny_config(decoder, max_positions, head_dim=16, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                       **({"mrope_interleaved": True} if decoder.startswith("qwen3") else {}))
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 1)
    if model_type in GLM_VL:  # RoPE over half of each head in (time, height, width) sections, in neighbouring pairs (but
        # 4.5V's, in halves); 4.5V's experts (4, every one routed to) after a dense layer; token ids within TINY_VOCAB
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        experts = (dict(n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1) if model_type == "glm4v_moe" else {})
        text = composite_text(max_positions, dict(partial_rotary_factor=0.5, mrope_section=[2, 1, 1]),
                              **{**experts, **overrides})
        tokens = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id", "video_start_token_id",
                  "video_end_token_id")
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                    **{name: TINY_VOCAB - 1 - i for i, name in enumerate(tokens)})
    if model_type == "paddleocr_vl":  # RoPE over every channel in (time, height, width) sections; token ids within TINY_VOCAB
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      image_size=28)
        text = composite_text(max_positions, dict(mrope_section=[4, 2, 2]), **overrides)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                    image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2,
                                    vision_start_token_id=TINY_VOCAB - 3)
    if model_type in QWEN_OMNI:  # RoPE in (time, height, width) sections; Qwen3-Omni's experts (4, every one routed to);
        # token ids within TINY_VOCAB
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      fullatt_block_indexes=[1])
        # (Qwen3-Omni's audio output lengths assume its released window of 50 frames, whatever its config says)
        audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64,
                     num_mel_bins=16, n_window=50 if model_type == "qwen3_omni_moe_thinker" else 4)
        text = composite_text(max_positions, dict(mrope_section=[2, 3, 3]), num_experts=4, num_experts_per_tok=4,
                              moe_intermediate_size=32, **overrides)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, audio_config=audio,
                                    image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2,
                                    audio_token_id=TINY_VOCAB - 3, vision_start_token_id=TINY_VOCAB - 4)
    if model_type == "hunyuan_vl":  # HunyuanOCR: a Hunyuan decoder (q and k normed after RoPE with a scale: its keys
        # stored after RoPE) with multimodal RoPE over four axes beside its vision tower; token ids within TINY_VOCAB
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      out_hidden_size=64)
        text = composite_text(max_positions, dict(mrope_section=[2, 2, 2, 2]), **overrides)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                    image_token_id=TINY_VOCAB - 1)
    if model_type == "ernie4_5_vl_moe":  # RoPE over every channel in (height, width, time) sections, its rotary keeping
        # the first two's frequencies split by parity; experts (4, every one routed to) beside a shared one after a
        # dense layer; token ids within TINY_VOCAB
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14)
        text = composite_text(max_positions, dict(mrope_section=[3, 3, 2]), moe_intermediate_size=[32, 32],
                              moe_num_experts=4, moe_k=4, moe_num_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                              **overrides)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                    image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2,
                                    image_start_token_id=TINY_VOCAB - 3, image_end_token_id=TINY_VOCAB - 4)
    if model_type in QWEN3_5_VL:  # their hybrid decoder (below) with multimodal RoPE as released, beside a Qwen3-VL tower
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        text = tiny_config(f"{model_type}_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        text["rope_parameters"] = QWEN3_5_MROPE
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 1)
    if model_type == "qwen4_exp":  # Qwen4-Exp: its decoder (below) beside a vision tower as Qwen3.5's
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        text = tiny_config("qwen4_exp_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 1,
                                    vision_end_token_id=TINY_VOCAB - 4)
    if model_type == "hy_v4_vl":  # Hy V4 VL: a Hy V4 decoder (below) whose RoPE is Qwen3-VL's multimodal one, in
        # interleaved (time, height, width) sections of the rotated key's 64 channels, beside HunYuan VL's vision tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      out_hidden_size=64)
        text = tiny_config("hy_v4", max_positions, **overrides).to_dict()
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [12, 10, 10]}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1,
                                    video_token_id=TINY_VOCAB - 2)
    if model_type == "kimi_k25":  # Kimi K2.5: a DeepSeek-V3 decoder (MLA, below) beside its vision tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      pos_emb_height=8, pos_emb_width=8)
        text = tiny_config("deepseek_v3", max_positions, **overrides).to_dict()
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 1,
                                    vision_end_token_id=TINY_VOCAB - 4, projection_hidden_size=32)
    if model_type == "cohere_compass":  # North: its text decoder (below) beside a Qwen3-VL-like vision tower, which also
        # feeds the decoder's first layer (DeepStack)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      deepstack_visual_indexes=[0], num_position_embeddings=16)
        text = tiny_config("cohere_compass_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 1,
                                    vision_end_token_id=TINY_VOCAB - 4)
    if model_type == "minimax_m3_vl":  # MiniMax-M3: its text decoder (below) beside a Qwen-VL-like vision tower; 1-D RoPE
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      image_size=56)
        text = tiny_config("minimax_m3_vl_text", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 3,
                                    video_token_id=TINY_VOCAB - 2)
    if model_type in MUSE:  # Muse Spark and Muse Glimmer: a sliding layer with RoPE, then a full one without
        # (layer_rope_theta 0), q and k normed by one norm without a scale before RoPE; experts (4, every one routed to)
        # after a dense layer; beside a vision tower merging 2 x 2 patches into a token (Muse Spark's also an audio one)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16)
        text = composite_text(max_positions, {}, **{**dict(
            sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[10000.0, 0],
            mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32, moe_hidden_size=32, num_local_experts=4,
            num_experts_per_tok=4, pad_token_id=0), **overrides})
        audio = (dict(audio_config=dict(out_hidden_size=64, hidden_sizes=[16, 32], patch_sizes=[4, 4], depths=[1, 1],
                                        num_hidden_layers=2), audio_token_id=TINY_VOCAB - 3)
                 if model_type == "muse_spark" else {})
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1,
                                    video_token_id=TINY_VOCAB - 2, out_hidden_size=128, projector_hidden_size=64, **audio)
    if model_type in MINICPM_V:  # Qwen3.5's hybrid decoder (below) beside a tower of 14-pixel patches, which MiniCPM-V
        # merges 16 to a token, MiniCPM-OCR 4
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                      patch_size=14, insert_layer_id=1)
        text = tiny_config("qwen3_5_text", max_positions, **overrides).to_dict()
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1)
    if model_type == "granite4_vision":  # Granite 4 Vision: a Granite decoder (scores scaled by attention_multiplier) into
        # whose layers 0 and 1 a CLIP tower's features reach (DeepStack and spatial QFormer projectors), the image and its one
        # tile, halved, with a newline: 10 tokens
        vision = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                      patch_size=14)
        # (no end-of-text id: one would stop generate early)
        text = composite_text(max_positions, {}, **{**dict(attention_multiplier=0.25, pad_token_id=0, eos_token_id=None),
                                                    **overrides})
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=TINY_VOCAB - 1,
                                    image_grid_pinpoints=[[56, 56]], downsample_rate="1/2", deepstack_layer_map=[[-1, 0]],
                                    spatial_target_layers=[0, 1, 0, 1], vision_feature_layer=-1,
                                    qformer_config=dict(num_hidden_layers=1, intermediate_size=64, vocab_size=64,
                                                        # (the tower's width: 5.20 on sets it so, before it is taken given)
                                                        hidden_size=64, num_attention_heads=1, encoder_hidden_size=64))
    if model_type in CROSS_ATTENDING:  # Llama 3.2 Vision: a Llama decoder whose layers 0 and 2 attend across to an image
        # (its vision tower's output, 2 tiles of 28 x 28 pixels) instead of to the text, 1 and 3 to the text; its causal
        # LM (mllama_text_model) the decoder alone, which skips them without an image
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0], vision_output_dim=64,
                      supported_aspect_ratios=[[1, 1], [1, 2]])
        text = composite_text(max_positions, {}, **{**dict(num_hidden_layers=4, cross_attention_layers=[0, 2], pad_token_id=0),
                                                    **overrides})
        # (AutoModelForCausalLM makes the causal LM of the composite's config)
        return AutoConfig.for_model("mllama", text_config=text, vision_config=vision, image_token_index=TINY_VOCAB - 1)
    if model_type == "chameleon":  # Chameleon: a decoder with q and k LayerNormed per head over batch and tokens
        # flattened, reading an image as the codes of its VQ-GAN (16 of a codebook of 8: 4 x 4 latents of 32 x 32
        # pixels), tokens of its vocabulary (IMGIMG<code as letters>Z); its one config holds the decoder's settings
        codes = {f"IMGIMG{chr(ord('A') + code)}Z": TINY_VOCAB - 12 + code for code in range(8)}
        vq = dict(embed_dim=16, num_embeddings=8, base_channels=32, channel_multiplier=[1, 1, 1, 1], num_res_blocks=1,
                  resolution=32, latent_channels=16)
        return AutoConfig.for_model(model_type, **composite_text(max_positions, {}, **overrides), vq_config=vq,
                                    vocabulary_map={"<image>": TINY_VOCAB - 1, **codes})
    if model_type in ("emu3", "emu3_text_model"):  # Emu3: a Llama-like decoder reading an image as its VQ-VAE's codes
        # (an 8 x 8 image: 4 x 4 codes of a codebook of 8, each row ending in an end-of-line token), tokens of its
        # vocabulary; its causal LM (emu3_text_model) the decoder alone, made by AutoModelForCausalLM of this config
        codes = {f"<|visual token {code:06d}|>": TINY_VOCAB - 12 + code for code in range(8)}
        vq = dict(codebook_size=8, embed_dim=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                  num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1, temporal_downsample_factor=2)
        text = composite_text(max_positions, {}, **{**dict(pad_token_id=0), **overrides})
        return AutoConfig.for_model("emu3", text_config=text, vq_config=vq,
                                    vocabulary_map={"<image>": TINY_VOCAB - 1, "<|extra_200|>": TINY_VOCAB - 2, **codes})
    if model_type == "apertus1p5":  # Apertus 1.5: its decoder (below) reading an image and audio as the codes of their
        # tokenizers (an 8 x 8 image: 4 x 4 codes of a VQ codebook of 8; 64 samples of audio: 16 of WavTokenizer's, of a
        # codebook of 8), tokens of its vocabulary from image_token_offset and audio_token_offset on
        text = tiny_config("apertus1p5_text", max_positions, **overrides).to_dict()
        vision = dict(codebook_size=8, embed_dim=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                      num_res_blocks=1, attn_resolutions=[], resolution=16)
        audio = dict(model_type="wavtokenizer_encoder", codebook_size=8, codebook_dim=16, hidden_size=16, num_filters=4,
                     upsampling_ratios=[2, 2], num_lstm_layers=1)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, audio_config=audio,
                                    image_token_id=TINY_VOCAB - 1, audio_token_id=TINY_VOCAB - 2,
                                    image_token_offset=TINY_VOCAB - 20, audio_token_offset=TINY_VOCAB - 12)
    if model_type == "paligemma":  # PaliGemma: a Gemma decoder attending its prompt both ways (image and text, told by
        # token_type_ids 0) beside a SigLIP tower, an image 4 tokens here
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                      patch_size=14)
        text = {**tiny_config("gemma", max_positions, **overrides).to_dict(), "model_type": "gemma"}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=TINY_VOCAB - 1,
                                    projection_dim=64)
    if model_type == "fuyu":  # Fuyu-8B: a Persimmon decoder reading an image's patches of 14 x 14 pixels, each a token
        # (a linear embedding of its pixels: no vision tower); a causal LM to transformers
        text = tiny_config("persimmon", max_positions, **overrides).to_dict()
        del text["model_type"]
        # (its patch embedding as wide as the decoder: 5.20 on reads that from text_config, before it is taken given)
        return AutoConfig.for_model(model_type, text_config=text, hidden_size=text["hidden_size"], image_size=28, patch_size=14,
                                    image_token_id=TINY_VOCAB - 1)
    if model_type == "nemotron_h_omni":  # Nemotron-H's hybrid decoder (below) beside a RADIO tower whose patches are
        # shuffled 2 x 2 into a token (no audio tower here)
        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=14, image_size=56,
                      max_img_size=112, num_cls_tokens=1, num_registers=1, video_temporal_patch_size=2)
        text = tiny_config("nemotron_h", max_positions, **overrides).to_dict()
        del text["model_type"]  # (the composite's own text type)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, audio_config=None,
                                    image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2, vision_hidden_size=32,
                                    projector_hidden_size=64)
    if model_type == "molmo2":  # Molmo 2: q and k normed per head; YaRN on layer 0 alone (rope_scaling_layers), layer 1
        # rotating by the default RoPE; beside a tower whose adapter pools patches into tokens (weights drawn wide, so that
        # an image moves the logits), an image's tokens attended both ways where mm_token_type_ids say so
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, image_size=[28, 28], patch_size=14, num_position_embeddings=4)
        adapter = dict(vision_feature_layer=[-1], hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, text_hidden_size=64, initializer_range=1.0)
        text = composite_text(max_positions, {}, **{**dict(
            additional_vocab_size=16, rope_scaling_layers=[0],
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
            **overrides})
        tokens = ("image_patch_id", "image_start_token_id", "low_res_image_start_token_id", "image_end_token_id",
                  "frame_start_token_id", "frame_end_token_id")
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, adapter_config=adapter,
                                    **{name: TINY_VOCAB - 1 - i for i, name in enumerate(tokens)})
    if model_type == "deepseek_ocr2":  # DeepSeek-OCR 2: a decoder of dense and MoE MLPs (experts: 4, every one routed
        # to) beside a SAM tower and a Qwen2-like encoder, whose 144 learned queries read an image (and a view separator)
        sam = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                   patch_size=8, window_size=2, global_attn_indexes=[1], downsample_channels=[32, 64])
        encoder = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)
        text = composite_text(max_positions, {}, **{**dict(
            n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
            mlp_layer_types=["dense", "sparse"], pad_token_id=0), **overrides})
        return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(sam_config=sam, encoder_config=encoder),
                                    image_token_id=TINY_VOCAB - 1)
    if model_type == "cosmos3_edge":  # Cosmos 3 Edge: a dense decoder with multimodal RoPE as Qwen-VL's beside a SigLIP
        # tower whose projector merges 2 x 2 patches into a token; token ids within TINY_VOCAB
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                      num_patches=16)
        text = composite_text(max_positions, dict(mrope_section=[2, 3, 3]), pad_token_id=0, **overrides)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1,
                                    video_token_id=TINY_VOCAB - 2, vision_start_token_id=TINY_VOCAB - 3,
                                    vision_end_token_id=TINY_VOCAB - 4, projector_hidden_size=64)
    if model_type == "granite_docling":  # Granite Docling: a Granite decoder (scores scaled by attention_multiplier; its
        # other multipliers 1 here, so an image moves the logits) beside a SigLIP tower merging 2 x 2 patches of a tile into
        # a token, which also feeds the decoder's first layer (DeepStack)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                      patch_size=14, scale_factor=2, out_hidden_size=64)
        text = composite_text(max_positions, {}, **{**dict(attention_multiplier=0.25, embedding_multiplier=1.0,
                                                           residual_multiplier=1.0, logits_scaling=1.0, pad_token_id=0),
                                                    **overrides})
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1,
                                    pad_token_id=0)
    if model_type == "step3p7":  # Step 3.7: a sliding layer of more query heads (8) than its full one (4), whose RoPE
        # (its own theta) rotates half of each head where the sliding one's rotates all; q and k normed per head; a dense
        # MLP, then experts (4, every one routed to); beside a vision tower whose two convolutions merge 4 x 4 patches
        # into a token
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
                      patch_size=14, max_position_embeddings=64)
        text = composite_text(max_positions, {}, **{**dict(
            sliding_window=TINY_WINDOW, num_sliding_attention_heads=8, layer_types=["sliding_attention", "full_attention"],
            rope_theta=[10000.0, 5000000.0], partial_rotary_factors=[1.0, 0.5], mlp_layer_types=["dense", "sparse"],
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, share_expert_dim=32,
            pad_token_id=0), **overrides})
        del text["rope_parameters"]  # (built per layer type from rope_theta and partial_rotary_factors)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=TINY_VOCAB - 1)
    if model_type == "dbrx":  # its own names; q, k and v clamped at 0.25, within their size here (the real ones: 8); its
        # attention reads rope_theta from attn_config (as the real configs hold it); as the Qwen MoEs, every one of 4
        # small experts routed to
        return AutoConfig.for_model("dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=max_positions,
                                    vocab_size=TINY_VOCAB, attn_config=dict(kv_n_heads=2, clip_qkv=0.25, rope_theta=10000.0),
                                    ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=4), **overrides)
    if model_type == "jetmoe":  # JetMoE: its queries from a mixture of attention experts, 2 of them (both routed to,
        # as its MLP's), each making a query head of every KV head
        return AutoConfig.for_model(model_type, **{**dict(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
            kv_channels=16, num_local_experts=2, num_experts_per_tok=2, max_position_embeddings=max_positions,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), **overrides})
    if model_type == "modernbert-decoder":  # as Ettin's decoders: full and sliding layers (here one of each), a RoPE
        # base each, no GQA, its window half its local_attention; its default token ids are past TINY_VOCAB
        return AutoConfig.for_model(model_type, vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=max_positions,
                                    local_attention=2 * TINY_WINDOW, global_attn_every_n_layers=2, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2, cls_token_id=3, sep_token_id=4, **overrides)
    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    if model_type in ("qwen3", "qwen3_moe", "ministral", "seed_oss", "ernie4_5", "ernie4_5_moe", "helium", "cwm", "minimax_m2",
                      "gpt_oss", "flint", "gemma", "internlm3", "iquestcoder", "ministral3", "solar_open", "mellum", "jais2",
                      "hyperclovax", "afmoe", "hy_v3", "dots1", "cohere2_moe", "kolibri1", "hunyuan_v1_dense",
                      "hunyuan_v1_moe", *GLM):
        common["head_dim"] = 16
    # MoE: 4 small experts (Qwen's defaults make 35M parameters), every one routed to: a route flipped by a last-bit
    # difference between a decode step and the whole sequence's forward would move logits past the tests' tolerances
    if model_type in ("qwen2_moe", "qwen3_moe"):
        common.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32)
        if model_type == "qwen2_moe":
            common["shared_expert_intermediate_size"] = 32
    if model_type in ("mixtral", "granitemoe", "granitemoeshared", "minimax_m2", "gpt_oss", "granitemoe_swa"):
        common.update(num_local_experts=4, num_experts_per_tok=4)
    if model_type in GRANITE_SWA:  # its default token ids are past TINY_VOCAB
        common.update(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type == "granite_swa":  # its full layer without RoPE (a RoPE base of 0)
        common["layer_rope_theta"] = [10000.0, 0.0]
    if model_type == "granitemoe_swa":  # a RoPE base a layer: one rotary module each
        common["layer_rope_theta"] = [10000.0, 500000.0]
    if model_type == "olmoe":
        common.update(num_experts=4, num_experts_per_tok=4, pad_token_id=None)
    if model_type == "aria_text":  # as the Qwen MoEs (every one of 4 routed to), beside a shared expert
        common.update(moe_num_experts=4, moe_topk=4, moe_num_shared_experts=1, pad_token_id=None, bos_token_id=1,
                      eos_token_id=2)
    if model_type == "flint":  # as the Qwen MoEs, a shared expert beside the routed ones
        common.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if model_type in ("mellum", "solar_open", "exaone_moe", "afmoe", "flex_olmo", "hy_v3", "dots1"):  # as the Qwen MoEs
        experts = {"mellum": "num_local_experts", "solar_open": "n_routed_experts", "dots1": "n_routed_experts"}.get(
            model_type, "num_experts")
        common.update({experts: 4}, num_experts_per_tok=4, moe_intermediate_size=32, pad_token_id=None)
    if model_type == "exaone_moe":  # as the real ones: a dense first layer, experts after it
        common.update(mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1)
    if model_type == "afmoe":
        common["num_dense_layers"] = 1
    if model_type == "dots1":  # as the real ones: a shared expert beside the routed ones, after a dense first layer
        common.update(n_shared_experts=1, first_k_dense_replace=1)
    if model_type == "hunyuan_v1_moe":  # as the Qwen MoEs, beside its shared expert
        common.update(num_experts=4, moe_topk=4)
    if model_type == "phimoe":  # as Phi-3.5-MoE: two of its experts routed to a token (here of 4)
        common.update(num_local_experts=4, num_experts_per_tok=2)
    if model_type == "flex_olmo":  # its default end-of-text id is past TINY_VOCAB
        common["eos_token_id"] = None
    if model_type == "smollm3":  # layer 1 without RoPE (the real models: every 4th); its default token ids are past TINY_VOCAB
        common.update(no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type in ("phi3", "ministral3", *GLM):  # their default pad token id is past TINY_VOCAB (Phi-3: one fused qkv_proj)
        common["pad_token_id"] = None
    if model_type == "glm4_moe":  # 4 small routed experts, every one routed to (as the Qwen MoEs), after one dense layer
        common.update(n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                      use_qk_norm=True)
    if model_type in ("param2moe", "sarvam_moe", "minicpm5_moe"):  # GLM-4.5's MoE (Param-2, Sarvam-30B: its decoder, RoPE
        # over whole heads, q and k normed; MiniCPM 5 MoE: Llama's attention, each head's query beside an output gate),
        # as glm4_moe's; MiniCPM 5's default token ids are past TINY_VOCAB
        common.update(head_dim=16, n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
                      n_shared_experts=1, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type in ("stablelm", "nemotron", "minimax_m2", *GLM):  # RoPE over the first half of each head's channels
        common["partial_rotary_factor"] = 0.5
    if model_type == "phi":  # as Phi-2: RoPE over 0.4 of each head (6 of 16 channels here)
        common.update(partial_rotary_factor=0.4, pad_token_id=None)
    if model_type == "gpt_neox":  # as Pythia: RoPE over a quarter of each head; no GQA (a head's q, k, v side by side)
        del common["num_key_value_heads"]
        common.update(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
                      pad_token_id=None, bos_token_id=0, eos_token_id=0)
        del common["rope_theta"]
    if model_type in ("cohere", "cohere2", "cohere2_moe"):  # logits unscaled: the default 0.0625 would shrink what tests compare
        common["logit_scale"] = 1.0
    if model_type == "cohere2_moe":  # as the Qwen MoEs; its full layer 1 dense, where force_rope rotates it (pattern 1)
        common.update(num_experts=4, num_experts_per_tok=4, mlp_layer_types=["sparse", "dense"],
                      prefix_dense_intermediate_size=128, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type == "cohere":  # as Command R+: a LayerNorm per head on q and k
        common["use_qk_norm"] = True
    if model_type == "stablelm":  # as StableLM 2 12B: a LayerNorm per head on q and k
        common["qk_layernorm"] = True
    if model_type in ALTERNATING:  # Gemma 3's and OLMo 3's layer types each with its own RoPE, EXAONE 4's full one without
        common.update(sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "full_attention"])
    if model_type in ("gemma2", "vaultgemma"):  # scores capped at 0.05, below their size here (the real ones: 50)
        common.update(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=0.05)
    if model_type == "gemma3_text":
        common.update(head_dim=16, query_pre_attn_scalar=16)
        del common["rope_theta"]
    if model_type == "gemma3n_text":  # as Gemma 3n: its last layers (here 2 and 3) read layers 0's and 1's cache
        common.update(head_dim=16, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                      num_kv_shared_layers=2, vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=16,
                      laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
        del common["rope_theta"]
    if model_type == "gemma4_text":  # as Gemma 4 31B: its full layer has twice the head_dim, half the KV heads and K = V
        # (the value is k_proj's output, normed); its last layers (here 2 and 3) read layers 0's and 1's cache (as E2B)
        common.update(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                      num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                      vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=16)
        del common["rope_theta"]
    if model_type == "gemma4_unified_text":  # as Gemma 4 31B's layers (above), without per-layer inputs
        common.update(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                      num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2)
        del common["rope_theta"]
    if model_type == "beam":  # as Beam-1.0: RoPE on the sliding layer only (the full one's rope parameters None), its
        # queries scaled by position; a dense MLP, then experts (4, every one routed to)
        common.update(head_dim=16, rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                                        full_attention=None),
                      num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"],
                      n_group=1, topk_group=1)
        del common["rope_theta"]
    if model_type == "ergo":  # as Ergo: RoPE on the sliding layer only, q, k and v side by side in one qkv_proj, q and k
        # normed per head, on its full layer both scaled by qk_scale, the root of global_attention_scale (2 here); a dense
        # MLP, then experts (4, every one routed to) beside a shared one
        del common["intermediate_size"]
        common.update(global_attention_scale=2.0, first_dense_intermediate_size=128, num_dense_blocks=1, num_experts=4,
                      num_experts_per_tok=4, moe_intermediate_size=32, shared_intermediate_size=32)
    if model_type == "gpt_oss":  # as the real ones: YaRN everywhere
        common["rope_parameters"] = dict(rope_type="yarn", rope_theta=10000.0, factor=max_positions / 64, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64)
        del common["rope_theta"]
    if model_type == "ministral3":  # as the real ones: YaRN, and queries scaled up past original_max_position_embeddings
        common["rope_parameters"] = dict(rope_type="yarn", rope_theta=10000.0, factor=max_positions / 16, beta_fast=32.0,
                                         beta_slow=1.0, original_max_position_embeddings=16, llama_4_scaling_beta=0.1)
        del common["rope_theta"]
    if model_type == "olmo3":  # as the real ones: YaRN on the full layer (its cos/sin scaled), none on the sliding one
        common["rope_parameters"] = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0), full_attention=dict(
            rope_type="yarn", rope_theta=10000.0, factor=max_positions / 64, original_max_position_embeddings=64))
        del common["rope_theta"]
    if model_type in HYBRID:  # a layer with a recurrent state (gated DeltaNet; LFM2's convolution) before each attention one
        state = "conv" if model_type.startswith("lfm") else "linear_attention"
        other = "mlp" if model_type == "nemotron_h" else state
        common.update(num_hidden_layers=4, head_dim=16)
        if model_type not in ("jamba", "bamba"):  # (theirs follow from their attention layers' period, indices)
            common["layer_types"] = [state, "full_attention", other, "full_attention"]
    if model_type == "lara_mini":  # as Lara Mini: its first attention layer slides (RoPE over a quarter of each head, as
        # Qwen3-Next's), its full one has no RoPE; experts (4, every one routed to) beside a shared one
        del common["intermediate_size"]
        common.update(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
                      sliding_window=TINY_WINDOW, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type == "lfm3":  # as LFM3: its first attention layer slides (its own RoPE), its full one rotates half of
        # each head (proportional RoPE, its config's default); its default token ids are past TINY_VOCAB
        del common["rope_theta"]
        common.update(layer_types=["conv", "sliding_attention", "conv", "full_attention"], sliding_window=TINY_WINDOW,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "lara_mini"):
        common.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if model_type == "granitemoehybrid":  # no RoPE (as Granite 4.0-H: position_embedding_type left unset)
        common.update(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, num_local_experts=4, num_experts_per_tok=4)
    if model_type == "bamba":  # as Bamba: Mamba 2 before each attention layer, RoPE over half of each head
        common.update(attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)
    if model_type == "nemotron_h":  # no RoPE, as every Nemotron-H
        common.update(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1)
    if model_type == "jamba":  # attention every other layer, no RoPE (as Jamba), experts on the attention layers' MLPs
        common.update(attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=4, expert_layer_period=2,
                      expert_layer_offset=1, mamba_d_state=8)
    if model_type == "falcon_h1":  # Mamba 2 beside attention in every layer; keys scaled by a multiplier (as the real ones)
        common.update(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                      key_multiplier=0.7)
    if model_type == "lfm2_moe":
        common.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, num_dense_layers=1)
    if model_type == "olmo_hybrid":  # no RoPE, as the released checkpoints
        common.update(pad_token_id=None, rope_parameters=dict(rope_type="default", rope_theta=None))
        del common["rope_theta"]
    if model_type in ("qwen3_next", "qwen3_5_moe_text"):
        common.update(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if model_type == "llama4_text":  # as Llama 4 Scout: a chunked layer with RoPE and q and k normed after it, then a full
        # one without either (the real ones: every 4th), whose queries are scaled up past position 7; experts on every
        # layer (4, every one routed to). Maverick's config differs in use_qk_norm False (tests name it where it matters)
        common.update(head_dim=16, intermediate_size=32, intermediate_size_mlp=128, attention_chunk_size=TINY_WINDOW,
                      no_rope_layers=[1, 0], num_local_experts=4, num_experts_per_tok=4, use_qk_norm=True, floor_scale=8,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if model_type == "persimmon":  # as Persimmon-8B: a LayerNorm per head on q and k, RoPE over half of each head, each
        # head's q, k and v in turn in one query_key_value, no GQA
        del common["num_key_value_heads"], common["rope_theta"]
        common.update(qk_layernorm=True, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    if model_type in (*LATENT, "mistral_large4_text", "glm5_next_text"):  # as DeepSeek-V3: a latent of 96 channels
        # and a rotated key of 64 (two ggml blocks) per token, queries of a low rank (but Ling's), dense MLPs (the tiny
        # experts' strides fail grouped_mm), no special tokens (an end-of-text id would stop generate early)
        del common["num_key_value_heads"]
        common.update(kv_lora_rank=96, q_lora_rank=48, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
                      first_k_dense_replace=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        if model_type == "glm4_moe_lite":
            common["mlp_layer_types"] = ["dense", "dense"]
        if model_type == "mistral4":  # as Mistral 4: YaRN, and queries scaled up past original_max_position_embeddings
            del common["rope_theta"]
            common["rope_parameters"] = dict(rope_type="yarn", rope_theta=10000.0, factor=16.0,
                                             original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                             mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1,
                                             partial_rotary_factor=0.8)
        if model_type in (*DSA, "mistral_large4_text"):  # as DeepSeek-V3.2 and GLM-5: an indexer per layer picking the 8
            # tokens each query attends to (theirs: 2048), of keys of 64 rotated and 16 other channels; 16 heads (with 2,
            # ReLU zeroes every head's score of a quarter of the tokens, whose ties top-k breaks by the forward's length:
            # a full forward and transformers' own decode pick differently)
            common.update(num_key_value_heads=4, index_topk=TINY_INDEX_TOPK, index_n_heads=16, index_head_dim=80,
                          mlp_layer_types=["dense", "dense"])
        if model_type == "longcat_flash":  # as LongCat-Flash: one decoder layer holding two MLA (cache layers 0 and 1),
            # its queries and latents scaled by mla_scale_q_lora and mla_scale_kv_lora, experts beside its MLPs (4 and 2
            # zero experts, 2 routed to)
            # (num_layers given: transformers before 5.18 does not derive it from num_hidden_layers)
            common.update(num_layers=1, n_routed_experts=4, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=32)
        if model_type == "mistral_large4_text":  # as Mistral Large 4: layer 1 without RoPE (the real ones: every 4th),
            # caching the latent alone, its indexer's keys not rotated either; full-rank queries scaled by position; YaRN
            del common["q_lora_rank"], common["rope_theta"]
            common.update(no_rope_layers=[1, 0], rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=16, beta_fast=32.0,
                beta_slow=1.0, attention_factor=1.0))
        if model_type == "glm5_next_text":  # as GLM-5 Next: MLA without RoPE (a rotated key of no channel) between KDA
            # layers (Kimi Linear's); its layer 1's k-pool indexer picks the tokens of the top 2 pools of 4 keys (theirs:
            # 128 of 16) and those of the pool not yet complete, which layer 2 reuses (its indexer "shared");
            # hyper-connections of 2 streams
            common.update(num_hidden_layers=4, num_key_value_heads=4, qk_rope_head_dim=0, index_topk=TINY_INDEX_TOPK,
                          index_n_heads=16, index_head_dim=16, index_kpool=4, mlp_layer_types=["dense"] * 4,
                          layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                          indexer_types=["full", "full", "shared", "full"], linear_head_dim=16, linear_num_heads=4,
                          hc_mult=2)
        if model_type == "dots3_note_text":  # as dots.note3: MLA with DeepSeek Sparse Attention's indexer on layers 0
            # and 1, and on its sliding layers 2 and 3 MLA of its own widths (fewer heads, a latent of 64, a rotated key
            # of 32, values of 24) and RoPE base; its rotated key normed (k_rope_only_layernorm, a scale) before RoPE,
            # its latent scaled by kv_lora_scale; an output gate per head
            common.update(num_hidden_layers=4, num_key_value_heads=4, head_dim=80, index_topk=TINY_INDEX_TOPK,
                          index_n_heads=16, index_head_dim=80, mlp_layer_types=["dense"] * 4, sliding_window=TINY_WINDOW,
                          swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=32, swa_kv_lora_rank=64,
                          swa_head_dim=48, swa_qk_nope_head_dim=16, swa_v_head_dim=24)
        if model_type == "hy_v4":  # as Hy V4: layer 1 attends to layer 0's pick (its indexer "shared"), sinks per head
            common.update(indexer_types=["full", "shared"], hc_mult=2)
        if model_type in ("kimi_linear", "bailing_hybrid"):  # MLA layers after gated DeltaNet ones (Kimi Linear's KDA,
            # its MLA without RoPE)
            common.update(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                          mlp_layer_types=["dense"] * 4)
        if model_type == "kimi_linear":
            common["linear_attn_config"] = {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}
    if model_type == "cohere_compass_text":  # as North's: multimodal RoPE ((time, height, width) sections, equal for
        # text) on its sliding layer, none on its full one; logits unscaled (as Cohere's, above)
        del common["rope_theta"]
        common.update(logit_scale=1.0, rope_parameters=dict(full_attention=None, sliding_attention=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])))
    if model_type == "phi4_multimodal":  # as Phi-4-multimodal: Phi-4-mini's decoder (one fused qkv_proj, RoPE over 0.75
        # of each head), its image and audio encoders inside the model (here tiny); its default token ids are past TINY_VOCAB
        del common["rope_theta"]
        common.update(pad_token_id=None, bos_token_id=1, eos_token_id=2,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         image_size=28, patch_size=14, crop_size=28, image_token_id=TINY_VOCAB - 1),
                      audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                                        ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
                                        audio_token_id=TINY_VOCAB - 2))
    if model_type == "minimax_m3_vl_text":  # as MiniMax-M3: a block-sparse layer (its lightning indexer picks, per KV head,
        # 2 blocks of 4 keys each query attends: the real ones 16 of 128), then a full one; RoPE over half of each head; q
        # and k normed per head; a dense MLP, then experts (4, every one routed to); its default token ids are past
        # TINY_VOCAB
        del common["rope_theta"]
        common.update(head_dim=16, layer_types=["minimax_m3_sparse", "full_attention"], index_block_size=MINIMAX_M3_BLOCK,
                      index_topk_blocks=2, index_local_blocks=1, index_n_heads=2, index_head_dim=16,
                      mlp_layer_types=["dense", "sparse"], num_local_experts=4, num_experts_per_tok=4,
                      dense_intermediate_size=128, intermediate_size=32, shared_intermediate_size=32,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    if model_type == "qwen4_exp_text":  # as Qwen4-Exp: QSA layers (their indexer picks the tokens of the QSA_BLOCKS
        # compressed blocks of QSA_BLOCK keys each query attends to, and those of its block not yet complete) after
        # gated DeltaNet layers, the first with per-layer embeddings (PLE) of token n-grams; RoPE over half of each head in
        # multimodal sections, equal for text; hyper-connections of 2 streams; experts (4, every one routed to)
        del common["intermediate_size"], common["rope_theta"]
        common.update(head_dim=16, num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention"] * 2,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      hc_count=2, hc_lowrank=16, ple_layer_ids=[1], ple_embed_dim=32, heads_per_ngram=2,
                      ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1,
                      indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=QSA_BLOCKS * QSA_BLOCK,
                      indexer_compress_ratio=QSA_BLOCK, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                           mrope_section=[2, 1, 1]))
    if model_type == "laguna":  # as Laguna XS.2: more query heads on its sliding layer (8) than on its full one (4), whose
        # RoPE (YaRN, cos/sin unscaled) rotates half of each head where the sliding one's rotates all; a dense MLP, then
        # experts (4, every one routed to); its default token ids are past TINY_VOCAB
        del common["rope_theta"]
        common.update(head_dim=16, num_attention_heads_per_layer=[8, 4], mlp_layer_types=["dense", "sparse"], num_experts=4,
                      num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2,
                      rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=500000.0, factor=max_positions / 64,
                                                               original_max_position_embeddings=64, beta_fast=64.0,
                                                               beta_slow=1.0, attention_factor=1.0, partial_rotary_factor=0.5),
                                           sliding_attention=dict(rope_type="default", rope_theta=10000.0,
                                                                  partial_rotary_factor=1.0)))
    if model_type == "mimo_v2_flash":  # as MiMo-V2-Flash: values narrower than keys (16 channels beside 32) and scaled
        # after v_proj, twice the KV heads and sinks on the sliding layer, RoPE over half of each head, a base a type
        del common["rope_theta"]
        common.update(head_dim=32, v_head_dim=16, attention_value_scale=0.707, sliding_window=TINY_WINDOW,
                      layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "dense"],
                      rope_parameters={kind: dict(rope_type="default", rope_theta=theta, partial_rotary_factor=0.5)
                                       for kind, theta in (("full_attention", 500000.0), ("sliding_attention", 10000.0))})
    if model_type in ("opt", "biogpt"):  # no RoPE (learned positions), no GQA
        del common["num_key_value_heads"], common["rope_theta"]
    if model_type == "opt":
        common.update(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if model_type in ("gpt2", "gpt_bigcode"):  # no RoPE (learned positions); q, k, v side by side in one c_attn (GPT-2:
        # a Conv1D, no GQA; GPT-BigCode: one KV head, multi_query, of 32 channels as the others' two of 16)
        common = dict(vocab_size=TINY_VOCAB, n_embd=64 if model_type == "gpt2" else 128, n_layer=2, n_head=4,
                      n_positions=max_positions, bos_token_id=0, eos_token_id=0)
    if model_type in ("gptj", "codegen"):  # GPT-J, CodeGen: RoPE in neighbouring pairs (rotate_every_two) over each head's
        # first rotary_dim channels, from a table of sines and cosines; no GQA; CodeGen's q, v and k in one qkv_proj,
        # side by side within each of 4 shards
        common = dict(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=max_positions,
                      bos_token_id=1, eos_token_id=2)
    if model_type == "falcon":  # Falcon-40B / 180B, Falcon2-11B: each KV head's queries, then its key and value, in one
        # query_key_value (new_decoder_architecture); Falcon-7B's are side by side, one KV head (multi_query)
        common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                      new_decoder_architecture=True, max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2)
    if model_type == "mpt":  # not served (ALiBi): a refusal's example
        common = dict(vocab_size=TINY_VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=max_positions)
    if model_type == "gpt_neo":  # not served (it scores without transformers' attention functions): a refusal
        common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
                      max_position_embeddings=max_positions)
    return AutoConfig.for_model(model_type, **{**common, **overrides})


def tiny_model(model_type: str, seed: int = 0, max_positions: int = 256, **overrides):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    # not causal LMs to transformers
    # (Mistral 4's causal LM is mapped to the image-text-to-text class alone, as kvcal.models loads it)
    composites = ("mistral3", "llama4", "mistral4", "mistral_large4", "glm5_next", "dots3_note", "qwen4_exp", "cohere_compass", "kimi_k25", "hy_v4_vl", "minimax_m3_vl",
                  "paddleocr_vl",
                  "ernie4_5_vl_moe", "hunyuan_vl", "step3p7", "granite_docling", "cosmos3_edge", "deepseek_ocr2", "molmo2",
                  "nemotron_h_omni", "granite4_vision", "mllama", "chameleon", "emu3", "apertus1p5", "paligemma", *MINICPM_V, *QWEN_OMNI,
                  *MUSE, *IMAGE_TOWERS, *QWEN_VL, *QWEN3_5_VL, *GLM_VL)
    auto = AutoModelForImageTextToText if model_type in composites else AutoModelForCausalLM
    model = auto.from_config(tiny_config(model_type, max_positions, **overrides),
                             attn_implementation=OWN_ATTENTION.get(model_type, "sdpa"))
    if model_type in ("gpt_oss", "flint", *GRANITE_SWA):  # sinks spread over the heads (init draws them near 0): a head given another's shows
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.linspace(-1.0, 2.0, model.config.num_attention_heads)
    if model_type == "mistral_large4":  # its init leaves LeRoPE's learned frequencies and the queries' scaling by
        # position without effect: make both matter
        generator = torch.Generator().manual_seed(seed + 1)
        for name, parameter in model.named_parameters():
            if name.endswith("rotary_emb.alpha"):
                parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator)
            if name.endswith("softmax_scaling.scale"):
                parameter.data = 0.2 * torch.randn(parameter.shape, generator=generator)
            if name.endswith("softmax_scaling.bias"):
                parameter.data = 1 + 0.2 * torch.randn(parameter.shape, generator=generator)
    if model_type in ("dots3_note_text", "dots3_note"):  # (its init leaves the norm of the rotated key without a scale:
        # make it matter)
        generator = torch.Generator().manual_seed(seed + 1)
        for name, parameter in model.named_parameters():
            if name.endswith("k_rope_only_layernorm.weight"):
                parameter.data = 1 + 0.5 * torch.randn(parameter.shape, generator=generator)
    if model_type in CROSS_ATTENDING:  # (its init zeroes the gates of what cross-attention adds: no image would matter)
        for layer in decoder_of(model).layers[::2]:
            layer.cross_attn_attn_gate.data.fill_(1.0)
            layer.cross_attn_mlp_gate.data.fill_(1.0)
    return model.eval()


def left_padded(lengths, seed: int = 0):
    """(ids, attention mask) of random prompts of `lengths` tokens, left-padded with token 0 to the longest."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:], mask[row, -n:] = torch.randint(3, TINY_VOCAB, (n,), generator=g), 1
    return ids, mask
