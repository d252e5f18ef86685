"""benchmarks/gpu_campaign.py: its dry run on CPU (every stage's stand-in, then the summary), the time limits that keep a
campaign inside a lease, the summary it prints from the stages' results, and its refusals; and the end-to-end script
benchmarks/end_to_end/gpu.py it runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from benchmarks import gpu_campaign as campaign
from benchmarks.end_to_end import gpu as generate

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_on_cpu_and_prints_the_summary_last(tmp_path):
    out = tmp_path / "campaign"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_campaign", str(out), "--dry-run", "--baseline-tree", str(REPO),
                           "--generate-recipes", "kivi", "--seed", "7"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "campaign.json").read_text())
    assert [s["name"] for s in record["stages"]] == ["environment", "layout", "kernels", "kernels-heads", "kernels-d256",
                                                     "kernels-d256-kv1", "suite", "generate", "ab", "ncu", "short-steps",
                                                     "mla", "mla-sparse"]
    assert all(s["status"] == "ok" for s in record["stages"]) and record["seed"] == 7
    environment = (out / "logs" / "environment.log").read_text().splitlines()
    assert environment[-1].startswith(f"transformers {transformers.__version__} is in kvcal's range")
    # (the stand-ins time no kernel: auto keeps kvcal's CUDA stores' default layout)
    assert record["stages"][7]["note"] == "kvcal's CUDA stores: rows (no kernels-heads timing beside the kernels stage's)"
    assert (out / "logs" / "suite.xml").is_file() and "deselected" in (out / "logs" / "suite.log").read_text()
    generated = json.loads(next((out / "results").glob("generate_*.json")).read_text())
    caches = {r["cache"] for r in generated["results"]}
    assert caches == {"StaticCache", "DynamicCache", "kvcal kivi"}
    assert {(r["length"], r["batch"]) for r in generated["results"]} == {(64, 1), (64, 2), (128, 1), (128, 2)}
    assert sorted(generated["torch_profiles"]) == [f"{cache}, L=64, B=1" for cache in ("DynamicCache", "StaticCache", "kvcal kivi")]
    assert [(r["cache"], r["length"], len(r["tries"])) for r in generated["largest"]] == [("StaticCache", 128, 2), ("kvcal kivi", 128, 2)]
    short = json.loads(next((out / "results").glob("short_steps_*.json")).read_text())
    assert [(r["context"], r["step"], r["runtime"]) for r in short["results"]] == [(64, 4, "kernel"), (64, 16, "kernel")]
    latent = json.loads(next((out / "results").glob("mla_generate_*.json")).read_text())
    assert [r["cache"] for r in latent["results"]] == ["DynamicCache", "kvcal kivi", "kvcal kvquant"]
    sparse = json.loads(next((out / "results").glob("mla_sparse_generate_*.json")).read_text())
    assert [r["cache"] for r in sparse["results"]] == ["DynamicCache", "kvcal kivi", "kvcal kivi, indexer fp8"]
    summary = (out / "summary.md").read_text()
    assert done.stdout.rstrip().endswith(summary.rstrip())
    assert "| generate | ok |" in summary and "| kvcal kivi |" in summary and "The largest batch at L=128, tried:" in summary
    assert "A step of several tokens on" in summary and "| kvcal kivi2-g32 | 64 | 16 |" in summary


@pytest.fixture
def sigint_ignored():
    """SIGINT ignored in this process, as a campaign started as a background job of a shell without job control (nohup
    ... &) has it: the stages' processes would inherit it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stage_past_its_limit_is_interrupted_then_killed_and_one_the_budget_cannot_hold_is_skipped(tmp_path, monkeypatch,
                                                                                                    sigint_ignored):
    monkeypatch.setattr(campaign, "GRACE_S", 3)  # the same sequence as with the real grace, in less time
    (tmp_path / "logs").mkdir()
    run = campaign.Campaign(tmp_path, budget_s=60, dry_run=False)
    # interrupted: it writes what it has (as pytest writes its summary) and ends
    summarising = campaign.Stage("summarising", [sys.executable, "-c", "import time\nprint('started', flush=True)\ntry:\n"
                                 "    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('summary')"], limit_s=2, least_s=1)
    began = time.monotonic()
    run.run(summarising, dict(os.environ))
    assert summarising.status == "stopped at 2 s" and time.monotonic() - began < 2 + campaign.GRACE_S
    assert (tmp_path / "logs" / "summarising.log").read_text() == "started\nsummary\n"
    # deaf to the interrupt: killed GRACE_S later
    deaf = campaign.Stage("deaf", [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                          "print('started', flush=True)\ntime.sleep(60)"], limit_s=2, least_s=1)
    began = time.monotonic()
    run.run(deaf, dict(os.environ))
    assert deaf.status == "stopped at 2 s" and 2 + campaign.GRACE_S <= time.monotonic() - began < 2 + campaign.GRACE_S + 5
    assert (tmp_path / "logs" / "deaf.log").read_text() == "started\n"
    greedy = campaign.Stage("greedy", [sys.executable, "-c", "print('ran')"], limit_s=60, least_s=60)
    run.run(greedy, dict(os.environ))
    assert greedy.status == "skipped" and not (tmp_path / "logs" / "greedy.log").exists()
    failing = campaign.Stage("failing", [sys.executable, "-c", "raise SystemExit(3)"], limit_s=20, least_s=1)
    run.run(failing, dict(os.environ))
    assert failing.status == "exit 3"


