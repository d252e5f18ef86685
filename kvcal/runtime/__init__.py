"""Runtime for calibrated bundles: a quantized KV cache for Hugging Face `generate()` that attends over the
packed cache with fused kernels (CUDA, or compiled for the CPU) and a torch reference attention (their
specification, and the fallback)."""

from kvcal.runtime.cache import WiredCache, quantized_cache


def generate(model, bundle, **generate_kwargs):
    """model.generate(**generate_kwargs) with a fresh quantized cache for `bundle`; the model is left as it was."""
    with quantized_cache(model, bundle) as cache:
        return model.generate(**generate_kwargs, past_key_values=cache)


__all__ = ["WiredCache", "generate", "quantized_cache"]
