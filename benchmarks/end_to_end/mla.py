"""generate() on a DeepSeek-V2-Lite-shaped model (multi-head latent attention, MLA) with random weights: ms per decode
step and cache bytes of transformers' DynamicCache beside kvcal's caches, after a prompt of each --lengths tokens.

Both hold per token and layer what MLA caches: one latent (kv_lora_rank channels) and one rotated key
(qk_rope_head_dim), not each head's keys and values. transformers' attention expands every cached token into each
head's key and value at every step (kv_b_proj over the whole history); kvcal's attends in the latent (the query's
latent part over the latent, kvcal.adapters.LatentAttention): on the CPU with the compiled kernel, and with
--reference each recipe again with its decode steps on the torch reference (KVCAL_CPU_KERNEL=0 for those runs;
appends stay compiled), side by side; on CUDA on the torch reference (the tensor-core kernel reads no latent yet).

The shape: DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, hidden 2048, a full-rank query) with --layers decoder layers, dense MLPs as wide as one of its experts
(1408; the cache's work is the attention's) and a vocabulary of 1024 (`--shape tiny`: a small one for dry runs).
`--shape deepseek-v2-lite-sparse` gives it DeepSeek-V3.2's sparse attention (its low-rank query of 1536 and its
indexer: 64 heads of 128 channels picking 2048 tokens a query), whose indexer keys both caches keep beside the latent
(`tiny-sparse`: a small one, picking 64). `--shape glm5-next` is GLM-5 Next's attention instead (no RoPE, 64 heads
of 256 channels, its k-pool indexer picking the tokens of 128 pools of 16 and keeping 257 channels a token; hidden
4096, MLPs as wide as one of its experts, 2048; `tiny-glm5-next`: a small one). At the sparse shapes each recipe runs
twice: keeping the indexer keys as computed, and in FP8 (--indexer-keys; kvcal.indexer_keys).
Bundles are fitted from a short profile of random token ids (benchmarks.end_to_end.gpu.make_bundles). Every cache is
given the same fp prefill of the prompt but its last token, in steps of --prefill-chunk tokens (kvcal's load it,
DynamicCache takes it through its own update) and decodes --new-tokens greedily; the caches of a length run in turn --rounds times; a row is the median over
the rounds of each run's median step (the first step, the prompt's last token, not timed).

Usage: python -m benchmarks.end_to_end mla [--lengths 1024,4096,8192] [--batch 1] [--recipes kivi,kvquant]
       [--layers 4] [--new-tokens 8] [--rounds 2] [--device cpu] [--reference]      (see --help)
Writes benchmarks/results/mla_generate_<device>.{json,md}, mla_sparse_generate_<device> at the sparse shapes,
mla_glm5_next_generate_<device> at GLM-5 Next's (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import device_slug, provenance, write_markdown, write_result
from benchmarks.end_to_end import gpu

_LITE = dict(hidden_size=2048, intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
             q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=1024,
             max_position_embeddings=32768)
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=96,
             q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, vocab_size=512,
             max_position_embeddings=4096)
SHAPES = {  # (model_type, its config's fields)
    "deepseek-v2-lite": ("deepseek_v2", _LITE),
    "tiny": ("deepseek_v2", _TINY),
    "deepseek-v2-lite-sparse": ("deepseek_v32", {**_LITE, "q_lora_rank": 1536, "index_n_heads": 64, "index_head_dim": 128,
                                                 "index_topk": 2048}),
    "tiny-sparse": ("deepseek_v32", {**_TINY, "q_lora_rank": 48, "index_n_heads": 16, "index_head_dim": 80,
                                     "index_topk": 64}),
    # GLM-5 Next's MLA: no RoPE, 64 heads of 256 channels over a latent of 512, a k-pool indexer (32 heads of 128 picking
    # the tokens of 128 pools of 16) keeping 257 channels a token
    "glm5-next": ("glm5_next", dict(hidden_size=4096, intermediate_size=2048, num_attention_heads=64,
                                    num_key_value_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0,
                                    qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32, index_head_dim=128,
                                    index_topk=2048, index_kpool=16, vocab_size=1024, max_position_embeddings=32768)),
    "tiny-glm5-next": ("glm5_next", {**_TINY, "q_lora_rank": 48, "qk_rope_head_dim": 0, "index_n_heads": 16,
                                      "index_head_dim": 16, "index_topk": 32, "index_kpool": 4}),
}
BASELINE = "DynamicCache"
ON_REFERENCE = " (torch reference)"  # a recipe's row with its decode steps on the torch reference


def parse_args(argv=None) -> argparse.Namespace:
    from kvcal import registry
    from kvcal.errors import KvcalError
    from kvcal.indexer_keys import FORMATS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v2-lite", help="model shape (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs (default: %(default)s)")
    parser.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths in tokens, comma-separated "
                                                                    "(default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--recipes", default="kivi,kvquant", help=f"kvcal recipes, comma-separated ({', '.join(registry.recipes())}) "
                                                                  "(default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=8, help="new tokens per generate(); the first is not timed "
                                                                  "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every cache per length, in turn (default: %(default)s)")
    parser.add_argument("--profile-windows", type=int, default=2, help="windows of the profile the bundles are fitted from "
                                                                      "(default: %(default)s)")
    parser.add_argument("--profile-seqlen", type=int, default=256, help="tokens per profile window (default: %(default)s)")
    parser.add_argument("--reference", action="store_true", help="CPU: time each recipe a second time with its decode "
                                                                 "steps on the torch reference, beside the CPU kernel")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="the prompt's fp prefill in steps of this many "
                        "tokens: its attention, and at the sparse shapes its indexer's scores (64 heads x step x prompt "
                        "floats a layer), stay within memory (default: %(default)s)")
    parser.add_argument("--indexer-keys", default=None, help="at the sparse shapes, how kvcal's caches keep the indexer "
                        "keys, comma-separated (model: as computed; fp8: e4m3 with a scale per 128 channels, "
                        "kvcal.indexer_keys): a row for each with each recipe (default: model,fp8 at the sparse "
                        "shapes, model at the others)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and profile (default: %(default)s)")
    parser.add_argument("--out", default=None, help="result name under benchmarks/results (default: mla_generate_<device>, "
                                                    "mla_sparse_generate_<device> at the sparse shapes, "
                                                    "mla_glm5_next_generate_<device> at GLM-5 Next's)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error("--lengths are whole numbers, comma-separated")
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for recipe in args.recipes:
        try:
            registry.recipe(recipe)
        except KvcalError as exc:  # an unknown name, with the list
            parser.error(f"--recipes: {exc}")
    if min(args.lengths) < 2 or args.batch < 1 or args.layers < 1 or args.rounds < 1 or args.prefill_chunk < 1:
        parser.error("--lengths are at least 2 tokens, --batch, --layers, --rounds and --prefill-chunk at least 1")
    positions = SHAPES[args.shape][1]["max_position_embeddings"]
    if max(args.lengths) + args.new_tokens > positions:
        parser.error(f"--lengths + --new-tokens reach past the shape's {positions} positions")
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first step is not timed)")
    sparse = SHAPES[args.shape][0] != "deepseek_v2"
    args.indexer_keys = [k.strip() for k in (args.indexer_keys or ("model,fp8" if sparse else "model")).split(",") if k.strip()]
    if not set(args.indexer_keys) <= set(FORMATS) or len(set(args.indexer_keys)) < len(args.indexer_keys):
        parser.error(f"--indexer-keys lists each of {', '.join(FORMATS)} at most once")
    if args.indexer_keys != ["model"] and not sparse:
        parser.error(f"--indexer-keys: the {args.shape} shape has no indexer (a sparse shape has)")
    if args.profile_windows < 1 or args.profile_seqlen < 2:
        parser.error("--profile-windows is at least 1 and --profile-seqlen at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    if args.device == "cuda" and args.reference:
        parser.error("--reference compares the CPU kernel with the torch reference: give it with --device cpu")
    return args


def random_model(shape: str, layers: int, device: str, seed: int):
    """A causal LM of `shape` (DeepSeek-V2's, DeepSeek-V3.2's for the sparse shapes; GLM-5 Next's decoder, every layer
    an MLA one running its own indexer, beside a vision tower of one small block) with `layers` dense decoder layers
    and random weights (transformers' own initialisation, seeded), bf16 on CUDA and fp32 on CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_type, fields = SHAPES[shape]
    text = dict(**fields, num_hidden_layers=layers, mlp_layer_types=["dense"] * layers, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    if model_type == "glm5_next":
        text.update(layer_types=["indexed_attention"] * layers, indexer_types=["full"] * layers)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=fields["hidden_size"],
                      patch_size=14, projection_intermediate_size=64)
        ids = dict(zip(("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                        "video_start_token_id", "video_end_token_id"),
                       range(fields["vocab_size"] - 6, fields["vocab_size"])))
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)
        auto = AutoModelForImageTextToText
    else:
        config, auto = AutoConfig.for_model(model_type, **text, first_k_dense_replace=layers), AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = auto.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                 attn_implementation="sdpa")
    return model.eval()


