import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from kvcal.artifacts import (check_writable, read_artifact, read_header, verify_artifact, write_artifact,
                             write_text_atomic)
from kvcal.errors import KvcalError


def test_round_trip_keeps_tensors_and_config(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([1, 2], dtype=torch.int32)}
    path = write_artifact(tmp_path / "sub" / "x.safetensors", tensors, "profile", {"seed": 3})
    loaded, config = read_artifact(path, "profile")
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])
    assert config["seed"] == 3 and "kvcal_version" in config
    assert [p.name for p in path.parent.iterdir()] == ["x.safetensors"]  # no temp file left


def test_same_input_gives_identical_bytes(tmp_path):
    tensors = {"a": torch.ones(4)}
    one = write_artifact(tmp_path / "1.safetensors", tensors, "profile", {"k": [1, 2]})
    two = write_artifact(tmp_path / "2.safetensors", tensors, "profile", {"k": [1, 2]})
    assert one.read_bytes() == two.read_bytes()


def test_refuses_foreign_wrong_schema_wrong_kind_and_truncated_files(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"a": torch.ones(2)}, str(plain))
    with pytest.raises(KvcalError, match="not a kvcal artifact"):
        read_header(plain)
    future = tmp_path / "future.safetensors"
    save_file({"a": torch.ones(2)}, str(future), metadata={"kvcal.kind": "profile", "kvcal.schema": "99", "kvcal.config": json.dumps({})})
    with pytest.raises(KvcalError, match="schema '99', written by a newer kvcal"):
        read_header(future)
    odd = tmp_path / "odd.safetensors"  # (a digit int() does not read)
    save_file({"a": torch.ones(2)}, str(odd), metadata={"kvcal.kind": "profile", "kvcal.schema": "\u00b2", "kvcal.config": "{}"})
    with pytest.raises(KvcalError, match="this kvcal reads schemas 2 and 3; re-create it"):
        read_header(odd)
    good = write_artifact(tmp_path / "good.safetensors", {"a": torch.ones(1000)}, "profile", {})
    with pytest.raises(KvcalError, match="expected a bundle"):
        read_artifact(good, "bundle")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(KvcalError, match="truncated"):
        read_artifact(truncated)
    with pytest.raises(KvcalError, match="does not exist"):
        read_header(tmp_path / "missing.safetensors")


def test_unwritable_destinations_fail_before_work(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(KvcalError, match="not a writable folder"):
        check_writable(blocker / "out.safetensors")
    with pytest.raises(KvcalError, match="is a directory"):
        check_writable(tmp_path)


def test_an_existing_out_that_is_not_a_regular_file_is_refused(tmp_path):
    """Misuse 1: the temp file is renamed over the destination, which would turn a device or fifo into a file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(KvcalError, match="--out '.*fifo' exists and is a fifo, not a regular file"):
        check_writable(fifo)
    with pytest.raises(KvcalError, match="--json '/dev/full' exists and is a character device"):
        check_writable("/dev/full", "--json")  # only stat'ed: check_writable never writes
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(KvcalError, match="is a fifo"):
        check_writable(link)
    with pytest.raises(KvcalError, match="a fifo"):
        write_text_atomic(fifo, "{}")
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    (tmp_path / "regular").write_text("old")
    assert check_writable(tmp_path / "regular") == tmp_path / "regular"  # a regular file may be replaced


def test_an_out_that_is_an_input_is_refused_by_name_link_or_hard_link(tmp_path):
    """Misuse 6."""
    source = write_artifact(tmp_path / "p.safetensors", {"a": torch.ones(2)}, "profile", {})
    (tmp_path / "soft").symlink_to(source)
    os.link(source, tmp_path / "hard")
    for out in (source, tmp_path / "soft", tmp_path / "hard", tmp_path / "." / "p.safetensors"):
        with pytest.raises(KvcalError, match="--out .* is also an input .*choose another --out"):
            check_writable(out, inputs=[None, "builtin", source])
    assert check_writable(tmp_path / "q.safetensors", inputs=[source])



def test_an_out_that_is_a_file_of_an_input_folder_is_refused(tmp_path):
    """An export folder or model folder given as an input: an output replacing one of its files would change it
    (writing `config.json` into a vLLM export); a new file beside them is allowed."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(KvcalError, match="--json .* is a file of the input folder .*choose another --json"):
        check_writable(folder / "config.json", "--json", inputs=[folder])
    assert check_writable(folder / "results.json", "--json", inputs=[folder]) == folder / "results.json"

def test_read_header_names_a_directory_and_a_fifo(tmp_path):
    with pytest.raises(KvcalError, match="is a directory, not a kvcal artifact"):
        read_header(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(KvcalError, match="is a fifo, not a kvcal artifact"):  # never opened: reading a fifo would block
        read_header(tmp_path / "fifo")


def test_every_artifact_is_checksummed_over_metadata_and_tensors(tmp_path):
    """Schema 2: kvcal.config and the tensors of every kind are under the checksum."""
    from helpers.artifact_files import rewrite

    path = write_artifact(tmp_path / "p.safetensors", {"a": torch.arange(4.0)}, "profile", {"seed": 1})
    assert read_artifact(path)[1]["seed"] == 1
    cases = {"config": dict(config_fn=lambda c: {**c, "seed": 2}),
             "tensor": dict(tensors_fn=lambda t: {"a": t["a"] + 1}),
             "metadata": dict(metadata_fn=lambda m: {**m, "kvcal.version": "0"})}
    for name, edit in cases.items():
        edited = rewrite(path, tmp_path / f"{name}.safetensors", reseal=False, **edit)
        with pytest.raises(KvcalError, match="fails its checksum: the file is corrupt or was edited; re-create it"):
            read_artifact(edited)
    old = rewrite(path, tmp_path / "old.safetensors", metadata_fn=lambda m: {**m, "kvcal.schema": "1"})
    with pytest.raises(KvcalError, match="kvcal profile of schema 1, written by an older kvcal .* reads schemas 2 and 3: re-create it"):
        read_header(old)
    not_object = rewrite(path, tmp_path / "list.safetensors", metadata_fn=lambda m: {**m, "kvcal.config": "[1, 2]"})
    with pytest.raises(KvcalError, match="not a JSON object"):
        read_header(not_object)


def test_verify_artifact_streams_the_same_checksum_and_refuses_the_same_edits(tmp_path):
    """verify_artifact (one tensor held at a time) accepts what read_artifact accepts and refuses each edit it refuses,
    with the same line."""
    from helpers.artifact_files import rewrite

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.int8)}
    path = write_artifact(tmp_path / "p.safetensors", tensors, "profile", {"seed": 1})
    verify_artifact(path)
    for name, edit in {"config": dict(config_fn=lambda c: {**c, "seed": 2}),
                       "tensor": dict(tensors_fn=lambda t: {**t, "a": t["a"] + 1}),
                       "renamed": dict(tensors_fn=lambda t: {"c": t["a"], "b": t["b"]})}.items():
        edited = rewrite(path, tmp_path / f"{name}.safetensors", reseal=False, **edit)
        with pytest.raises(KvcalError) as streamed:
            verify_artifact(edited)
        with pytest.raises(KvcalError) as whole:
            read_artifact(edited)
        assert str(streamed.value) == str(whole.value) and "fails its checksum" in str(streamed.value)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(KvcalError, match="is truncated"):
        verify_artifact(truncated)


