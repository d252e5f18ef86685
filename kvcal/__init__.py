"""kvcal: offline calibration of KV-cache quantization for Hugging Face causal LMs."""

__version__ = "0.1.0"


def load_bundle(path, model=None):
    """Validate and load a calibration bundle (see kvcal.bundle); with `model`, refuse one made for another."""
    from kvcal.bundle import load_bundle as _load_bundle

    return _load_bundle(path, model)
