"""benchmarks/kernels/cpu_latent.py: the CPU decode kernel on MLA's latent against the torch reference."""

import json

import pytest

from benchmarks import common
from benchmarks.kernels import cpu_latent
from helpers import refused


def test_each_cell_times_the_kernel_beside_the_reference_and_finds_them_equal(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cpu_latent.main(["--variants", "int2-g32,nuq3-1%-pre-rope", "--heads", "5", "--lengths", "256", "--batch", "2",
                     "--rounds", "2", "--threads", "1", "--name", "latent"])
    rows = json.loads((tmp_path / "latent.json").read_text())["results"]
    assert [(r["variant"], r["heads"], r["tokens"], r["batch"]) for r in rows] == [("int2-g32", 5, 256, 2),
                                                                                 ("nuq3-1%-pre-rope", 5, 256, 2)]
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 and r["max_abs_difference"] < 1e-4 for r in rows)
    assert "| int2-g32 | 5 | 256 |" in (tmp_path / "latent.md").read_text()


def test_the_stores_hold_the_rotated_key_and_the_latent_at_their_widths():
    (keys, latents), pre_rope = cpu_latent.stores("nuq3-1%-pre-rope", 1, 40, 0)
    assert (keys.read(0).shape, latents.read(0).shape, pre_rope) == ((40, 64), (40, 512), True)


@pytest.mark.parametrize("arguments,problem", [
    (["--variants", "fp16"], "fp16 is not a packed variant"),
    (["--heads", "16x"], "comma-separated whole numbers"),
    (["--rounds", "0"], "take positive numbers"),
    (["--lengths", "200"], "multiples of 128 tokens"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(cpu_latent.main, arguments, monkeypatch, capsys)
