"""benchmarks/bench_decode.py's timing rule, which its GPU measurements and bench_decode_tc.py's share (the timing itself
needs a CUDA GPU; the rule that retakes a disagreeing median does not)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode.py"
spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
bench_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_decode)


def test_a_median_taken_at_idle_clocks_is_retaken_until_two_agree():
    rounds = iter([5.1e-4, 1.24e-4, 1.23e-4, 9.9])  # the H100's 3-5x slow round, then the usual latency twice
    assert bench_decode.settled(lambda: next(rounds), 5) == 1.23e-4
    rounds = iter([1.0, 2.0, 4.0])  # nothing settles: the last of the rounds allowed
    assert bench_decode.settled(lambda: next(rounds), 3) == 4.0
