"""benchmarks/bench_decode_tc.py's, bench_layout_tc.py's and ab_decode_tc.py's arguments (their measurements need a CUDA GPU; these checks run before
they look)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts a script (torch imported)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode_tc.py"
RESULTS = SCRIPT.parent / "results"


@pytest.mark.parametrize("arguments,problem", [
    (["--splits", "100"], "positive multiples of 64"),
    (["--splits", "launcher,big"], "'launcher' or whole numbers"),
    (["--tokens", "0"], "a positive number of tokens"),
    (["--kernel-dir", "."], "no decode_attention_tc.cu there"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem):
    before = {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()}
    done = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr.splitlines()[-1]
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()} == before


LAYOUT = SCRIPT.parent / "bench_layout_tc.py"


@pytest.mark.parametrize("arguments,problem", [
    (["--only", "nuq4-pre-rope"], "a uniform-code variant"),
    (["--only", "fp16"], "a uniform-code variant"),
    (["--tokens", "-1"], "a positive number of tokens"),
])
def test_the_layout_probe_refuses_what_it_cannot_reshape_with_one_line(arguments, problem):
    done = subprocess.run([sys.executable, str(LAYOUT), *arguments], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr.splitlines()[-1]


AB = SCRIPT.parent / "ab_decode_tc.py"


@pytest.mark.parametrize("arguments,problem", [
    (["--baseline", "/nonexistent"], "not a kvcal checkout"),
    (["--baseline", str(SCRIPT.parents[1]) + "/"], "this checkout itself"),
    (["--rounds", "1"], "required: --baseline"),
    (["--baseline", "{other}", "--rounds", "0"], "positive numbers"),
])
def test_the_ab_script_refuses_what_it_cannot_compare_with_one_line(arguments, problem, tmp_path):
    for name in ("benchmarks/bench_decode_tc.py", "kernels/decode_attention_tc.cu"):  # another checkout's shape
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    arguments = [a.format(other=tmp_path) for a in arguments]
    done = subprocess.run([sys.executable, str(AB), *arguments], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr.splitlines()[-1]
