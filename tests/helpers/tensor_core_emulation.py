"""tools.kernel_emulation's tensor-core kernel for the tests: its build skipped where no g++ is. Used by
tests/test_tensor_core_decode.py (the kernel alone) and tests/test_kernel_emulation.py (the cache's decode steps)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from helpers import skip_without_gxx
from kvcal.runtime import kernel_source
from kvcal.runtime.tensor_core import Variant
from tools import kernel_emulation
from tools.kernel_emulation import decode, schedule_in_reverse, symbol

__all__ = ["build", "decode", "schedule_in_reverse", "symbol"]


def build(variants: list[Variant], kernel_dir: Path = kernel_source.KERNEL_DIR) -> ctypes.CDLL:
    skip_without_gxx()
    return kernel_emulation.build(variants, kernel_dir)
