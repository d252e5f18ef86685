"""End to end: generate(), passkey retrieval and cache memory on SmolLM2 on CPU (`cpu`), memory and passkey /
multi-key retrieval at 4K-32K tokens on Gemma 3 (`long-context`), generate() on a Llama-3.1-8B-shaped model on a GPU
(`gpu`) and on a DeepSeek-V2-Lite-shaped one, multi-head latent attention (`mla`), the host side of kvcal's decode
step on the CUDA path, measured on the CPU (`host`), `kvcal profile-gradients`' time and memory
(`profile_gradients`), prompt lookup decoding through the cache (`speculative`), and a step of several tokens over a
stored cache read by the decode kernel and by the torch reference (`short-steps`)."""

# mode of `python -m benchmarks.end_to_end` -> (module, what it measures)
MODES = {
    "cpu": ("benchmarks.end_to_end.cpu", "generate(), passkey, memory and Cocktail through the runtime cache on SmolLM2 (CPU)"),
    "long-context": ("benchmarks.end_to_end.long_context", "cache memory at 8K-32K and passkey / multi-key retrieval at 4K-32K (CPU)"),
    "gpu": ("benchmarks.end_to_end.gpu", "generate() per step against StaticCache / DynamicCache on an 8B-shaped model (CUDA)"),
    "host": ("benchmarks.end_to_end.host", "the host side of kvcal's CUDA decode step per layer, launches skipped (CPU)"),
    "profile": ("benchmarks.end_to_end.profile_gradients", "wall time and peak memory of kvcal profile-gradients"),
    "mla": ("benchmarks.end_to_end.mla", "generate() on a DeepSeek-V2-Lite-shaped model (MLA) against DynamicCache"),
    "speculative": ("benchmarks.end_to_end.speculative", "prompt lookup decoding against greedy, DynamicCache and kvcal's caches"),
    "short-steps": ("benchmarks.end_to_end.short_steps", "a step of several tokens over a stored cache: kernel or reference"),
}
