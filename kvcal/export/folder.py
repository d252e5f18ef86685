"""Output folders of the exports: refused before any work when writing would destroy something, and written
atomically (into a temp folder beside, then renamed) so that an interrupted export leaves nothing half-written."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcal.errors import KvcalError


def check_out_folder(out: str | Path, inputs: list[Path], is_previous: Callable[[Path], bool], kind: str) -> Path:
    """Refuse, before any work, an --out that cannot be written or would destroy something: an existing
    path that is not a directory, a non-empty directory that is not a previous kvcal vllm export, a
    folder that is or holds one of the inputs."""
    out = Path(out).expanduser()
    resolved = out.resolve()
    for path in inputs:
        path = Path(path).expanduser().resolve()
        if path == resolved or resolved in path.parents:
            raise KvcalError(f"--out '{out}' is or contains the input '{path}'; choose a new folder")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise KvcalError(f"--out '{out}' exists and is not a directory; pass a new folder, an empty one or a previous {kind}")
    if out.is_dir() and any(out.iterdir()) and not is_previous(out):
        raise KvcalError(f"--out '{out}' is a non-empty directory that is not a {kind}; pass a new or empty folder")
    existing = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvcalError(f"cannot write '{out}': '{existing or out.parent}' is not a writable folder; choose another --out")
    return out


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_folder_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """write(temp) into a temp folder beside `out`, then rename it to `out` (replacing an empty folder or
    a previous kvcal export): an interrupted export leaves no half-written folder at `out`."""
    temp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        write(temp)
        mask = _current_umask()  # mkdtemp makes 0700 and save_pretrained writes some files 0600: give them normal permissions
        for path in (temp, *temp.rglob("*")):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        _rename_over(temp, out)
        temp = None
    except OSError as exc:
        raise KvcalError(f"cannot write '{out}': {exc.strerror or exc}; choose another --out or free space") from exc
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return out


_RENAME_TRIES = 10


def _rename_over(temp: Path, out: Path) -> None:
    """Rename the folder `temp` to `out`, replacing what is there (a rename replaces only an empty folder, so a previous
    export is first renamed aside, then removed). Another export renaming onto `out` at the same time makes the rename
    fail or the folder vanish: try again, so that the last one renamed wins, as for files."""
    for _ in range(_RENAME_TRIES):
        old = None
        if _holds_files(out):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            try:
                os.replace(out, old)  # old is an empty folder: the rename replaces it
            except FileNotFoundError:  # another export renamed it aside first
                old.rmdir()
                continue
        try:
            os.replace(temp, out)  # over nothing, or over an empty folder
            renamed = True
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                if old is not None:
                    _put_back(old, out, exc)
                raise
            renamed = False  # another export's folder arrived first
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # the previous export, replaced by ours or another's
        if renamed:
            return
    raise KvcalError(f"cannot write '{out}': other processes kept replacing it; run one export to it at a time")


def _holds_files(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(folder.iterdir())
    except FileNotFoundError:  # another export renamed it aside meanwhile
        return False


def _put_back(old: Path, out: Path, failure: OSError) -> None:
    """The previous export, set aside in `old`, back at `out` after `failure`; where that fails too (another export's
    folder arrived there), say where it is kept."""
    try:
        os.replace(old, out)
    except OSError as exc:
        raise KvcalError(f"cannot write '{out}': {failure.strerror or failure}; the previous export there is kept at "
                         f"'{old}'") from exc
