"""Reading and writing kvcal artifacts: one safetensors file, str->str metadata, no pickle.

Every artifact carries `kvcal.schema`, `kvcal.kind` (profile, nuq, skvq, bundle), `kvcal.version`,
`kvcal.config` (JSON: model fingerprint, settings, provenance) and `kvcal.sha256`: a checksum of all of
that metadata and of every tensor's name, dtype, shape and bytes, verified by every read (schema 2; schema 1
artifacts had a checksum of the tensors of bundles only, and are refused with a message to re-create them). Schema
3 is schema 2 written where an artifact records what a kvcal reading schema 2 alone would pass over without a word
(a bundle's indexer keys kept otherwise than as computed), so that such a kvcal refuses it; kvcal reads either, of
every kind.
Writes are atomic: a temp file in the destination folder, then a rename, so an interrupted write never
leaves a loadable file; an output path is written only if it is absent or a regular file that is none of
the command's inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvcal.version import __version__
from kvcal.errors import KvcalError

SCHEMA_VERSION = 2  # what an artifact is written as, unless it needs NEWEST_SCHEMA
NEWEST_SCHEMA = 3
READ_SCHEMAS = ("2", "3")
CHECKSUM_KEY = "kvcal.sha256"


def describe_fingerprint(f) -> str:
    if not isinstance(f, dict):
        return f"a malformed model fingerprint ({type(f).__name__})"
    heads = (f"kv heads x head_dim per layer {list(zip(f['layer_kv_heads'], f['layer_head_dims']))}" if "layer_head_dims" in f
             else f"{f.get('num_kv_heads')} kv heads x {f.get('head_dim')}")
    return f"{f.get('architecture')} {f.get('num_layers')} layers, {heads}, config {f.get('config_sha256')}"


def check_same_model(expected: dict, actual: dict, subject: str, target: str, fix: str) -> None:
    """Refuse `subject` (calibrated for the model of fingerprint `expected`) for `target` (fingerprint `actual`)."""
    if expected != actual:
        raise KvcalError(f"{subject} was made for {describe_fingerprint(expected)}, not for {target} "
                         f"({describe_fingerprint(actual)}); {fix}")


_FILE_TYPES = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a fifo",
               stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory"}


def _not_regular(path: Path) -> str | None:
    """What `path` is if it exists and is not a regular file (following symlinks), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:  # absent, or a dangling link (replaced by the rename like an absent file)
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _FILE_TYPES.items() if test(mode)), "not a regular file")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_writable(path: str | Path, option: str = "--out", inputs=()) -> Path:
    """Fail before any long work if `path` (given as `option`) cannot be written: it must be absent or a
    regular file (the atomic rename would turn a device or fifo into a file), none of `inputs` nor a file of an
    input folder, and in a writable folder. A link is written through: the path returned is the file it names, which
    the rename replaces, not the link."""
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    what = _not_regular(path)
    if what == "a directory":
        raise KvcalError(f"{option} '{path}' is a directory; pass a file name ending in {path_suffix(option)}")
    if what is not None:
        raise KvcalError(f"{option} '{path}' exists and is {what}, not a regular file; kvcal replaces only regular files: "
                         f"choose another {option}")
    for source in inputs:
        if source is None or not Path(source).exists():
            continue  # (a dataset or model given by name, not a path)
        if _same_file(path, Path(source)):
            raise KvcalError(f"{option} '{path}' is also an input ('{source}'); writing it would destroy that input: "
                             f"choose another {option}")
        if Path(source).is_dir() and path.exists() and path.resolve().is_relative_to(Path(source).resolve()):
            raise KvcalError(f"{option} '{path}' is a file of the input folder '{source}'; writing it would change that "
                             f"input: choose another {option}")
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvcalError(f"cannot write '{path}': '{existing or parent}' is not a writable folder; choose another {option}")
    return path


def path_suffix(option: str) -> str:
    return {"--json": ".json", "--plot": ".png"}.get(option, ".safetensors")