def test_the_summary_flags_a_kernel_past_the_tolerance_or_with_other_bits_twice_beside_its_prediction_and_counts_the_suite(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "logs").mkdir()
    row = {"variant": "int2-g128", "plan": "launcher", "batch": 8, "tokens": 32768, "latency_us": 110.5,
           "fraction_of_copy_bandwidth": 0.46, "speedup_vs_sdpa_fp16": 3.31, "max_abs_error_vs_sdpa_fp32": 1.2e-4}
    (tmp_path / "results" / "decode_tc_gpu.json").write_text(json.dumps({
        "device": "GPU", "commit": "abc", "copy_bandwidth_gbps": 3009.0, "head_dim": 128, "kv_heads": 8,
        "results": [{**row, "predicted_us": {"token": 99.45, "line": 104.0}, "same_bits_twice": True},
                    {**row, "variant": "nuq3-1%-pre-rope", "max_abs_error_vs_sdpa_fp32": float("inf")},
                    {**row, "variant": "nuq4-1%-pre-rope", "same_bits_twice": False}]}))
    for name, kv_heads, latency in (("d256", 8, 190.0), ("d256_kv1", 1, 30.0)):
        (tmp_path / "results" / f"decode_tc_gpu_{name}.json").write_text(json.dumps({
            "device": "GPU", "commit": "abc", "copy_bandwidth_gbps": 3009.0, "head_dim": 256, "kv_heads": kv_heads,
            "results": [{**row, "variant": "int2-g32", "latency_us": latency}]}))
    (tmp_path / "results" / "decode_tc_gpu_heads.json").write_text(json.dumps({
        "device": "GPU", "commit": "abc", "copy_bandwidth_gbps": 3009.0, "head_dim": 128, "kv_heads": 8, "layout": "heads",
        "results": [{**row, "latency_us": 80.0, "fraction_of_copy_bandwidth": 0.64, "predicted_us": {"token": 99.45, "line": 52.0}}]}))
    (tmp_path / "logs" / "suite.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_x" name="test_a"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_x" name="test_b"/><testcase classname="tests.test_x" name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>")
    (tmp_path / "logs" / "ab.log").write_text("round 1 this tree: int2-g128 99.00 us\n\nbaselines: a = /t/a, b = /t/b\n\n"
                                              "| variant | this tree us | a us | b us | this / a | this / b |\n"
                                              "| int2-g128 | 99.00 | 110.00 | 100.00 | 0.900 | 0.990 |\n")
    stages = [campaign.Stage("kernels", [], 1, 1, status="ok", seconds=12.0)]
    text = "\n".join(campaign.summary(tmp_path, stages))
    # beside the bound's predictions, its constant paid per token and per line
    assert "| int2-g128 | 110.5 | 99.45 (-10%) / 104.0 (-6%) | 46% | 3.31x | 1.2e-04 | yes | ok |" in text
    assert "interleaved):\nbaselines: a = /t/a, b = /t/b\n\n| variant | this tree us | a us | b us |" in text
    assert "round 1" not in text
    assert "| nuq3-1%-pre-rope | 110.5 | - | 46% | 3.31x | inf | - | FAIL |" in text  # (a result without the second launch)
    assert "| nuq4-1%-pre-rope | 110.5 | - | 46% | 3.31x | 1.2e-04 | NO | FAIL |" in text
    assert (text.index("head_dim 128, 8 KV heads") < text.index("head_dim 256, 8 KV heads") < text.index("| int2-g32 | 190.0 |")
            < text.index("head_dim 256, 1 KV head\n") < text.index("| int2-g32 | 30.0 |")
            < text.index("B=8, L=32768, head_dim 128, 8 KV heads, each KV head's rows together\n") < text.index("| int2-g128 | 80.0 |"))
    assert "GPU suite: 1 passed, 1 failed, 0 errors, 1 skipped; failed: tests.test_x::test_a" in text
    # the variants both layouts timed, side by side, beside the ratio the per-line reading predicts
    assert "head_dim 128):\n\n| variant | rows whole us |" in text and "| int2-g128 | 110.5 | 46% | 80.0 | 64% | 0.72x | 0.50x |" in text


