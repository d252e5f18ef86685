import json

import pytest
import torch
from safetensors.torch import save_file

from kvcal.artifacts import check_writable, read_artifact, read_header, write_artifact
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
    with pytest.raises(KvcalError, match="schema '99'"):
        read_header(future)
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