@contextlib.contextmanager
def decoding_on_the_reference():
    """Decode steps of the caches made and run inside on the torch reference: the CPU kernel switched off as
    KVCAL_CPU_KERNEL=0 does (kvcal.runtime.cpu_kernel), then back on."""
    from kvcal.runtime import cpu_kernel

    before = os.environ.get("KVCAL_CPU_KERNEL")
    os.environ["KVCAL_CPU_KERNEL"] = "0"
    cpu_kernel.library.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVCAL_CPU_KERNEL"]
        else:
            os.environ["KVCAL_CPU_KERNEL"] = before
        cpu_kernel.library.cache_clear()


def measure(args) -> dict:
    from transformers import DynamicCache

    from kvcal.bundle import load_bundle
    from kvcal.runtime import quantized_cache
    from kvcal.runtime.fp_context import fp_context

    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_model(args.shape, args.layers, args.device, args.seed)
    clock = gpu.Clock(args.device)
    with tempfile.TemporaryDirectory() as folder:
        args.shape_name = f"random {args.shape}"
        paths, timing = gpu.make_bundles(model, argparse.Namespace(**{**vars(args), "shape": args.shape_name}), Path(folder),
                                         clock, tuple(args.indexer_keys))
        bundles = {recipe: load_bundle(path) for recipe, path in paths.items()}
    generator = torch.Generator().manual_seed(args.seed + 2)
    rows = []
    for length in args.lengths:
        vocabulary = model.config.get_text_config().vocab_size
        prompt = torch.randint(vocabulary, (args.batch, length), generator=generator).to(args.device)
        with torch.inference_mode():
            context = fp_context(model, prompt[:1, :-1], args.prefill_chunk)

        stored = []  # each run's cache bytes, exact (run_cache rounds them to GiB), and what decoded its layers

        def counted(bytes_of, path_of):
            return lambda cache: stored.append((bytes_of(cache), path_of(cache))) or stored[-1][0]

        def dynamic():
            cache = gpu.filled_transformers_cache(DynamicCache(config=model.config), context, args.batch)
            return cache, counted(gpu.transformers_cache_bytes, lambda cache: "transformers")

        def kvcal_cache(bundle):
            def make():
                cache = quantized_cache(model, bundle)
                cache.load(gpu.batched(context, args.batch))
                return cache, counted(lambda cache: cache.used_bytes(),
                                      lambda cache: ",".join(sorted({layer.decode_path for layer in cache.layers})))
            return make

        makers = [(BASELINE, dynamic)]
        for recipe, bundle in bundles.items():
            makers += [(f"kvcal {recipe}{suffix}", kvcal_cache(bundle)) for suffix in ("", *[ON_REFERENCE] * args.reference)]
        runs = {name: [] for name, _ in makers}
        for round_ in range(args.rounds):
            for name, make in makers:
                with decoding_on_the_reference() if name.endswith(ON_REFERENCE) else contextlib.nullcontext():
                    run = gpu.run_cache(model, prompt, args.new_tokens, make, args.device, clock)
                runs[name].append({**run, "cache_bytes": stored[-1][0], "decode_path": stored[-1][1]})
                print(f"length {length}, round {round_ + 1}/{args.rounds}: {name} {runs[name][-1]['ms_per_step']} ms/step",
                      flush=True)
        del context
        for name, cell in runs.items():
            rows.append({"length": length, "cache": name, "ms_per_step": statistics.median(r["ms_per_step"] for r in cell),
                         "cache_bytes": cell[0]["cache_bytes"], "decode_path": cell[0]["decode_path"]})
    return {"settings": {k: v for k, v in vars(args).items() if k != "shape_name"}, "config": SHAPES[args.shape][1],
            "timing": timing, "results": rows}


