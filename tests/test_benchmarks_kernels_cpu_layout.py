"""benchmarks/kernels/cpu_layout.py: the CPU decode kernel over one cache kept in both store layouts."""

import json

import pytest

from benchmarks import common
from benchmarks.kernels import cpu_layout
from helpers import refused


def test_each_cell_times_both_layouts_of_the_same_codes_and_finds_the_same_bits(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cpu_layout.main(["--variants", "int2-g128,nuq3-1%-pre-rope", "--lengths", "256", "--batch", "2", "--rounds", "2",
                     "--threads", "1", "--name", "layout"])
    rows = json.loads((tmp_path / "layout.json").read_text())["results"]
    assert [(r["variant"], r["tokens"], r["batch"]) for r in rows] == [("int2-g128", 256, 2), ("nuq3-1%-pre-rope", 256, 2)]
    assert all(r["same_bits"] and r["rows_ms"] > 0 and r["heads_ms"] > 0 for r in rows)
    assert "| int2-g128 | 256 |" in (tmp_path / "layout.md").read_text()


def test_the_two_stores_keep_the_same_codes_in_the_two_layouts():
    keys_rows, keys_heads = (pair[0] for pair in cpu_layout.stores(cpu_layout.variants(128)["int2-g128"][0], 1, 128, 0).values())
    assert keys_rows.words.is_contiguous() and not keys_heads.words.is_contiguous()
    assert keys_heads.words.transpose(1, 2).is_contiguous()  # storage (batch, KV heads, tokens, words)
    assert keys_rows.words.equal(keys_heads.words)


@pytest.mark.parametrize("arguments,problem", [
    (["--variants", "fp16"], "fp16 is not a packed variant"),
    (["--lengths", "4k"], "is not comma-separated token counts"),
    (["--rounds", "0"], "take positive numbers"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(cpu_layout.main, arguments, monkeypatch, capsys)
