"""Editing kvcal artifacts on disk for tests: rewrite tensors or metadata (resealed with a valid checksum, as a
buggy or malicious writer would, or not), and read / write the raw safetensors layout (8-byte little-endian
header length, JSON header, data) for byte-level mutations."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcal.artifacts import CHECKSUM_KEY, artifact_checksum


def read_metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def rewrite(path, out, tensors_fn=None, metadata_fn=None, config_fn=None, reseal: bool = True) -> Path:
    """Copy artifact `path` to `out` with its tensors, metadata and/or kvcal.config (a dict) changed by the given
    functions; `reseal` recomputes the checksum so that only kvcal's validation stands between it and use."""
    metadata = read_metadata(path)
    tensors = load_file(str(path))
    tensors = tensors_fn(tensors) if tensors_fn else tensors
    metadata = metadata_fn(metadata) if metadata_fn else metadata
    if config_fn is not None:
        metadata["kvcal.config"] = json.dumps(config_fn(json.loads(metadata["kvcal.config"])))
    if reseal:
        metadata[CHECKSUM_KEY] = artifact_checksum(tensors, metadata)
    save_file(tensors, str(out), metadata=metadata)
    return Path(out)


def split_raw(data: bytes) -> tuple[dict, bytes]:
    """(header JSON as a dict, data section) of a well-formed safetensors file's bytes."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_raw(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + body
