"""benchmarks.kernels: the harness's modes, the timing rule its GPU measurements share (the timing itself needs a CUDA
GPU; the rule that retakes a disagreeing median does not), and the arguments the GPU modes refuse before they look."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kernels import ab, cpu_memory, cpu_step, gpu_timing, tensor_core
from helpers import refused
from kvcal.bundle import load_bundle

REPO = Path(__file__).resolve().parents[1]


def test_a_median_taken_at_idle_clocks_is_retaken_until_two_agree():
    rounds = iter([5.1e-4, 1.24e-4, 1.23e-4, 9.9])  # the H100's 3-5x slow round, then the usual latency twice
    assert gpu_timing.settled(lambda: next(rounds), 5) == 1.23e-4
    rounds = iter([1.0, 2.0, 4.0])  # nothing settles: the last of the rounds allowed
    assert gpu_timing.settled(lambda: next(rounds), 3) == 4.0


@pytest.mark.parametrize("arguments,problem", [
    (["--splits", "100"], "positive multiples of 64"),
    (["--splits", "launcher,big"], "'launcher' or whole numbers"),
    (["--tokens", "0"], "a positive number of tokens"),
    (["--kv-heads", "0"], "a positive number of KV heads"),
    (["--kernel-dir", "."], "no decode_attention_tc.cu there"),
    (["--layout", "heads", "--kv-heads", "1"], "a row of one KV head is that head's piece already"),
])
def test_the_tensor_core_mode_refuses_bad_arguments_with_one_line_and_writes_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(tensor_core.main, arguments, monkeypatch, capsys)


@pytest.mark.parametrize("name", ("int2-g128", "nuq3-1%-pre-rope", "skvq2-pre-rope"))
def test_laid_out_with_each_kv_heads_rows_together_the_stores_hold_the_same_codes(name):
    """--layout heads times the same work in the other layout: the same seed gives stores of the same decoded rows,
    each KV head's rows together."""
    codecs, _ = tensor_core.variants(64, kv_heads=2)[name]
    rows, heads = (tensor_core.filled_stores(codecs, 2, 256, 64, seed=3, device="cpu", kv_heads=2, rows_together=together)
                   for together in (True, False))
    assert rows[0].rows_together and not heads[0].rows_together and heads[0].pieces == 2
    for whole, apart in zip(rows, heads):
        assert torch.equal(whole.words, apart.words) and not apart.words.is_contiguous()
        assert torch.equal(whole.decoded(256), apart.decoded(256))


def test_the_tensor_core_mode_at_head_dim_256_skips_pre_rope_uniform_keys():
    from kvcal.errors import KvcalError
    from kvcal.runtime.tensor_core import variant_for_codecs

    served, skipped = [], []
    for name, (codecs, rope) in tensor_core.variants(256).items():
        if codecs is None:
            continue
        try:
            variant_for_codecs(*codecs, 256, gpu_timing.HEADS // gpu_timing.KV_HEADS, rope=rope)
            served.append(name)
        except KvcalError:
            skipped.append(name)
    assert skipped == ["int4-g128-pre-rope", "int2-g128-pre-rope"]
    assert "nuq3-1%-pre-rope" in served and {"int2k-int4v-g32", "int3k-int4v-g32"} <= set(served)  # Gemma 3's default; KVmix's
    assert "nuq2-1%-pre-rope" in served  # mixed's commonest layer
    assert "skvq2-pre-rope" in served  # SKVQ's groups, rotated as they are dequantized


@pytest.mark.parametrize("arguments,problem", [
    (["--baseline", "/nonexistent"], "not a kvcal checkout"),
    (["--baseline", str(REPO) + "/"], "this checkout itself"),
    (["--rounds", "1"], "required: --baseline"),
    (["--baseline", "{other}", "--rounds", "0"], "positive numbers"),
    (["--baseline", "{other}", "--baseline", "{other}/../{name}"], "a second baseline named"),
])
def test_the_ab_mode_refuses_what_it_cannot_compare_with_one_line(arguments, problem, tmp_path, monkeypatch, capsys):
    for name in ("benchmarks/kernels/tensor_core.py", "kernels/decode_attention_tc.cu"):  # another checkout's shape
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    arguments = [a.format(other=tmp_path, name=tmp_path.name) for a in arguments]
    assert problem in refused(ab.main, arguments, monkeypatch, capsys)


@pytest.mark.parametrize("arguments,problem", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--new-tokens", "2"], "at least 3"),
    (["--baselines", "quanto,gguf"], "unknown baseline(s) gguf"),
    (["--recipes", "foo"], "unknown recipe 'foo'"),
])
def test_the_cpu_mode_refuses_bad_arguments_with_one_line(arguments, problem, monkeypatch, capsys):
    assert problem in refused(cpu_step.parse_args, arguments, monkeypatch, capsys)


