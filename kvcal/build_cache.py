"""kvcal's cache folder, `$KVCAL_CACHE_DIR` (default ~/.cache/kvcal), and the build outputs kept there by the hash of
everything that goes into them (sources, flags, compiler, target): the compiled CPU kernels, NVRTC's compile checks,
the tests' emulator libraries. (kvcal.models assembles chunked model packages under its `models/`.) An output is built under a temporary name and renamed into place, so a concurrent first use never reads
half a file, and a changed input is a new name, never a stale hit."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcal.errors import KvcalError


def cache_dir() -> Path:
    return Path(os.environ.get("KVCAL_CACHE_DIR") or Path.home() / ".cache" / "kvcal")


def digest(parts: list[str | bytes]) -> str:
    """A short hash of the parts, each told apart from its neighbours."""
    hasher = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        hasher.update(len(data).to_bytes(8, "little") + data)
    return hasher.hexdigest()[:16]


def cached(name: str, key: list[str | bytes], build: Callable[[Path], None]) -> Path:
    """The path of `name` (a file name: stem and suffix) built for `key`; build(path) writes it where missing."""
    stem, suffix = os.path.splitext(name)
    target = cache_dir() / f"{stem}-{digest(key)}{suffix}"
    try:
        built = target.is_file()
    except OSError as exc:  # (a component of the folder's path over the file system's limit)
        raise _unwritable(target, exc) from exc
    if not built:
        build_into_place(target, build)
    return target


def build_into_place(target: Path, build: Callable[[Path], object]) -> None:
    """build(path) writes a file at path: under a temporary name in target's folder, then renamed to target, so that a
    concurrent reader never finds half a file there. A folder that cannot be written is one KvcalError naming
    KVCAL_CACHE_DIR (what build itself raises passes through)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as exc:
        raise _unwritable(target, exc) from exc
    with folder:
        built = Path(folder.name) / target.name
        build(built)
        try:
            os.replace(built, target)
        except OSError as exc:
            raise _unwritable(target, exc) from exc


def _unwritable(target: Path, exc: OSError) -> KvcalError:
    return KvcalError(f"cannot write kvcal's cache folder '{target.parent}' ({exc.strerror or exc}); set KVCAL_CACHE_DIR "
                      "to a writable folder")