@pytest.mark.parametrize("together_us,chosen", [((60.0, 130.0), "heads"), ((90.0, 130.0), "rows"), (None, "rows")],
                         ids=("heads-faster", "heads-slower", "no-heads-run"))
def test_auto_gives_the_generate_stage_the_layout_the_kernels_stages_timed_faster(tmp_path, together_us, chosen):
    """--generate-cuda-layout auto: each KV head's rows together where the kernels-heads stage timed the variants it
    shares with the kernels stage faster (their latency ratios' geometric mean under 1), else rows whole, and the
    stage's note says which and why."""
    row = {"plan": "launcher", "latency_us": 100.0}
    whole = [{**row, "variant": "int2-g128"}, {**row, "variant": "nuq3-1%-pre-rope"}, {**row, "variant": "fp16"}]
    (tmp_path / "decode_tc_gpu.json").write_text(json.dumps({"results": whole}))
    if together_us:
        together = [{**row, "variant": v, "latency_us": us} for v, us in zip(("int2-g128", "nuq3-1%-pre-rope"), together_us)]
        (tmp_path / "decode_tc_gpu_heads.json").write_text(json.dumps({"results": together}))
    args = campaign.parse_args([str(tmp_path / "out"), "--seed", "1"])
    assert args.generate_cuda_layout == "auto"
    stage = next(s for s in campaign.stages(args) if s.name == "generate")
    campaign.choose_generate_layout(stage, tmp_path)
    for command in (stage.command, stage.dry_command):
        assert command[command.index("--cuda-layout") + 1] == chosen
    assert stage.note.startswith(f"kvcal's CUDA stores: {chosen} (")
    if together_us:
        mean = (together_us[0] * together_us[1]) ** 0.5 / 100.0
        assert f"heads together / rows whole {mean:.2f}x over 2 variants" in stage.note


def test_the_summary_tables_each_layouts_reads_per_piece_size_and_fails_a_row_that_read_other_bytes(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "layout_read_gpu.json").write_text(json.dumps({
        "device": "GPU", "heads": 8, "tokens": 65536, "block_tokens": 64, "copy_bandwidth_gbps": 4235.0, "results": [
            {"piece_bytes": 32, "layout": "tokens", "latency_us": 60.0, "fraction_of_copy_bandwidth": 0.52, "checked": True},
            {"piece_bytes": 32, "layout": "blocks", "latency_us": 41.0, "fraction_of_copy_bandwidth": 0.76, "checked": True},
            {"piece_bytes": 32, "layout": "heads", "latency_us": 40.0, "fraction_of_copy_bandwidth": 0.78, "checked": True},
            {"piece_bytes": 256, "layout": "tokens", "latency_us": 250.0, "fraction_of_copy_bandwidth": 1.01, "checked": False},
            {"piece_bytes": 256, "layout": "blocks", "latency_us": 250.0, "fraction_of_copy_bandwidth": 1.01, "checked": True},
            {"piece_bytes": 256, "layout": "heads", "latency_us": 250.0, "fraction_of_copy_bandwidth": 1.01, "checked": True}]}))
    text = "\n".join(campaign.summary(tmp_path, [campaign.Stage("layout", [], 1, 1, status="ok", seconds=20.0)]))
    assert "| paged (64-token blocks) |" in text
    assert "| 32 | 52% | 76% | 78% | 1.50x | ok |\n| 256 | 101% | 101% | 101% | 1.00x | FAIL |" in text


