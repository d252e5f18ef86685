"""kvcal.build_cache: outputs built once per key under $KVCAL_CACHE_DIR, renamed into place; a cache folder that
cannot be written is one line naming KVCAL_CACHE_DIR."""

import pytest

from kvcal.build_cache import cached
from kvcal.errors import KvcalError


def test_an_output_is_built_once_per_key_and_a_new_key_builds_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path / "cache"))
    builds = []

    def build(path):
        builds.append(path.name)
        path.write_text("built")

    first = cached("out.txt", ["a"], build)
    assert cached("out.txt", ["a"], build) == first and first.read_text() == "built" and len(builds) == 1
    assert cached("out.txt", ["b"], build) != first and len(builds) == 2
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(builds)  # (no temporary folder left)


@pytest.mark.parametrize("folder", ["a-file", "a" * 300])
def test_a_cache_folder_that_cannot_be_one_names_kvcal_cache_dir(tmp_path, monkeypatch, folder):
    """A file where the folder would be, and a name over the file system's 255 bytes."""
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path / folder))
    with pytest.raises(KvcalError, match=rf"cannot write kvcal's cache folder '.*{folder}' \(.*\); set KVCAL_CACHE_DIR "
                                         r"to a writable folder"):
        cached("out.txt", ["a"], lambda path: path.write_text("built"))


def test_what_the_build_raises_passes_through(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path))

    def failing(path):
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        cached("out.txt", ["a"], failing)
    assert list(tmp_path.iterdir()) == []
