"""Runtime for calibrated bundles: a quantized KV cache for Hugging Face `generate()` that attends over the
packed cache with fused kernels (CUDA, or compiled for the CPU) and a torch reference attention (their
specification, and the fallback)."""

from kvcal.model_caches import cache_argument
from kvcal.runtime.cache import WiredCache, quantized_cache


def generate(model, bundle, later_steps: str = "prefill", **generate_kwargs):
    """model.generate(**generate_kwargs) with a fresh quantized cache for `bundle` (later_steps: quantized_cache's);
    the model is left as it was."""
    with quantized_cache(model, bundle, later_steps=later_steps) as cache:
        return model.generate(**generate_kwargs, **cache_argument(cache))


__all__ = ["WiredCache", "generate", "quantized_cache"]