def test_the_summary_names_the_l2_s_busiest_parts_beside_its_throughput_or_a_dash_where_ncu_gave_none(tmp_path):
    (tmp_path / "results").mkdir()
    row = {"variant": "int2-g128", "duration_us": 92.61, "issue_pct": 46.5, "dram_pct": 34.5, "l2_pct": 59.6, "tensor_pct": 34.4,
           "shared_wavefronts": 6917198, "stall_samples_pct": {"wait": 21.9}, "l2_parts_pct": {"lts__t_tag_requests": 59.6},
           "l2_sectors_per_read_request": 1.1}
    (tmp_path / "results" / "profile_decode_tc_gpu.json").write_text(json.dumps({"device": "GPU", "results": [
        row, {**row, "variant": "nuq3-1%-pre-rope", "l2_parts_pct": {}, "l2_sectors_per_read_request": None}]}))
    text = "\n".join(campaign.summary(tmp_path, [campaign.Stage("ncu", [], 1, 1, status="ok", seconds=90.0)]))
    assert "| int2-g128 | 92.61 | 46.5% | 34.5% | 59.6% (lts__t_tag_requests 59.6%) | 1.1 | 34.4% | 6.9M | wait 21.9% |" in text
    assert "| nuq3-1%-pre-rope | 92.61 | 46.5% | 34.5% | 59.6% (-) | - | 34.4% |" in text


@pytest.mark.parametrize("arguments,problem", [
    (["{nonempty}"], "exists and is not an empty folder"),
    (["{new}", "--baseline-tree", "{new}"], "no kernels/decode_attention_tc.cu there"),
    (["{new}", "--baseline-tree", "{tree}", "--baseline-tree", "{tree}/../tree"], "two trees in folders of one name"),
    (["{new}", "--only", "kernels,lunch"], "stages are"),
    (["{new}", "--budget-s", "0"], "a positive number of seconds"),
    (["{new}", "--generate-largest", "-1"], "0 or more tries"),
])
def test_the_campaign_refuses_bad_arguments_with_one_line_and_writes_nothing(arguments, problem, tmp_path, capsys):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "kept.txt").write_text("mine")
    (tmp_path / "tree" / "kernels").mkdir(parents=True)
    (tmp_path / "tree" / "kernels" / "decode_attention_tc.cu").write_text("")
    arguments = [a.format(nonempty=tmp_path / "nonempty", new=tmp_path / "new", tree=tmp_path / "tree") for a in arguments]
    with pytest.raises(SystemExit) as exit_:
        campaign.main(arguments)
    assert exit_.value.code == 2 and problem in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "nonempty") == ["kept.txt"]


def test_the_ab_stage_times_every_baseline_tree_in_one_run_with_time_for_each_trees_variants(tmp_path):
    trees = []
    for name in ("before-private", "before-tokens-in-m"):
        (tmp_path / name / "kernels").mkdir(parents=True)
        (tmp_path / name / "kernels" / "decode_attention_tc.cu").write_text("")
        trees += ["--baseline-tree", str(tmp_path / name)]
    args = campaign.parse_args([str(tmp_path / "out"), *trees, "--only", "ab"])
    (stage,) = campaign.stages(args)
    baselines = [stage.command[i + 1] for i, word in enumerate(stage.command) if word == "--baseline"]
    assert baselines == [str(tmp_path / "before-private"), str(tmp_path / "before-tokens-in-m")] and stage.limit_s == 90 + 2 * 4 * 20
    assert campaign.stages(campaign.parse_args([str(tmp_path / "out2"), "--only", "ab"])) == []  # no tree, no A/B