def test_the_cpu_mode_times_a_cache_by_the_median_step_of_all_its_runs():
    """A slow spell in one run (a shared machine's) moves the median of the pooled steps little, where the mean of
    the runs followed it."""
    quiet, slow = {"steps_ms": [10.0, 11.0, 10.5], "load_s": 0.1, "peak_rss_mib": 5.0, "cache_mib": 1.0,
                   "tokens_equal_dynamic": 1.0}, {"steps_ms": [40.0, 42.0, 10.8], "load_s": 0.3, "peak_rss_mib": 7.0}
    row = cpu_step.summarize("DynamicCache", [quiet, {**quiet, **slow}, quiet])
    assert row["ms_per_token"] == 10.8 and row["timed_steps"] == 9 and row["ms_steps_min"] == 10.0
    assert row["peak_rss_mib"] == 7.0 and row["load_s"] == 0.1 and row["dynamic_runs_ms"] == [10.5, 40.0, 10.5]
    assert "dynamic_runs_ms" not in cpu_step.summarize("kvcal kivi", [quiet])



@pytest.mark.parametrize("arguments,problem", [
    (["--new-tokens", "2"], "at least 3"),
    (["--length", "1"], "--length must be at least 2"),
    (["--baselines", "gguf"], "unknown baseline(s) gguf"),
    (["--recipes", "kivi,foo"], "unknown recipe 'foo'"),
])
def test_the_cpu_memory_mode_refuses_bad_arguments_with_one_line(arguments, problem, monkeypatch, capsys):
    assert problem in refused(cpu_memory.parse_args, arguments, monkeypatch, capsys)


@pytest.mark.slow  # loads the packaged SmolLM2, once in a spawned process
def test_the_cpu_memory_mode_measures_a_cache_in_a_fresh_process_and_tables_each_against_dynamiccache(tmp_path):
    from benchmarks.common import kivi2_bundle
    from kvcal.models import load_model

    settings = {"length": 40, "batch": 2, "new_tokens": 3, "threads": 1, "text": str(tmp_path / "none.txt")}
    dynamic = cpu_memory.in_fresh_process("DynamicCache", None, settings)
    kivi = cpu_memory.run_cache("kvcal kivi2", kivi2_bundle(load_model(None)[0]), settings)
    for run in (dynamic, kivi):
        assert run["prefill_s"] > 0 and run["ms_per_token"] > 0 and run["peak_rss_mib"] > 0
        assert len(run["tokens"]) == 2 and all(len(tokens) == 3 for tokens in run["tokens"])
    assert dynamic["cache_mib"] > kivi["cache_mib"] > 0
    rows = cpu_memory.summarize([dynamic, kivi, {**dynamic, "ms_per_token": 3 * dynamic["ms_per_token"]}])
    assert [r["cache"] for r in rows] == ["DynamicCache", "kvcal kivi2"]
    assert rows[0]["ms_per_token"] == 2 * dynamic["ms_per_token"] and rows[0]["tokens_equal_dynamic"] == 1.0
    assert rows[1]["ratio_to_dynamic"] == kivi["ms_per_token"] / rows[0]["ms_per_token"]
    lines = cpu_memory.table(rows, settings, {}, {"cpu": "a CPU", "kernel": "a build", "commit": "abc", "date": "today"})
    assert lines[0].startswith("# Memory of generate() on CPU: 2 x 40 tokens") and lines[-1].startswith("| kvcal kivi2 |")