def artifact_checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 of an artifact's metadata (every key but the checksum itself) and of every tensor's name, dtype,
    shape and bytes: any change of kvcal.config, kind, schema or a tensor changes it."""
    return _checksum(sorted(tensors), tensors.__getitem__, metadata)


def _checksum(names: list[str], tensor_of: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> str:
    """artifact_checksum over `names` (sorted), each tensor got by tensor_of(name) when its turn comes: read from a file,
    one is held at a time."""
    digest = hashlib.sha256()
    header = {key: value for key, value in metadata.items() if key != CHECKSUM_KEY}
    digest.update(json.dumps(header, sort_keys=True, ensure_ascii=False).encode())
    for name in names:
        tensor = tensor_of(name).detach().contiguous().cpu()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
                   extra_metadata: dict[str, str] | None = None, schema: int = SCHEMA_VERSION) -> Path:
    metadata = {
        "format": "pt",
        "kvcal.schema": str(schema),
        "kvcal.kind": kind,
        "kvcal.version": __version__,
        "kvcal.config": json.dumps({**config, "kvcal_version": __version__}, sort_keys=True),
        **(extra_metadata or {}),
    }
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    metadata[CHECKSUM_KEY] = artifact_checksum(contiguous, metadata)

    def save(temp: str) -> None:
        save_file(contiguous, temp, metadata=metadata)
        _canonicalize_header(temp)

    return write_atomically(path, save)


def write_text_atomic(path: str | Path, text: str, option: str = "--json") -> Path:
    """Write a small text file (a JSON report) through a temp file and a rename."""
    return write_atomically(path, lambda temp: Path(temp).write_text(text), option)


def write_atomically(path: str | Path, write, option: str = "--out") -> Path:
    """write(temp) into a temp file beside `path`, then rename it over `path`: an interrupted write
    leaves no file at `path`. Any OSError becomes one KvcalError line naming `option`."""
    path = check_writable(path, option)
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        write(temp)
        os.chmod(temp, 0o666 & ~_current_umask())  # mkstemp creates 0600; give the file normal permissions
        os.replace(temp, path)
    except (OSError, SafetensorError) as exc:  # (safetensors' own error for its writes' I/O failures: a full disk)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _one_line(exc)
        raise KvcalError(f"cannot write '{path}': {reason}; choose another {option} or free space") from exc
    finally:
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)
    return path


def read_header(path: str | Path) -> tuple[str, dict]:
    """(kind, config) of an artifact without reading its tensors."""
    with _opened(path) as (_, kind, config, _):
        return kind, config


def _recreate(kind: str) -> str:
    return "re-export it (kvcal export bundle, or kvcal calibrate)" if kind == "bundle" else "re-create it with the kvcal command that wrote it"


@contextmanager
def _opened(path: str | Path) -> Iterator[tuple[safe_open, str, dict, dict]]:
    """(handle, kind, config, raw metadata) of an artifact, its schema and metadata checked. Metadata and tensors come
    through the one handle: a file replaced (renamed over) while it is read is read whole as it was when opened."""
    path = Path(path)
    what = _not_regular(path)
    if what == "a directory":
        raise KvcalError(f"'{path}' is a directory, not a kvcal artifact; pass a .safetensors file")
    if what is not None:
        raise KvcalError(f"'{path}' is {what}, not a kvcal artifact; pass a .safetensors file")
    if not path.is_file():
        raise KvcalError(f"artifact '{path}' does not exist")
    try:
        handle = safe_open(str(path), framework="pt")
        metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error type for every malformed header
        raise KvcalError(f"'{path}' is truncated or not a safetensors file ({_one_line(exc)}); re-create it") from exc
    with handle:
        kind = metadata.get("kvcal.kind")
        if kind is None:
            raise KvcalError(f"'{path}' is a safetensors file but not a kvcal artifact (no kvcal metadata)")
        schema = metadata.get("kvcal.schema")
        readable = f"schemas {' and '.join(READ_SCHEMAS)}"
        if schema == "1":
            raise KvcalError(f"'{path}' is a kvcal {kind} of schema 1, written by an older kvcal (no checksum over its "
                             f"metadata); this kvcal reads {readable}: {_recreate(kind)}")
        if isinstance(schema, str) and schema.isdecimal() and int(schema) > NEWEST_SCHEMA:
            raise KvcalError(f"'{path}' has kvcal schema {schema!r}, written by a newer kvcal; this kvcal reads "
                             f"{readable}: read it with a kvcal as new as the one that wrote it")
        if schema not in READ_SCHEMAS:
            raise KvcalError(f"'{path}' has kvcal schema {schema!r}, this kvcal reads {readable}; {_recreate(kind)}")
        try:
            config = json.loads(metadata["kvcal.config"])
        except (KeyError, json.JSONDecodeError) as exc:
            raise KvcalError(f"'{path}' has missing or malformed kvcal.config metadata; {_recreate(kind)}") from exc
        if not isinstance(config, dict):
            raise KvcalError(f"'{path}': its kvcal.config metadata is not a JSON object; {_recreate(kind)}")
        yield handle, kind, config, metadata


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:200] + ("..." if len(text) > 200 else "") or type(exc).__name__


def read_artifact(path: str | Path, kind: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) of an artifact, refusing one of another kind."""
    with _opened(path) as (handle, found, config, metadata):
        if kind is not None and found != kind:
            raise KvcalError(f"'{path}' is a kvcal {found}, expected a {kind}")
        try:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except MemoryError:
            raise
        except Exception as exc:
            raise _truncated(path, found, exc) from exc
    _check_checksum(path, found, metadata, artifact_checksum(tensors, metadata))
    return tensors, config


def verify_artifact(path: str | Path) -> None:
    """Refuse an artifact any of whose tensors fails its checksum, reading one tensor at a time (memory: the largest
    tensor): for a command that reads the tensors only after long work (loading a model, a layer's fit), so that a
    corrupt file is refused before it; the file is then read twice."""
    with _opened(path) as (handle, found, _, metadata):
        try:
            computed = _checksum(sorted(handle.keys()), handle.get_tensor, metadata)
        except MemoryError:
            raise
        except Exception as exc:
            raise _truncated(path, found, exc) from exc
    _check_checksum(path, found, metadata, computed)


def _truncated(path: str | Path, kind: str, exc: Exception) -> KvcalError:
    return KvcalError(f"'{path}' is truncated or corrupt ({_one_line(exc)}); {_recreate(kind)}")


def _check_checksum(path: str | Path, kind: str, metadata: dict, computed: str) -> None:
    if metadata.get(CHECKSUM_KEY) != computed:
        raise KvcalError(f"'{path}' fails its checksum: the file is corrupt or was edited; {_recreate(kind)} (or download it again)")
