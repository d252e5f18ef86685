"""kvcal: offline calibration of KV-cache quantization for Hugging Face causal LMs."""

__version__ = "0.1.0"
