"""Host memory a large append on CPU freed, handed back to the system.

glibc's malloc keeps what it frees: once a large block is freed its mmap threshold rises (up to 32 MiB), so the
temporaries of the steps after it come from heaps it keeps, and holes between them and the blocks that live on are
not given back. A quantized cache's prefill frees many temporaries of the size of its rows while it stores a few
times fewer bytes: left alone, the process would hold several times the cache it built. malloc_trim(0) gives every
free page back; where there is no glibc (macOS, musl) nothing is done."""

from __future__ import annotations

import ctypes

import torch

# a layer's fp16 rows in one append from which the trim's walk of the heap is small beside the append's own work
RELEASE_AFTER_BYTES = 4 * 2**20


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # (the process's C library)
    except (AttributeError, OSError, TypeError):
        return None


MALLOC_TRIM = _malloc_trim()


def release_after_append(rows_bytes: int, device: torch.device) -> None:
    """After a layer appended rows_bytes of fp16 rows on `device`: on CPU, past RELEASE_AFTER_BYTES, give the
    heap the append freed back to the system."""
    if device.type == "cpu" and rows_bytes >= RELEASE_AFTER_BYTES and MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
