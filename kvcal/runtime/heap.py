"""Host memory a cache's steps freed, handed back to the system.

glibc's malloc keeps what it frees: once a large block is freed its mmap threshold rises (up to 32 MiB), so the
temporaries of the steps after it come from heaps it keeps, and holes between them and the blocks that live on are
not given back. A quantized cache's prefill frees many temporaries of the size of its rows while it stores a few
times fewer bytes, and the blocks it keeps fall between them: left alone, the process would hold several times the
cache it built (a single 4K-token prompt alike: its heap grows by the layer's temporaries at every layer).
malloc_trim(0) gives every free page back; it is called where the resident set grew by RELEASE_AFTER_GROWTH since
the last trim, so a heap that reuses its holes costs one read of /proc/self/statm per check. Where there is no glibc
(macOS, musl) or no /proc, nothing is done."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

# the growth of the resident set since the last trim past which a check trims: the most freed heap a process keeps
# beyond what it held after the last trim and the running layer's temporaries
RELEASE_AFTER_GROWTH = 32 * 2**20


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # (the process's C library)
    except (AttributeError, OSError, TypeError):
        return None


MALLOC_TRIM = _malloc_trim()


def resident_bytes() -> int | None:
    """This process's resident set size (/proc/self/statm), None where it cannot be read."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 128).split()[1]) * mmap.PAGESIZE
    finally:
        os.close(fd)


_resident_after_trim = 0  # the resident set after the last trim, lowered to any smaller one a check read since


def release_if_grown(device: torch.device) -> None:
    """On CPU: give the free heap back to the system if the resident set grew by RELEASE_AFTER_GROWTH since the last
    trim (never where it cannot be read: a check at every decode step must stay a read)."""
    global _resident_after_trim
    if device.type != "cpu" or MALLOC_TRIM is None:
        return
    resident = resident_bytes()
    if resident is None:
        return
    if resident - _resident_after_trim < RELEASE_AFTER_GROWTH:
        _resident_after_trim = min(_resident_after_trim, resident)
        return
    MALLOC_TRIM(0)
    _resident_after_trim = resident_bytes() or 0