@pytest.mark.parametrize("arguments,problem", [
    (["--recipes", "gptq", "--device", "cpu"], "unknown recipe 'gptq'"),
    (["--lengths", "1", "--device", "cpu"], "at least 2 tokens"),
    (["--baselines", "static,flash", "--device", "cpu"], "unknown baseline(s) flash"),
    (["--new-tokens", "2", "--device", "cpu"], "at least 3"),
    (["--layers", "0", "--device", "cpu"], "--layers is at least 1"),
    (["--largest-batch", "-2", "--device", "cpu"], "--largest-batch 0 or more tries"),
])
def test_the_end_to_end_script_refuses_bad_arguments_with_one_line(arguments, problem, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.parse_args(arguments)
    assert exit_.value.code == 2 and problem in capsys.readouterr().err.splitlines()[-1]


def test_the_step_time_fit_separates_the_fixed_part_from_the_part_that_grows_with_the_context():
    rows = [{"cache": "StaticCache", "batch": 8, "length": n, "ms_per_step": 5.0 + 0.5 * n / 1000} for n in (8192, 32768)]
    rows.append({"cache": "StaticCache", "batch": 1, "length": 8192, "ms_per_step": 9.0})  # one length: no fit
    (fit,) = generate.fitted_steps(rows)
    assert fit == {"cache": "StaticCache", "batch": 8, "fixed_ms": 5.0, "ms_per_1k_tokens": 0.5}


def test_a_cell_where_the_fp16_caches_run_out_of_memory_keeps_the_quantized_rows_without_ratios():
    """At a batch only a quantized cache holds (StaticCache and DynamicCache out of device memory), the cell keeps one
    StaticCache row and a DynamicCache row marked out of memory, and kvcal's row its tokens/s but no ratio to either."""
    ran = {"ms_per_step": 50.0, "ms_per_step_min": 49.0, "load_s": 1.0, "cache_gib": 6.0, "peak_gib": None, "out_of_memory": False}
    cell = [{"cache": name, "length": 32768, "batch": 32, **(ran if name == "kvcal kivi" else generate.OUT_OF_MEMORY)}
            for name in ("StaticCache", "DynamicCache", "kvcal kivi", "StaticCache")]
    rows = generate.summarized(cell, weights=0, device="cpu")
    assert [(r["cache"], r["out_of_memory"]) for r in rows] == [("StaticCache", True), ("DynamicCache", True), ("kvcal kivi", False)]
    assert rows[2]["tokens_per_s"] == 640.0 and rows[2]["speedup_vs_static"] is None and rows[2]["speedup_vs_fastest_fp"] is None
    assert generate.fitted_steps(rows) == []
    text = "\n".join(generate.table({"settings": {"shape": "llama-8b", "config": {}, "dtype": "bf16", "timed_steps": 15,
                                                   "left_out": {}, "weights_gib": 15.0},
                                      "profile": {}, "results": rows, "fits": [], "torch_profiles": {}},
                                     {"device": "GPU", "commit": "abc", "date": "today"}))
    assert "| 32768 | 32 | StaticCache | out of memory |" in text and "| 32768 | 32 | kvcal kivi | 50.00 | 640.0 | - | - |" in text
    assert "rows together" not in text  # (the CUDA stores' default layout goes unsaid)


def test_the_end_to_end_table_says_when_kvcal_s_cuda_stores_keep_each_kv_heads_rows_together():
    args = generate.parse_args(["--device", "cpu", "--cuda-layout", "heads"])
    settings = {"shape": "llama-8b", "config": {}, "dtype": "bf16", "timed_steps": 15, "left_out": {}, "weights_gib": 15.0,
                "cuda_layout": args.cuda_layout}
    text = "\n".join(generate.table({"settings": settings, "profile": {}, "results": [], "fits": [], "torch_profiles": {}},
                                    {"device": "GPU", "commit": "abc", "date": "today"}))
    assert "kvcal's CUDA stores keep each KV head's rows together (--cuda-layout heads)." in text


def test_the_largest_batch_rows_have_no_ratio_where_static_cache_never_ran(recipe_bundles):
    """StaticCache out of memory in every cell at the length: it gets no largest-batch row, and kvcal's rows no ratio
    to it (not a ratio to the first row that did run)."""
    import argparse

    import torch

    from helpers.tiny_models import tiny_model
    from kvcal.runtime.fp_context import fp_context

    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        context = fp_context(model, ids[:, :-1])
        rows = [{"cache": "StaticCache", "length": 40, "batch": 2, **generate.OUT_OF_MEMORY},
                {"cache": "kvcal kivi", "length": 40, "batch": 2, "out_of_memory": False, "max_batch_predicted": None}]
        found = list(generate.largest_batches(model, context, ids, rows, {"kivi": recipe_bundles["kivi"]},
                                              argparse.Namespace(largest_batch=1, device="cpu", cuda_layout="rows"),
                                              generate.Clock("cpu")))
    assert [(r["cache"], r["largest_batch"], r["tries"]) for r in found] == [("kvcal kivi", 4, [[4, True]])]
    assert found[0]["batch_vs_static"] is None and found[0]["tokens_per_s_vs_static"] is None


@pytest.mark.slow  # fits bundles and decodes a tiny model end to end, as the dry run does
def test_the_end_to_end_script_saves_each_finished_cell_so_a_stopped_run_keeps_them():
    args = generate.parse_args(["--shape", "tiny", "--device", "cpu", "--lengths", "64", "--batches", "1,2", "--recipes", "kivi",
                                "--baselines", "static", "--new-tokens", "3", "--profile-seqlen", "64", "--seed", "3"])
    saved = []
    final = generate.measure(args, lambda result: saved.append(json.loads(json.dumps(result))))
    cells = [{(r["length"], r["batch"]) for r in result["results"]} for result in saved]
    assert cells == [{(64, 1)}, {(64, 1), (64, 2)}]
    assert [r["cache"] for r in saved[0]["results"]] == ["StaticCache", "kvcal kivi"]
    assert saved[-1] == json.loads(json.dumps(final))


def test_the_largest_batch_search_climbs_while_batches_run_then_halves_the_gap_to_the_first_that_failed():
    runs = lambda most: lambda batch: {"batch": batch} if batch <= most else None  # noqa: E731
    done, failed, tried = generate.largest_batch(runs(31), 27, 8)
    assert (done, failed) == (31, 32) and [(b, r is not None) for b, r in tried] == [
        (27, True), (30, True), (33, False), (31, True), (32, False)]
    done, failed, tried = generate.largest_batch(runs(20), 27, 3)  # down from a prediction that failed, tries spent
    assert (done, failed) == (None, 21) and [b for b, _ in tried] == [27, 24, 21]
    done, failed, tried = generate.largest_batch(runs(20), 27, 8)
    assert (done, failed) == (20, 21) and [b for b, _ in tried] == [27, 24, 21, 19, 20]
    assert generate.largest_batch(runs(0), 2, 5)[:2] == (None, 1)  # not even one sequence: it stops at 1


def test_a_kvcal_cache_that_fails_to_load_leaves_the_model_unwired(recipe_bundles):
    """A largest-batch try that runs out of memory while loading must not leave the model wired to the cache it was
    making: here the load fails on a context of the wrong width, and the model decodes with its own SDPA after it."""
    import torch

    from helpers.tiny_models import tiny_model
    from kvcal.errors import KvcalError
    from kvcal.runtime.fp_context import FpContext, fp_context

    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        context = fp_context(model, ids[:, :-1])
        narrow = FpContext(context.keys, context.pre_rope_keys, [v[..., :-8] for v in context.values], context.cache)
        make = dict(generate.makers(model, narrow, 2, 40, 4, {"kivi": recipe_bundles["kivi"]}, []))["kvcal kivi"]
        with pytest.raises(KvcalError, match="channels wide, the model's 32 and 32"):
            make()
        assert model.config._attn_implementation == "sdpa"
