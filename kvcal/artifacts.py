"""Reading and writing kvcal artifacts: one safetensors file, str->str metadata, no pickle.

Every artifact carries `kvcal.schema`, `kvcal.kind` (profile, nuq, skvq, bundle), `kvcal.version`
and `kvcal.config` (JSON: model fingerprint, settings, provenance). Writes are atomic: a temp file
in the destination folder, then a rename, so an interrupted write never leaves a loadable file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from kvcal import __version__
from kvcal.errors import KvcalError

SCHEMA_VERSION = 1


def check_writable(path: str | Path) -> Path:
    """Fail before any long work if `path` cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise KvcalError(f"output path '{path}' is a directory; pass a file name ending in .safetensors")
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvcalError(f"cannot write '{path}': '{existing or parent}' is not a writable folder; choose another --out")
    return path


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _canonicalize_header(path: str) -> None:
    """Rewrite the JSON header with sorted keys, in place. safetensors emits metadata in hash-map
    order, which would make identical artifacts differ byte for byte."""
    with open(path, "r+b") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) > length:  # cannot happen for the same content; refuse rather than corrupt
            raise OSError(f"canonical safetensors header is longer than the written one ({len(canonical)} > {length})")
        handle.seek(8)
        handle.write(canonical.ljust(length, b" "))


def write_artifact(path: str | Path, tensors: dict[str, torch.Tensor], kind: str, config: dict,
                   extra_metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    metadata = {
        "format": "pt",
        "kvcal.schema": str(SCHEMA_VERSION),
        "kvcal.kind": kind,
        "kvcal.version": __version__,
        "kvcal.config": json.dumps({**config, "kvcal_version": __version__}, sort_keys=True),
        **(extra_metadata or {}),
    }
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}

    def save(temp: str) -> None:
        save_file(contiguous, temp, metadata=metadata)
        _canonicalize_header(temp)

    return _write_atomically(path, save)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write a small text file (a JSON report) through a temp file and a rename."""
    return _write_atomically(path, lambda temp: Path(temp).write_text(text))


def _write_atomically(path: str | Path, write) -> Path:
    """write(temp) into a temp file beside `path`, then rename it over `path`: an interrupted write
    leaves no file at `path`. Any OSError becomes one KvcalError line."""
    path = check_writable(path)
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        write(temp)
        os.chmod(temp, 0o666 & ~_current_umask())  # mkstemp creates 0600; give the file normal permissions
        os.replace(temp, path)
    except OSError as exc:
        raise KvcalError(f"cannot write '{path}': {exc.strerror or exc}; choose another output path or free space") from exc
    finally:
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)
    return path


def read_header(path: str | Path) -> tuple[str, dict]:
    """(kind, config) of an artifact without reading its tensors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvcalError(f"artifact '{path}' does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error type for every malformed header
        raise KvcalError(f"'{path}' is truncated or not a safetensors file ({exc}); re-create it") from exc
    if "kvcal.kind" not in metadata:
        raise KvcalError(f"'{path}' is a safetensors file but not a kvcal artifact (no kvcal metadata)")
    if metadata.get("kvcal.schema") != str(SCHEMA_VERSION):
        raise KvcalError(
            f"'{path}' has kvcal schema {metadata.get('kvcal.schema')!r}, this kvcal reads schema {SCHEMA_VERSION}; re-create it"
        )
    try:
        config = json.loads(metadata["kvcal.config"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise KvcalError(f"'{path}' has missing or malformed kvcal.config metadata; re-create it") from exc
    return metadata["kvcal.kind"], config


def read_artifact(path: str | Path, kind: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) of an artifact, refusing one of another kind."""
    from safetensors.torch import load_file

    found, config = read_header(path)
    if kind is not None and found != kind:
        raise KvcalError(f"'{path}' is a kvcal {found}, expected a {kind}")
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise KvcalError(f"'{path}' is truncated or corrupt ({exc}); re-create it") from exc
    return tensors, config