def test_the_ab_mode_runs_a_baseline_tree_of_either_layout(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_decode_tc.py").write_text("")  # before benchmarks/ became a package
    assert ab.benchmark_command(tmp_path) == ["benchmarks/bench_decode_tc.py"]
    assert ab.benchmark_command(REPO) == ["-m", "benchmarks.kernels", "gpu"]


@pytest.mark.slow  # starts Python
def test_the_harness_lists_its_modes_and_refuses_an_unknown_one():
    listing = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--help"], cwd=REPO, capture_output=True, text=True)
    assert listing.returncode == 0 and all(mode in listing.stdout for mode in ("cpu", "gpu", "runtime", "ab", "ncu"))
    unknown = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "cpus"], cwd=REPO, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown mode 'cpus'" in unknown.stderr.strip().splitlines()[-1]


def test_the_cpu_append_mode_times_both_encoders_for_every_recipe_side_the_compiled_appends_serve(recipe_bundles, tmp_path,
                                                                                                 monkeypatch):
    from benchmarks import common
    from benchmarks.kernels import cpu_append

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cpu_append.main(["--bundles", str(recipe_bundles["kivi"].parent), "--batch", "2", "--appends", "1", "--rounds", "1",
                     "--name", "append"])
    rows = json.loads((tmp_path / "append.json").read_text())["rows"]
    assert {(r["recipe"], r["side"]) for r in rows} == {(recipe, side) for recipe in ("kvquant", "mixed", "skvq", "kivi", "kvmix")
                                                        for side in "KV"}
    kivi_keys = next(r for r in rows if (r["recipe"], r["side"]) == ("kivi", "K"))
    assert kivi_keys["codec"].startswith("int") and "per channel" in kivi_keys["codec"] and kivi_keys["rows"] > 1  # a block
    assert all(r["torch codec"] > 0 and r["cpu-append"] > 0 for r in rows)
    assert "| kivi | K |" in (tmp_path / "append.md").read_text()
    with pytest.raises(SystemExit):
        cpu_append.parse_args(["--rounds", "0"])


def test_the_cpu_append_mode_appends_a_prompt_in_whole_key_blocks(recipe_bundles, tmp_path, monkeypatch):
    from benchmarks import common
    from benchmarks.kernels import cpu_append

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cpu_append.main(["--bundles", str(recipe_bundles["kivi"].parent), "--recipes", "kivi,kvquant", "--tokens", "100",
                     "--batch", "1", "--appends", "1", "--rounds", "1", "--name", "prefill"])
    rows = {(r["recipe"], r["side"]): r["rows"] for r in json.loads((tmp_path / "prefill.json").read_text())["rows"]}
    block = load_bundle(recipe_bundles["kivi"]).layer_codecs(0).key_codec.block_tokens
    assert rows == {("kivi", "K"): 100 // block * block, ("kivi", "V"): 100, ("kvquant", "K"): 100, ("kvquant", "V"): 100}
    assert "100 tokens per sequence" in (tmp_path / "prefill.md").read_text()
    with pytest.raises(SystemExit):
        cpu_append.parse_args(["--tokens", "0"])


def test_the_plan_mode_tables_what_serves_each_recipe_on_cuda_and_cpu(recipe_bundles, tmp_path, monkeypatch, capsys):
    from benchmarks import common
    from benchmarks.kernels import plan

    assert plan._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["plan", "--bundles", str(recipe_bundles["kivi"].parent), "--name", "plan"])
    plan.main()
    table = (tmp_path / "plan.md").read_text()
    assert "| kivi | cpu-kernel | cpu-kernel | cpu-append | cpu-append |" in table  # KIVI's key blocks too
    # the tiny Llama's head_dim 16: no CUDA decode kernel reads it (the append kernels take any head_dim)
    assert "| skvq | reference | reference | cuda-append | cuda-append |" in table
    assert "- kvquant, layers 0-1: not cuda-kernels: they read head_dim 64, 128, 256, not 16" in table