def test_an_artifact_replaced_while_it_is_read_is_read_whole_as_opened(tmp_path, monkeypatch):
    """Another process's calibrate renaming a new bundle over the one a server reads: the reader gets the old file,
    metadata and tensors alike, not a checksum failure from mixing the two."""
    import kvcal.artifacts

    path = write_artifact(tmp_path / "b.safetensors", {"a": torch.zeros(3)}, "bundle", {"seed": 1})
    newer = write_artifact(tmp_path / "new.safetensors", {"a": torch.ones(5)}, "bundle", {"seed": 2})
    opened = kvcal.artifacts.safe_open

    def open_then_replace(*args, **kwargs):
        handle = opened(*args, **kwargs)
        if newer.exists():  # the first open only
            os.replace(newer, path)
        return handle

    monkeypatch.setattr(kvcal.artifacts, "safe_open", open_then_replace)
    tensors, config = read_artifact(path, "bundle")
    assert torch.equal(tensors["a"], torch.zeros(3)) and config["seed"] == 1
    assert read_artifact(path, "bundle")[1]["seed"] == 2


def test_an_output_that_is_a_link_is_written_through(tmp_path):
    """The file the link names is replaced, the link kept (a `latest` link stays one); a link to a fifo is refused."""
    real = write_artifact(tmp_path / "real.safetensors", {"a": torch.zeros(2)}, "profile", {"seed": 1})
    (tmp_path / "latest.safetensors").symlink_to(real)
    write_artifact(tmp_path / "latest.safetensors", {"a": torch.ones(2)}, "profile", {"seed": 2})
    assert (tmp_path / "latest.safetensors").is_symlink() and read_artifact(real)[1]["seed"] == 2
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo.safetensors").symlink_to(tmp_path / "fifo")
    with pytest.raises(KvcalError, match="exists and is a fifo"):
        check_writable(tmp_path / "to-fifo.safetensors")


def test_a_full_disk_while_writing_an_artifact_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """safetensors reports its writes' I/O errors as its own SafetensorError, not OSError: the line that says so
    (what it raises on a full disk), and no temp file left."""
    from safetensors import SafetensorError

    import kvcal.artifacts

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(kvcal.artifacts, "save_file", full_disk)
    with pytest.raises(KvcalError, match=r"cannot write '.*a.safetensors': .*No space left on device.*; choose another "
                                         r"--out or free space"):
        write_artifact(tmp_path / "a.safetensors", {"a": torch.ones(2)}, "profile", {})
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_json_names_json(tmp_path):
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(KvcalError, match="choose another --json"):
        write_text_atomic(tmp_path / "blocker" / "r.json", "{}")
