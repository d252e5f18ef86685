"""kvcal: offline calibration of KV-cache quantization for Hugging Face causal LMs.

`kvcal.load_bundle` and `kvcal.calibrate` are loaded on first use, so that `import kvcal` (and `kvcal --help`)
does not pay for torch and transformers."""

from kvcal.version import __version__

__all__ = ["__version__", "calibrate", "load_bundle"]


def __getattr__(name: str):
    if name == "load_bundle":
        from kvcal.bundle import load_bundle

        return load_bundle
    if name == "calibrate":
        from kvcal.calibration import calibrate

        return calibrate
    raise AttributeError(f"module 'kvcal' has no attribute {name!r}")