def table(result: dict, started: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"# generate() with MLA: {settings['shape']} attention, {settings['layers']} layers, batch {settings['batch']}",
             "", f"{started['device']}, torch {started['torch']}, commit {started['commit']}, {started['date']}; "
             f"median ms per decode step over {settings['rounds']} rounds of {settings['new_tokens']} new tokens "
             "(the first not timed); cache bytes after the prefill and the new tokens, every layer (DynamicCache's in the "
             "model's dtype: fp32 on the CPU, twice an fp16 cache's)", "",
             "| prompt tokens | cache | decode steps on | ms / step | speed vs DynamicCache | cache MiB | bytes vs DynamicCache |",
             "|---|---|---|---|---|---|---|"]
    for length in settings["lengths"]:
        cell = [row for row in result["results"] if row["length"] == length]
        base = next(row for row in cell if row["cache"] == BASELINE)
        lines += [f"| {length} | {row['cache']} | {row['decode_path']} | {row['ms_per_step']:.1f} | {base['ms_per_step'] / row['ms_per_step']:.2f}x "
                  f"| {row['cache_bytes'] / 2**20:.2f} | {row['cache_bytes'] / base['cache_bytes']:.1%} |" for row in cell]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    started = provenance()
    kind = {"deepseek_v32": "_sparse", "glm5_next": "_glm5_next"}.get(SHAPES[args.shape][0], "")
    name = args.out or f"mla{kind}_generate_{device_slug(started['device'])}"
    result = measure(args)
    write_result(name, result, started)
    write_markdown(name, table(result, started))


if __name__ == "__main__":
    main()
