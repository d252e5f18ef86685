"""Export folders are written atomically: an interrupted write leaves what was there and no temp folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcal.errors import KvcalError
from kvcal.export.folder import check_out_folder, write_folder_atomically


def temp_folders(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old")))


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_files(files: dict[str, str]):
    def write(folder: Path) -> None:
        for name, text in files.items():
            (folder / name).write_text(text)
    return write


def test_write_replaces_a_previous_folder_whole(tmp_path):
    out = tmp_path / "export"
    write_folder_atomically(out, write_files({"a.json": "1", "b.json": "2"}))
    write_folder_atomically(out, write_files({"a.json": "3"}))
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.json": "3"} and not temp_folders(tmp_path)


def test_two_exports_renaming_onto_one_folder_at_once_leave_the_last_whole(tmp_path, monkeypatch):
    """Another export's folder arrives between this one moving the previous folder aside and renaming its own in: this
    one tries again and wins (it renamed last), and no temp or set-aside folder is left."""
    out = tmp_path / "export"
    write_folder_atomically(out, write_files({"previous.json": "0"}))
    rename = os.replace
    raced = []

    def rename_with_another_export_between(source, target):
        rename(source, target)
        if str(target).endswith(".old") and not raced:
            raced.append(target)
            write_folder_atomically(out, write_files({"other.json": "1"}))

    monkeypatch.setattr(os, "replace", rename_with_another_export_between)
    write_folder_atomically(out, write_files({"ours.json": "2"}))
    assert raced and {p.name: p.read_text() for p in out.iterdir()} == {"ours.json": "2"}
    assert not temp_folders(tmp_path)


def test_an_export_whose_previous_folder_another_moved_aside_first_still_lands(tmp_path, monkeypatch):
    """Another export renames the previous folder aside just before this one does: this one's rename finds nothing to
    move, tries again and renames its folder in, leaving no temp or set-aside folder of its own."""
    out, elsewhere = tmp_path / "export", tmp_path / "elsewhere"
    write_folder_atomically(out, write_files({"previous.json": "0"}))
    rename = os.replace

    def another_export_first(source, target):
        if Path(source) == out and str(target).endswith(".old") and not elsewhere.exists():
            rename(out, elsewhere)
        rename(source, target)

    monkeypatch.setattr(os, "replace", another_export_first)
    write_folder_atomically(out, write_files({"ours.json": "2"}))
    assert elsewhere.exists() and {p.name: p.read_text() for p in out.iterdir()} == {"ours.json": "2"}
    assert not temp_folders(tmp_path)


def test_interrupted_write_leaves_the_previous_folder(tmp_path):
    out = tmp_path / "export"
    write_folder_atomically(out, write_files({"config.json": "{}"}))

    def fail(folder: Path) -> None:
        (folder / "config.json").write_text("{")
        raise OSError(28, "No space left on device")

    with pytest.raises(KvcalError, match="No space left"):
        write_folder_atomically(out, fail)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "{}"} and not temp_folders(tmp_path)


def test_written_files_get_the_umask_permissions(tmp_path):
    out = write_folder_atomically(tmp_path / "export", write_files({"a.json": "1"}))
    assert (out / "a.json").stat().st_mode & 0o777 == 0o666 & ~current_umask() and out.stat().st_mode & 0o777 == 0o777 & ~current_umask()


@pytest.mark.parametrize("setup, message", [
    (lambda out: out.write_text("x"), "is not a directory"),
    (lambda out: (out.mkdir(), (out / "keep.txt").write_text("x")), "is not a demo export"),
])
def test_check_out_folder_refuses_what_it_would_destroy(tmp_path, setup, message):
    out = tmp_path / "out"
    setup(out)
    with pytest.raises(KvcalError, match=message):
        check_out_folder(out, [], lambda folder: False, "demo export")


def test_check_out_folder_refuses_a_folder_holding_an_input(tmp_path):
    (tmp_path / "profile.safetensors").write_text("x")
    with pytest.raises(KvcalError, match="contains the input"):
        check_out_folder(tmp_path, [tmp_path / "profile.safetensors"], lambda folder: False, "demo export")
