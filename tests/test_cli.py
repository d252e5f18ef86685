"""The command line on tiny local model directories: a full profile-gradients + inspect run, and the
bad-input matrix (one error line on stderr, exit code 2, no output file), misuses (each refused with one line,
exit 2, nothing written or overwritten), progress lines for logs, and Ctrl-C."""

import os
import re
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from helpers.artifact_files import read_metadata, rewrite
from helpers.tiny_models import SPARSE_LATENTS
from kvcal.artifacts import read_artifact
from kvcal.cli import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


PROGRESS_LINE = re.compile(r"^.+ (\.\.\.|\d+/\d+( \(\d+\.\d s\))?)$")  # "profile: window 3/16 (12.4 s)", "...: loading ..."


def refused(result, message: str) -> str:
    """The error line of a refused command: exit 2, exactly one error line (the last), anything before it a
    progress line; a traceback or a second message fails."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert lines and lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert all(PROGRESS_LINE.match(line) for line in lines[:-1]), result.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from kvcal.data import builtin_text

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(builtin_text()[:60_000])
    return path


def test_profile_gradients_then_inspect_with_plot(tiny_model_dir, corpus, tmp_path):
    model = tiny_model_dir("qwen3")
    out = tmp_path / "profile.safetensors"
    result = run("profile-gradients", "--model", model, "--dataset", corpus, "--nsamples", 3, "--seqlen", 64,
                 "--seed", 7, "--max-tokens-per-layer", 100, "--target-bits", 3, "--out", out)
    assert result.exit_code == 0, result.output
    assert "3 forward, 3 backward" in result.stdout and "bits K" in result.stdout
    tensors, config = read_artifact(out, "profile")
    assert config["calibration"]["seed"] == 7 and config["calibration"]["dataset"] == str(corpus)
    assert config["model"]["fingerprint"]["model_type"] == "qwen3"
    assert tensors["layers.1.k_pre.samples"].shape == (100, 32)
    assert tensors["kvmix.bits.v"].float().mean() == 3.0  # one of two layers at 4, the other at 2

    png = tmp_path / "importance.png"
    shown = run("inspect", out, "--plot", png)
    assert shown.exit_code == 0, shown.output
    assert "s_k" in shown.stdout and "4 forward" not in shown.stdout and png.stat().st_size > 10_000


def test_same_seed_same_file_bytes(tiny_model_dir, corpus, tmp_path):
    model = tiny_model_dir("llama")
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        result = run("profile-gradients", "--model", model, "--dataset", corpus, "--nsamples", 2, "--seqlen", 32, "--out", out)
        assert result.exit_code == 0, result.output
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def bad_inputs(tmp_path, tiny_model_dir, corpus):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    llama = tiny_model_dir("llama")
    return {
        "missing model path": (["--model", tmp_path / "no-such-model"], "does not exist"),
        "unsupported architecture": (["--model", tiny_model_dir("gpt_neo")], "unsupported architecture GPTNeoForCausalLM"),
        "text shorter than one window": (["--model", llama, "--dataset", short], "fewer than one window"),
        "seqlen above max positions": (["--model", llama, "--dataset", corpus, "--seqlen", 512], "above the model's maximum of 256"),
        "nsamples 0": (["--model", llama, "--nsamples", 0], "--nsamples must be at least 1"),
        "negative seed": (["--model", llama, "--seed", -1], "--seed must be in 0 to 2^32 - 1"),
        "two KVmix rules": (["--model", llama, "--target-bits", 3, "--high-frac", 0.5], "--high-frac and --target-bits both"),
        "more stored windows than profiled": (["--model", llama, "--store-windows", 3],
                                              "--store-windows 3 is more than the 2 windows profiled (--nsamples); give at most 2"),
        "unknown device": (["--model", llama, "--device", "tpu"], "unknown --device 'tpu'"),
        "target bits past a width": (["--model", llama, "--target-bits", 3.5], "outside the widths' range [2, 3]"),
        "unwritable output": (["--model", llama, "--dataset", corpus, "--out", blocker / "p.safetensors"], "not a writable folder"),
    }


def test_bad_input_gives_one_line_exit_2_and_no_file(tiny_model_dir, corpus, tmp_path):
    for case, (args, message) in bad_inputs(tmp_path, tiny_model_dir, corpus).items():
        out_dir = tmp_path / case.replace(" ", "-")
        default_out = ["--out", out_dir / "profile.safetensors"] if "--out" not in args else []
        result = run("profile-gradients", "--seqlen", 64, "--nsamples", 2, *args, *default_out)
        refused(result, message)
        assert not out_dir.exists(), case



@pytest.mark.parametrize("argv, env, message", [
    (["fit-nuq", "p.safetensors", "--bits", "2.5"], {},
     "error: Invalid value for '--bits': Input should be a valid integer"),
    (["--no-such-option"], {}, "error: No such option: --no-such-option (see kvcal --help)"),
    (["models", "llama", "extra"], {}, "error: Got unexpected extra argument(s) (extra) (see kvcal models --help)"),
    (["fit-nuq", "p.safetensors", "--out", "nuq/"], {},
     "error: Invalid value for '--out': 'nuq/' ends in '/', naming a folder; pass the file's name (see kvcal fit-nuq"),
    (["eval", "ppl", "--json", "results/"], {}, "error: Invalid value for '--json': 'results/' ends in '/'"),
    (["eval", "ppl", "--quant", ""], {}, "error: Invalid value for '--quant': the path is empty; pass a file or folder"),
    (["inspect", " "], {}, "error: Invalid value for 'file': the path is empty; pass a file or folder"),
    (["calibrate"], {"KVCAL_CALIBRATE_NSAMPLES": "abc"}, "error: Invalid value for '--nsamples': Input should be a "
     "valid integer, unable to parse string as an integer (set by KVCAL_CALIBRATE_NSAMPLES='abc'; see kvcal calibrate"),
])
def test_a_malformed_command_line_is_one_error_line_exit_2(monkeypatch, capsys, tmp_path, argv, env, message):
    """What click parses (types, options, arguments, their env vars) is refused like every other bad input: one line,
    no usage box, nothing written."""
    from kvcal.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kvcal", *argv])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().splitlines() == [err.strip()] and err.startswith(message), err
    assert not any(tmp_path.iterdir())


def test_a_quoted_tilde_in_a_path_is_the_home_folder(monkeypatch, tmp_path):
    """As the shell would expand it: `--out '~/x'` must not make a folder named '~' in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    refused(run("inspect", "~/profile.safetensors"), f"artifact '{tmp_path}/home/profile.safetensors' does not exist")
    refused(run("export", "bundle", "--profile", "~/p.safetensors", "--out", "~/b.safetensors"),
            f"'{tmp_path}/home/p.safetensors' does not exist")
    assert not (tmp_path / "~").exists()

def test_inspect_refuses_a_file_that_is_not_an_artifact(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    result = run("inspect", junk)
    assert result.exit_code == 2 and "truncated or not a safetensors file" in result.stderr


def test_help_explains_every_option():
    result = run("profile-gradients", "--help")
    assert result.exit_code == 0
    for option in ("--model", "--dataset", "--nsamples", "--seqlen", "--seed", "--sink", "--max-tokens-per-layer",
                   "--store-windows", "--high-frac", "--target-bits", "--dtype", "--device", "--out"):
        assert option in result.stdout


def test_fit_nuq_then_eval_ppl_with_baselines(tiny_profile, tiny_corpus, tmp_path):
    model, profile = tiny_profile
    nuq = tmp_path / "nuq2.safetensors"
    fitted = run("fit-nuq", profile, "--bits", 2, "--out", nuq)
    assert fitted.exit_code == 0, fitted.output
    report = tmp_path / "ppl.json"
    result = run("eval", "ppl", "--model", model, "--quant", nuq, "--baseline", "int2,kivi2-g8-r16",
                 "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 3, "--json", report)
    assert result.exit_code == 0, result.output
    import json

    rows = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    assert set(rows) == {"fp", "nuq2-1%", "int2-g64", "kivi2-g8-r16"}
    assert rows["fp"]["ppl"] > 1 and rows["nuq2-1%"]["effective_bits"] > 2
    assert "nuq2-1%" in result.stdout and "effective bits" in result.stdout


def test_a_latent_attention_model_is_calibrated_evaluated_and_served(latent_profile, tiny_corpus, tmp_path):
    """MLA (DeepSeek-V3's): its profile's keys are the rotated key, its values the latent (64 and 96 channels); the
    kvquant bundle fit from it is evaluated by eval ppl beside engines' cache types (q4_0 stores 4.5 bits of each)
    and served by the quantized cache, whose live bytes are the formula's, below transformers' own fp16 cache of the
    latent and rotated key; plan --engine llama.cpp gives one type for both, which eval ppl evaluates; vLLM's plan,
    vLLM dtypes, SKVQ's clip search and export vllm refuse it in one line, writing nothing."""
    import json

    model, profile = latent_profile
    shown = run("inspect", profile)
    assert shown.exit_code == 0 and "multi-head latent attention" in shown.stdout
    nuq, bundle, report = tmp_path / "nuq.safetensors", tmp_path / "kvquant.safetensors", tmp_path / "ppl.json"
    assert run("fit-nuq", profile, "--bits", 3, "--out", nuq).exit_code == 0
    exported = run("export", "bundle", "--profile", profile, "--recipe", "kvquant", "--nuq", nuq, "--out", bundle)
    assert exported.exit_code == 0, exported.output
    result = run("eval", "ppl", "--model", model, "--quant", bundle, "--baseline", "q4_0,kivi2-g8-r16", "--dataset",
                 tiny_corpus, "--seqlen", 64, "--windows", 2, "--json", report)
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    assert set(rows) == {"fp", "bundle:kvquant", "q4_0", "kivi2-g8-r16"} and rows["q4_0"]["effective_bits"] == 4.5
    assert 3 < rows["bundle:kvquant"]["effective_bits"] < 5 and rows["bundle:kvquant"]["ppl"] != rows["fp"]["ppl"]
    memory = tmp_path / "memory.json"
    measured = run("eval", "memory", "--model", model, "--quant", bundle, "--dataset", tiny_corpus, "--context", 200,
                   "--json", memory)
    assert measured.exit_code == 0, measured.output
    (row,) = json.loads(memory.read_text())["results"]
    assert row["live_bytes"] == row["formula_bytes"] < row["fp16_bytes"] == 200 * 2 * (64 + 96) * 2
    planned = run("plan", profile, "--engine", "llama.cpp", "--budget", 6)
    assert planned.exit_code == 0, planned.output
    (spec,) = [line.split('"')[1] for line in planned.stdout.splitlines() if line.startswith("kvcal eval ppl --baseline")]
    assert spec in ("q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl") and f"-ctk {spec} -ctv {spec}" in planned.stdout
    evaluated = run("eval", "ppl", "--model", model, "--baseline", spec, "--dataset", tiny_corpus, "--seqlen", 64,
                    "--windows", 1)
    assert evaluated.exit_code == 0, evaluated.output
    refused(run("plan", profile, "--budget", 8), "vLLM's MLA attention caches one fp8 or 16-bit dtype in every layer")
    refused(run("plan", profile, "--engine", "ik_llama.cpp", "--budget", 8), "ik_llama.cpp's MLA cache is not modelled")
    refused(run("eval", "ppl", "--model", model, "--baseline", "int4_per_token_head", "--dataset", tiny_corpus),
            "vLLM's MLA attention caches fp8 or 16-bit only")
    folder = tmp_path / "vllm"
    refused(run("export", "vllm", "--profile", profile, "--model", model, "--out", folder),
            "kvcal export vllm does not take it")
    assert not folder.exists()
    skvq = tmp_path / "skvq.safetensors"
    refused(run("fit-skvq", profile, "--out", skvq), "an MLA model's profile does not keep")
    assert not skvq.exists()


@SPARSE_LATENTS
def test_a_sparse_attention_model_is_calibrated_evaluated_and_served(tiny_model_dir, tiny_corpus, tmp_path):
    """DeepSeek-V3.2's (MLA with an indexer picking 8 tokens a query): profiled, fit and exported as MLA, its indexer
    keys kept as computed or in FP8 (--indexer-keys fp8: a schema 3 bundle, which a kvcal reading schema 2 alone
    refuses, where it would keep them as computed); eval ppl's table and JSON give their bits (fp32 here; FP8:
    80 codes and a 4-byte scale a token), which its effective bits count beside K and V; inspect names how they are
    kept; eval memory's live bytes are the formula's; plan refuses it in one line (no engine's cache of it is
    modelled)."""
    import json

    from helpers.tiny_bundles import profile_tiny_model

    model = tiny_model_dir("deepseek_v32")
    profile = profile_tiny_model(model, tiny_corpus, tmp_path / "profile.safetensors")
    nuq, report = tmp_path / "nuq.safetensors", tmp_path / "ppl.json"
    bundles = {keys: tmp_path / f"kvquant-{keys}.safetensors" for keys in ("model", "fp8")}
    assert run("fit-nuq", profile, "--bits", 3, "--out", nuq).exit_code == 0
    for keys, bundle in bundles.items():
        exported = run("export", "bundle", "--profile", profile, "--recipe", "kvquant", "--nuq", nuq, "--indexer-keys",
                       keys, "--out", bundle)
        assert exported.exit_code == 0, exported.output
        assert ("indexer keys FP8 e4m3" in " ".join(run("inspect", bundle).stdout.split())) == (keys == "fp8")
        assert read_metadata(bundle)["kvcal.schema"] == ("3" if keys == "fp8" else "2")
    result = run("eval", "ppl", "--model", model, *[arg for bundle in bundles.values() for arg in ("--quant", bundle)],
                 "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2, "--json", report)
    assert result.exit_code == 0, result.output
    assert "indexer bits" in result.stdout
    model_keys, fp8_keys = [r for r in json.loads(report.read_text())["results"] if r["method"] == "bundle:kvquant"]
    assert model_keys["index_bits"] == 32.0 and model_keys["key_bits"] < model_keys["effective_bits"] < 32.0
    assert fp8_keys["index_bits"] == pytest.approx(8 * 84 / 80) and fp8_keys["effective_bits"] < model_keys["effective_bits"]
    for keys, bundle in bundles.items():
        memory = tmp_path / f"memory-{keys}.json"
        measured = run("eval", "memory", "--model", model, "--quant", bundle, "--dataset", tiny_corpus, "--context", 200,
                       "--json", memory)
        assert measured.exit_code == 0, measured.output
        (row,) = json.loads(memory.read_text())["results"]
        assert row["live_bytes"] == row["formula_bytes"] < row["fp16_bytes"] == 200 * 2 * ((64 + 96) * 2 + 80 * 4)
    refused(run("plan", profile, "--engine", "llama.cpp", "--budget", 6), "llama.cpp's cache of deepseek_v32 is not modelled")


def test_eval_refuses_an_artifact_made_for_another_model(tiny_profile, tiny_model_dir, tiny_corpus, tmp_path):
    _, profile = tiny_profile
    nuq = tmp_path / "nuq.safetensors"
    assert run("fit-nuq", profile, "--out", nuq).exit_code == 0
    other = tiny_model_dir("qwen2")
    result = run("eval", "ppl", "--model", other, "--quant", nuq, "--dataset", tiny_corpus, "--seqlen", 32, "--windows", 1)
    assert result.exit_code == 2
    assert "was made for LlamaForCausalLM" in result.stderr and "not for --model" in result.stderr and "Qwen2ForCausalLM" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--bits", 9], "not a code width in 1-8"), (["--outliers", 0.5], r"outside [0, 0.1]"),
    (["--bits", 4, "--target-bits", 3], "--bits and --target-bits both choose the widths"),
    (["--bits", 4, "--bits-from-profile"], "--bits and --bits-from-profile both choose the widths"),
])
def test_fit_nuq_bad_input(tiny_profile, tmp_path, args, message):
    out = tmp_path / "x.safetensors"
    result = run("fit-nuq", tiny_profile[1], *args, "--out", out)
    assert result.exit_code == 2 and message in result.stderr and not out.exists()


def test_plan_prints_vllms_arguments_and_the_eval_spec_then_eval_ppl_takes_it(tiny_profile, tiny_corpus, tmp_path):
    import json

    model, profile = tiny_profile
    planned = run("plan", profile, "--dtype", "int8_per_token_head", "--budget", 13, "--json", tmp_path / "plan.json")
    assert planned.exit_code == 0, planned.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["skipped"]) == 1 and plan["bits"] == 13.0  # (10 + 16) / 2 with head_dim 16
    assert f"vllm arguments: --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers {plan['skipped'][0]}" in planned.stdout
    evaluated = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--baseline", plan["baseline_spec"], "--seqlen", 32,
                    "--windows", 1, "--json", tmp_path / "ppl.json")
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads((tmp_path / "ppl.json").read_text())["results"][1]["effective_bits"] == 13.0
    refused(run("plan", profile, "--budget", 3), "--budget 3.0 is outside [6, 16] real bits per element")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "ppl.json"]


def test_eval_ppl_takes_ik_llama_cpp_settings_among_comma_separated_baselines(tiny_profile, tiny_corpus, tmp_path):
    """A setting's first / last options hold a comma (`k_first=TYPE,N`): --baseline splits only where a spec
    begins, and the spec kvcal plan prints for ik_llama.cpp is evaluated as printed."""
    import json

    model, profile = tiny_profile
    planned = run("plan", profile, "--engine", "ik_llama.cpp", "--budget", 6, "--json", tmp_path / "plan.json")
    assert planned.exit_code == 0, planned.output
    setting = json.loads((tmp_path / "plan.json").read_text())["baseline_spec"]
    specs = f"q4_0;k_first=q8_0,1;v_last=f16,1,{setting},int4"
    evaluated = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--baseline", specs, "--seqlen", 32,
                    "--windows", 1, "--json", tmp_path / "ppl.json")
    assert evaluated.exit_code == 0, evaluated.output
    names = [result["method"] for result in json.loads((tmp_path / "ppl.json").read_text())["results"][1:]]
    assert names[0] == "q4_0;k_first=q8_0,1;v_last=f16,1" and names[2] == "int4-g64" and len(names) == 3


def test_plan_for_llama_cpp_prints_its_ctk_ctv_and_eval_ppl_stores_the_planned_bits(tiny_profile, tiny_corpus, tmp_path):
    import json

    model, profile = tiny_profile
    planned = run("plan", profile, "--engine", "llama.cpp", "--budget", 6, "--json", tmp_path / "plan.json")
    assert planned.exit_code == 0, planned.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert f"llama.cpp arguments: -ctk {plan['type_k']} -ctv {plan['type_v']}" in planned.stdout and plan["bits"] <= 6
    evaluated = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--baseline", plan["baseline_spec"], "--seqlen", 32,
                    "--windows", 1, "--json", tmp_path / "ppl.json")
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads((tmp_path / "ppl.json").read_text())["results"][1]["effective_bits"] == pytest.approx(plan["bits"])
    refused(run("plan", profile, "--engine", "llama.cpp", "--dtype", "q4_0", "--budget", 6), "drop --dtype, --by and --context")
    refused(run("plan", profile, "--engine", "llama.cpp", "--budget", 4), "--budget 4.0 is outside [4.5, 16]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "ppl.json"]


def test_fit_skvq_then_eval_ppl(tiny_profile, tiny_corpus, tmp_path):
    model, profile = tiny_profile
    artifact = tmp_path / "skvq.safetensors"
    fitted = run("fit-skvq", profile, "--group-size", 16, "--window", 8, "--sink", 2, "--vbits", 1.5, "--fp8", "--out", artifact)
    assert fitted.exit_code == 0, fitted.output
    assert "K group sizes" in fitted.stdout
    result = run("eval", "ppl", "--model", model, "--quant", artifact, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2)
    assert result.exit_code == 0, result.output
    assert "skvq-K2V1.5-g16-w8-s2 [fp8]" in result.stdout


def test_fit_skvq_bad_input(tiny_profile, tmp_path):
    out = tmp_path / "x.safetensors"
    result = run("fit-skvq", tiny_profile[1], "--window", -1, "--out", out)
    assert result.exit_code == 2 and "--window must be 0 or more" in result.stderr and not out.exists()


def test_fit_nuq_with_a_window_then_eval_ppl(tiny_profile, tiny_corpus, tmp_path):
    model, profile = tiny_profile
    artifact, bad = tmp_path / "nuq.safetensors", tmp_path / "bad.safetensors"
    fitted = run("fit-nuq", profile, "--window", 4, "--out", artifact)
    assert fitted.exit_code == 0, fitted.output
    result = run("eval", "ppl", "--model", model, "--quant", artifact, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2)
    assert result.exit_code == 0, result.output
    assert "nuq3-1% [window 4]" in result.stdout
    refused = run("fit-nuq", profile, "--window", -1, "--out", bad)
    assert refused.exit_code == 2 and "--window must be 0 or more" in refused.stderr and not bad.exists()


def test_calibrate_runs_every_stage_and_writes_a_bundle(tiny_model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "run" / "bundle.safetensors"
    result = run("calibrate", "--model", tiny_model_dir("mistral"), "--dataset", tiny_corpus, "--nsamples", 2, "--seqlen", 48,
                 "--bits", 4, "--out", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["bundle.safetensors", "nuq.safetensors", "profile.safetensors"]
    from kvcal.bundle import load_bundle

    bundle = load_bundle(out)
    assert bundle.recipe_name == "kvquant" and bundle.layers[0].k_bits == 4
    assert "kvcal bundle" in result.stdout and "recipe" in result.stdout


def test_export_bundle_kivi_and_inspect(tiny_profile, tmp_path):
    _, profile = tiny_profile
    out = tmp_path / "kivi.safetensors"
    result = run("export", "bundle", "--profile", profile, "--recipe", "kivi", "--kivi-group", 16, "--kivi-residual", 32, "--out", out)
    assert result.exit_code == 0, result.output
    shown = run("inspect", out)
    assert shown.exit_code == 0 and "uniform" in shown.stdout and "kivi" in shown.stdout
    bad = run("export", "bundle", "--profile", profile, "--recipe", "kivi", "--kivi-residual", 100, "--out", tmp_path / "bad.safetensors")
    assert bad.exit_code == 2 and "multiple of the group size" in bad.stderr and not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("residual", [0, 32])
def test_a_kivi_bundle_and_the_kivi_baseline_of_its_settings_score_alike(tiny_profile, tiny_corpus, residual, tmp_path):
    """The same KIVI, as a bundle and as `--baseline kiviN-gG-rR`: the same perplexity and bits. Without a residual,
    keys wait fp16 until they fill a block of G tokens (the baseline quantized them before: a worse perplexity)."""
    import json

    model, profile = tiny_profile
    bundle = tmp_path / "kivi.safetensors"
    made = run("export", "bundle", "--profile", profile, "--recipe", "kivi", "--kivi-group", 16, "--kivi-residual", residual,
               "--out", bundle)
    assert made.exit_code == 0, made.output
    result = run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--seqlen", 64, "--windows", 2, "--quant", bundle,
                 "--baseline", f"kivi2-g16-r{residual}", "--json", tmp_path / "ppl.json")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "ppl.json").read_text())["results"]
    as_bundle, as_baseline = ({key: row[key] for key in ("ppl", "effective_bits", "key_bits", "value_bits")} for row in rows[1:])
    assert as_bundle == as_baseline



def test_export_bundle_refuses_an_option_its_recipe_does_not_read(tiny_profile, fitted, tmp_path):
    """A fitted artifact or KIVI setting the recipe would ignore is refused: the bundle would not be the one asked for."""
    _, profile = tiny_profile
    out = tmp_path / "b.safetensors"
    for args, message in ((["--recipe", "kivi", "--nuq", fitted["nuq"]], "recipe kivi does not read --nuq"),
                          (["--recipe", "kvquant", "--nuq", fitted["nuq"], "--skvq", fitted["skvq"]], "recipe kvquant does not read --skvq"),
                          (["--recipe", "kvmix", "--kivi-bits", 4], "recipe kvmix does not read --kivi-bits")):
        refused(run("export", "bundle", "--profile", profile, *args, "--out", out), message)
        assert not out.exists()


def test_indexer_keys_in_fp8_are_refused_for_a_model_without_sparse_layers(tiny_model_dir, tiny_corpus, tiny_profile,
                                                                          tmp_path, monkeypatch):
    """--indexer-keys fp8 for a model whose layers keep no indexer keys (Llama), or an unknown format, is refused in one
    line, nothing written; calibrate refuses it before the model's weights are loaded."""
    import kvcal.profile

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    _, profile = tiny_profile
    out = tmp_path / "run" / "bundle.safetensors"
    for keys, message in (("fp8", "--indexer-keys fp8: the profile's model keeps no indexer keys"),
                          ("int4", "--indexer-keys 'int4' is not one of model, fp8")):
        refused(run("export", "bundle", "--profile", profile, "--recipe", "kivi", "--indexer-keys", keys, "--out", out),
                message)
    monkeypatch.setattr(kvcal.profile, "load_model", no_loading)
    refused(run("calibrate", "--model", tiny_model_dir("llama"), "--dataset", tiny_corpus, "--indexer-keys", "fp8",
                "--out", out), "keeps no indexer keys (no sparse attention layer)")
    assert not out.parent.exists()

def test_eval_generate_passkey_and_memory_on_bundles(tiny_profile, tiny_corpus, recipe_bundles, tmp_path):
    import json

    model, _ = tiny_profile
    bundles = [arg for recipe in ("kivi", "skvq") for arg in ("--quant", recipe_bundles[recipe])]
    generated = run("eval", "generate", "--model", model, "--dataset", tiny_corpus, *bundles, "--prompts", 3,
                    "--prompt-tokens", 24, "--new-tokens", 6, "--json", tmp_path / "gen.json")
    assert generated.exit_code == 0, generated.output
    results = json.loads((tmp_path / "gen.json").read_text())["results"]
    assert [r["method"] for r in results] == ["fp", "kivi", "skvq"] and results[0]["token_agreement"] == 1.0
    passkey = run("eval", "passkey", "--model", model, "--dataset", tiny_corpus, *bundles, "--lengths", "96,128",
                  "--samples", 2, "--json", tmp_path / "passkey.json")
    assert passkey.exit_code == 0, passkey.output
    assert len(json.loads((tmp_path / "passkey.json").read_text())["results"]) == 2 * 3
    multikey = run("eval", "passkey", "--model", model, "--dataset", tiny_corpus, *bundles, "--lengths", "128", "--samples", 2,
                   "--keys", 3, "--asked", 2, "--prefill-chunk", 50, "--baseline", "q4_0,fp8", "--json", tmp_path / "multikey.json")
    assert multikey.exit_code == 0, multikey.output
    results = json.loads((tmp_path / "multikey.json").read_text())["results"]
    assert [(r["method"], r["samples"]) for r in results] == [("fp", 4), ("kivi", 4), ("skvq", 4), ("q4_0", 4), ("fp8 scale 1.0", 4)]
    memory = run("eval", "memory", "--model", model, "--dataset", tiny_corpus, *bundles, "--context", 200, "--json", tmp_path / "m.json")
    assert memory.exit_code == 0, memory.output
    for row in json.loads((tmp_path / "m.json").read_text())["results"]:
        assert row["live_bytes"] == row["formula_bytes"] < row["fp16_bytes"]
    too_long = run("eval", "memory", "--model", model, "--dataset", tiny_corpus, *bundles, "--context", 100_000)
    assert too_long.exit_code == 2 and len(too_long.stderr.strip().splitlines()) == 1


# --- every misuse refused with one line, exit 2, nothing written or overwritten ---------------------------


def _copies(tmp_path, **files):
    """Copies of session artifacts, so that a check that fails cannot destroy the shared fixtures."""
    copies = {}
    for name, path in files.items():
        copies[name] = tmp_path / f"{name}.safetensors"
        copies[name].write_bytes(path.read_bytes())
    return copies


def test_an_out_that_is_not_a_regular_file_is_refused_and_left_alone(tiny_profile, tiny_corpus, tmp_path):
    import stat

    model, profile = tiny_profile
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    for out, what in ((fifo, "exists and is a fifo, not a regular file"), (folder, "is a directory")):
        refused(run("fit-nuq", profile, "--out", out), what)
        refused(run("fit-skvq", profile, "--out", out), what)
        refused(run("export", "bundle", "--profile", profile, "--recipe", "kivi", "--out", out), what)
        refused(run("profile-gradients", "--model", model, "--dataset", tiny_corpus, "--out", out), what)
        refused(run("calibrate", "--model", model, "--dataset", tiny_corpus, "--out", out), what)
        refused(run("inspect", profile, "--plot", out), what)
    json_fifo = tmp_path / "report.json"
    os.mkfifo(json_fifo)
    refused(run("eval", "ppl", "--model", model, "--dataset", tiny_corpus, "--json", json_fifo), "--json")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISFIFO(json_fifo.stat().st_mode) and folder.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.safetensors", "folder.safetensors", "report.json"]


def test_a_corrupt_profile_is_refused_before_any_work(tiny_profile, tmp_path):
    """fit-nuq, fit-skvq and export vllm read the profile's tensors only after a layer line or the model's loading:
    its checksum is verified first, and the error is the only line."""
    model, profile = tiny_profile
    data = profile.read_bytes()
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:])
    for command in (["fit-nuq", flipped, "--out", tmp_path / "nuq.safetensors"],
                    ["fit-skvq", flipped, "--out", tmp_path / "skvq.safetensors"],
                    ["export", "vllm", "--profile", flipped, "--model", model, "--out", tmp_path / "folder"]):
        result = run(*command)
        refused(result, "fails its checksum")
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flipped.safetensors"]


def test_inspect_validates_what_it_reads(recipe_bundles, tiny_profile, fitted, tmp_path):
    data = recipe_bundles["kvquant"].read_bytes()
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:])
    result = refused(run("inspect", flipped), "fails its checksum")
    assert str(flipped) in result

    def bad_outliers(config):
        config["recipe"]["layers"][0]["outliers"] = "x"
        return config

    resealed = rewrite(recipe_bundles["kvquant"], tmp_path / "resealed.safetensors", config_fn=bad_outliers)
    refused(run("inspect", resealed), "the recipe of layer 0 is invalid (outliers 'x'")

    def drop(name):
        def tensors_fn(tensors):
            del tensors[name]
            return tensors
        return tensors_fn

    _, profile = tiny_profile
    no_bits = rewrite(profile, tmp_path / "profile.safetensors", tensors_fn=drop("kvmix.bits.k"))
    assert str(no_bits) in refused(run("inspect", no_bits), "is a malformed kvcal profile (KeyError")
    no_codebook = rewrite(fitted["nuq"], tmp_path / "nuq.safetensors", tensors_fn=drop("layers.1.v.codebook"))
    refused(run("inspect", no_codebook), "is a malformed kvcal nuq (KeyError")

    def text_bits(config):
        config["skvq"]["kbits"] = "two"
        return config

    refused(run("inspect", rewrite(fitted["skvq"], tmp_path / "skvq.safetensors", config_fn=text_bits)), "is a malformed kvcal skvq")
    refused(run("inspect", tmp_path), "is a directory, not a kvcal artifact")


@pytest.mark.parametrize("recipe, bits, message", [
    ("kivi", 5, "--bits 5 does not fit recipe kivi: KIVI bits 5 is not one of 1, 2, 3, 4"),
    ("kivi", 0, "--bits 0 does not fit recipe kivi: KIVI bits 0 is not one of 1, 2, 3, 4"),
    ("kivi", -1, "--bits -1 does not fit recipe kivi"),
    ("kvquant", 9, "--bits 9 is not a code width in 1-8"),
    ("kvquant", 2.5, "--bits 2.5 is not a code width in 1-8"),
    ("skvq", 0, "--bits 0 does not fit recipe skvq: "),
    ("mixed", 9, "--bits 9 does not fit recipe mixed: --target-bits 9.0 is outside [2.32, 8] real bits"),
    ("kvmix", 2, "--bits does not apply to recipe kvmix"),
])
def test_calibrate_checks_settings_before_the_model_is_loaded(tiny_model_dir, tiny_corpus, tmp_path, monkeypatch,
                                                                       recipe, bits, message):
    import kvcal.profile

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(kvcal.profile, "load_model", no_loading)
    out = tmp_path / "run" / "bundle.safetensors"
    result = run("calibrate", "--model", tiny_model_dir("llama"), "--dataset", tiny_corpus, "--recipe", recipe, "--bits", bits, "--out", out)
    assert len(result.stderr.strip().splitlines()) == 1  # refused before any progress
    refused(result, message)
    assert not out.parent.exists()


def test_an_out_equal_to_an_input_is_refused_and_the_input_kept(tiny_profile, tiny_corpus, fitted, tmp_path):
    model, profile = tiny_profile
    files = _copies(tmp_path, profile=profile, nuq=fitted["nuq"], skvq=fitted["skvq"])
    p, n, s = files["profile"], files["nuq"], files["skvq"]
    corpus = tmp_path / "text.txt"
    corpus.write_text(tiny_corpus.read_text())
    link = tmp_path / "link.safetensors"
    link.symlink_to(p)
    before = {path: path.read_bytes() for path in (p, n, s, corpus)}
    cases = [
        (["fit-nuq", p, "--out", p], "--out"), (["fit-nuq", p, "--out", link], "--out"), (["fit-skvq", p, "--out", p], "--out"),
        (["export", "bundle", "--profile", p, "--nuq", n, "--out", n], "--out"),
        (["export", "bundle", "--profile", p, "--nuq", n, "--out", p], "--out"),
        (["export", "bundle", "--profile", p, "--recipe", "skvq", "--skvq", s, "--out", s], "--out"),
        (["inspect", p, "--plot", p], "--plot"),
        (["eval", "ppl", "--model", model, "--quant", n, "--dataset", corpus, "--json", n], "--json"),
        (["eval", "ppl", "--model", model, "--baseline", "int4", "--dataset", corpus, "--json", corpus], "--json"),
        (["eval", "memory", "--model", model, "--quant", n, "--dataset", corpus, "--json", corpus], "--json"),
        (["profile-gradients", "--model", model, "--dataset", corpus, "--out", corpus], "--out"),
        (["calibrate", "--model", model, "--dataset", corpus, "--out", corpus], "--out"),
    ]
    for args, option in cases:
        line = refused(run(*args), "is also an input")
        assert line.startswith(f"error: {option} "), line
    refused(run("calibrate", "--model", model, "--dataset", corpus, "--out", tmp_path / "run" / "profile.safetensors"),
            "is where the profile is written beside the bundle")
    refused(run("calibrate", "--model", model, "--dataset", corpus, "--out", tmp_path / "run" / "nuq.safetensors"),
            "is where the nuq is written beside the bundle")
    assert {path: path.read_bytes() for path in before} == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("plot, message", [
    ("blocker/importance.png", "is not a writable folder; choose another --plot"),
    ("folder", "--plot 'FOLDER' is a directory"),
    ("importance.xyz", "does not end in an image format's extension"),
    ("importance", "does not end in an image format's extension"),
])
def test_a_bad_plot_path_is_refused_before_the_table(tiny_profile, tmp_path, plot, message):
    _, profile = tiny_profile
    (tmp_path / "blocker").write_text("x")
    (tmp_path / "folder").mkdir()
    result = run("inspect", profile, "--plot", tmp_path / plot)
    refused(result, message.replace("FOLDER", str(tmp_path / "folder")))
    assert result.stdout == ""


def test_a_plot_of_a_bundle_is_refused_before_the_table_and_svg_works(recipe_bundles, tiny_profile, tmp_path):
    result = run("inspect", recipe_bundles["kivi"], "--plot", tmp_path / "x.png")
    refused(result, "--plot draws a profile's importance; ")
    assert result.stdout == "" and not (tmp_path / "x.png").exists()
    drawn = run("inspect", tiny_profile[1], "--plot", tmp_path / "importance.svg")
    assert drawn.exit_code == 0 and (tmp_path / "importance.svg").read_text().lstrip().startswith("<?xml")
    assert [p.name for p in tmp_path.iterdir()] == ["importance.svg"]  # no temp file left


def test_eval_commands_name_the_option_at_fault(tiny_profile, tiny_corpus, recipe_bundles, tmp_path):
    model, _ = tiny_profile
    common = ["--model", model, "--dataset", tiny_corpus, "--quant", recipe_bundles["kivi"]]
    refused(run("eval", "generate", *common, "--prompt-tokens", 5000),
            "--prompt-tokens 5000 + --new-tokens 128 = 5128 positions, above the model's maximum of 256")
    refused(run("eval", "memory", *common, "--context", 5000), "--context 5000 = 5000 positions, above the model's maximum of 256")
    refused(run("eval", "passkey", *common, "--lengths", "128,300"),
            "--lengths 300 + the 8-token answer = 308 positions, above the model's maximum of 256")
    refused(run("eval", "passkey", *common, "--lengths", "100,128,100"), "--lengths lists 100 more than once; give each")
    refused(run("eval", "passkey", *common, "--lengths", "128", "--baseline", "int4,fp8,int4-g64"),
            "--baseline 'int4' and 'int4-g64' are the same cache type (int4-g64); give it once")
    refused(run("eval", "ppl", *common, "--baseline", "fp8,fp8"), "--baseline 'fp8' and 'fp8' are the same cache type")
    for command in (["eval", "ppl"], ["eval", "generate"], ["eval", "passkey"], ["eval", "memory"]):
        refused(run(*command, *common, "--quant", recipe_bundles["kivi"]), "is given twice; give each once")
    kivi = recipe_bundles["kivi"]
    refused(run("eval", "ppl", *common, "--quant", kivi.parent / ".." / kivi.parent.name / kivi.name), "is the same as --quant")
    refused(run("eval", "passkey", *common, "--keys", 9), "--keys must be 1-8 (got 9)")
    refused(run("eval", "passkey", *common, "--keys", 0), "--keys must be 1-8 (got 0)")
    refused(run("eval", "passkey", *common, "--asked", 1), "--asked goes with --keys 2 or more")
    refused(run("eval", "passkey", *common, "--keys", 3, "--asked", 4), "--asked must be 1-3, one of the --keys 3 keys (got 4)")
    refused(run("eval", "passkey", *common, "--prefill-chunk", -1), "--prefill-chunk must be 0 (one step) or a number of tokens")
    refused(run("eval", "passkey", *common, "--baseline", "q3_0"), "unknown baseline 'q3_0'")
    refused(run("eval", "passkey", *common, "--lengths", "128", "--baseline", "kivi2"), "only a cache type that quantizes each post-RoPE token on its own")
    refused(run("eval", "memory", *common, "--prefill-chunk", -1), "--prefill-chunk must be 0 (one step) or a number of tokens")
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    for command in (["eval", "ppl", "--model", model, "--dataset", tiny_corpus], ["eval", "generate", *common],
                    ["eval", "passkey", *common], ["eval", "memory", *common]):
        line = refused(run(*command, "--json", blocker / "report.json"), "choose another --json")
        assert "--out" not in line


def test_inspect_refuses_a_directory_or_a_missing_file(tmp_path):
    refused(run("inspect", tmp_path), f"'{tmp_path}' is a directory, not a kvcal artifact")
    refused(run("inspect", tmp_path / "missing.safetensors"), "does not exist")


def test_inspect_device_shows_what_serves_each_layer_and_refuses_what_it_cannot_plan(head_dim_64_bundles, tiny_profile):
    result = run("inspect", head_dim_64_bundles["kvquant"], "--device", "cuda")
    assert result.exit_code == 0, result.output
    assert "decode steps on a CUDA GPU with CuPy" in result.output and "tensor-core" in result.output
    assert "up to 32 tokens" in result.output  # the longest short step: GQA 2 in at most 8 passes of 8
    result = run("inspect", head_dim_64_bundles["kvquant"], "--device", "cpu")
    assert result.exit_code == 0 and "cpu-kernel" in result.output and "cpu-append" in result.output
    assert "up to 128 tokens" in result.output
    refused(run("inspect", head_dim_64_bundles["kvquant"], "--device", "gpu"), "--device 'gpu' is not one of cpu, cuda")
    refused(run("inspect", tiny_profile[1], "--device", "cpu"), "is a kvcal profile: leave --device out")


@pytest.mark.slow
def test_ctrl_c_prints_interrupted_exits_130_and_writes_nothing(tiny_model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "out" / "profile.safetensors"
    command = [sys.executable, "-m", "kvcal", "profile-gradients", "--model", str(tiny_model_dir("llama")), "--dataset",
               str(tiny_corpus), "--nsamples", "1500", "--seqlen", "16", "--out", str(out)]  # long enough to interrupt
    # SIGINT at its default in the child: a background job of a non-interactive shell (CI run with `&`) starts with
    # it ignored, which a child inherits, and then Ctrl-C never arrives
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in process.stderr:  # stderr is a pipe: plain progress lines
        lines.append(line.rstrip("\n"))
        if line.startswith("profile: window 2/"):
            process.send_signal(signal.SIGINT)
            break
    _, rest = process.communicate(timeout=120)
    lines += rest.splitlines()
    assert process.returncode == 130, lines
    assert lines[-1] == "interrupted" and not any("Traceback" in line for line in lines), lines
    assert not out.exists() and (not out.parent.exists() or not any(out.parent.iterdir()))


def test_ctrl_c_in_a_fit_is_reported_too(tiny_profile, tmp_path, monkeypatch):
    import kvcal.fit.nuq

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcal.fit.nuq, "fit_nuq", interrupted)
    result = run("fit-nuq", tiny_profile[1], "--out", tmp_path / "nuq.safetensors")
    assert result.exit_code == 130 and result.stderr.strip().splitlines()[-1] == "interrupted"
    assert not any(tmp_path.iterdir())


# --- progress -----------------------------------------------------------------------------------------------


def test_progress_in_a_log_is_one_plain_line_per_stage_and_window(tiny_model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "a-folder-with-a-long-name-so-that-the-last-line-is-longer-than-eighty-columns" / "bundle.safetensors"
    result = run("calibrate", "--model", tiny_model_dir("llama"), "--dataset", tiny_corpus, "--nsamples", 3, "--seqlen", 48, "--out", out)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    timed = r" \(\d+\.\d s\)"
    expected = [r"1/3 profile: loading model and text \.\.\.", r"1/3 profile: window 0/3"]
    expected += [rf"1/3 profile: window {i}/3{timed}" for i in (1, 2, 3)]
    expected += [r"2/3 fit nuq 0/2"] + [rf"2/3 fit nuq {i}/2{timed}" for i in (1, 2)]
    expected += [r"3/3 export bundle \.\.\.", rf"wrote {re.escape(str(out))} \(with nuq.safetensors, profile.safetensors beside it\) in \d+\.\d s"]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert len(lines[-1]) > 80  # one line however long: nothing wraps


def test_calibrate_names_only_the_artifacts_it_wrote_beside_the_bundle(tiny_model_dir, tiny_corpus, tmp_path):
    (tmp_path / "another-models-bundle.safetensors").write_bytes(b"left alone")
    out = tmp_path / "kivi.safetensors"
    result = run("calibrate", "--model", tiny_model_dir("llama"), "--dataset", tiny_corpus, "--nsamples", 2, "--seqlen", 48,
                 "--recipe", "kivi", "--out", out)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(rf"wrote {re.escape(str(out))} \(with profile.safetensors beside it\) in \d+\.\d s", result.stderr.splitlines()[-1])
    assert (tmp_path / "another-models-bundle.safetensors").read_bytes() == b"left alone"


@pytest.mark.slow
def test_progress_in_a_terminal_is_a_live_bar(tiny_model_dir, tiny_corpus, tmp_path):
    """With a terminal on stderr (a pseudo-terminal here) progress is rich's live bar, not the plain log lines."""
    import pty

    primary, secondary = pty.openpty()
    command = [sys.executable, "-m", "kvcal", "profile-gradients", "--model", str(tiny_model_dir("llama")), "--dataset",
               str(tiny_corpus), "--nsamples", "3", "--seqlen", "16", "--out", str(tmp_path / "profile.safetensors")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=secondary, env={**os.environ, "TERM": "xterm"})
    os.close(secondary)
    output = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(primary)
    text = output.decode(errors="replace")
    assert process.wait(timeout=120) == 0, text
    assert "\x1b[" in text and "━" in text and "profile: window 1/3" not in text.splitlines()


@pytest.mark.slow
def test_the_command_silences_the_gguf_loaders_own_tqdm_bar():
    """transformers' GGUF loader iterates `tqdm(reader.tensors, desc="Converting and de-quantizing GGUF tensors...")`
    with tqdm.auto imported in transformers.modeling_gguf_pytorch_utils; the `kvcal` entry point silences it."""
    code = ("import sys\nimport kvcal.cli as cli\ncli.app = lambda **_: None\nif sys.argv[1] == 'main':\n    cli.main()\n"
            "from transformers.modeling_gguf_pytorch_utils import tqdm\n"
            "for _ in tqdm(range(3), desc='Converting and de-quantizing GGUF tensors...'):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    loud, quiet = (subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, env=env, timeout=120)
                   for arg in ("library", "main"))
    assert loud.returncode == quiet.returncode == 0, (loud.stderr, quiet.stderr)
    assert "Converting and de-quantizing GGUF tensors" in loud.stderr
    assert "Converting" not in quiet.stderr


def test_models_lists_every_type_kvcal_serves_and_what_the_installed_transformers_lacks_for_it():
    """Every type, how its decoder is read, and, for a type the installed transformers has not (or has classes older
    than kvcal follows), what it lacks: nothing on the test extra's release, which has every one."""
    from helpers.tiny_models import known
    from kvcal.adapters import LATENT_ATTENTION_TYPES, SUPPORTED_MODEL_TYPES

    result = run("models")
    assert result.exit_code == 0, result.output
    listed = {kind: (read_as, lacks) for kind, read_as, lacks in
              re.findall(r"^│ ([\w-]+) +│ +(.+?) │ +(.*?) *│$", result.stdout, re.MULTILINE)}
    assert sorted(listed) == sorted(SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES)
    assert listed["longcat_flash"][0] == "multi-head latent attention"
    assert listed["muse_spark"][0] == "decoder beside a vision tower, images cached as tokens"
    served_here = known(tuple(listed))
    assert all((lacks == "") == (kind in served_here) for kind, (_, lacks) in listed.items())


def test_models_reads_a_model_from_its_config_alone(tiny_model_dir):
    """A model's attention as kvcal reads it, with its weights' file gone: the sliding layer's window, each layer's
    heads and RoPE, and the bytes a token takes in its fp16 cache (Gemma 3's tiny model: 2 KV heads of 16 channels
    for K and V, 128 bytes a layer; a sequence of 32768 tokens keeps 16 of them in the sliding layer)."""
    model = tiny_model_dir("gemma3_text")
    (model / "model.safetensors").unlink()
    result = run("models", model)
    assert result.exit_code == 0, result.output
    assert "Gemma3ForCausalLM (gemma3_text): 2 decoder layers" in result.stdout
    assert "256 bytes per token of K and V; " in result.stdout
    assert f"{128 * (16 + 32768) / 2 ** 30:.2f} GiB for a sequence of 32768 tokens" in result.stdout
    rows = re.findall(r"^│ (\d) +│ +(\S+) │ +4 │ +2 x 16 │ +32 │ +x1 │ +128 │$", result.stdout, re.MULTILINE)
    assert rows == [("0", "16"), ("1", "-")]


@pytest.mark.slow  # (two processes building a model's modules)
def test_models_reads_a_671b_parameter_model_from_its_config_without_allocating_its_weights(tmp_path):
    """DeepSeek-V3's released shapes (61 layers, 256 fused experts of 30 GB a layer in fp32) and Llama 4 Scout's (its
    experts made zeroed by its modeling code): each is read from its config alone, in a process whose peak memory
    stays under 2 GiB, what the packages it imports take. The peak is VmHWM, the child's own high-water mark:
    ru_maxrss after exec also counts the parent's (the pytest worker's) resident set, which can pass 2 GiB alone."""
    from transformers import AutoConfig

    code = ("import sys\nfrom pathlib import Path\nfrom kvcal.cli import main\n"
            "sys.argv = ['kvcal', 'models', sys.argv[1]]\ntry:\n    main()\nfinally:\n"
            "    print('peak', Path('/proc/self/status').read_text().split('VmHWM:')[1].split()[0], file=sys.stderr)")
    for model_type, read_as in (("deepseek_v3", "DeepseekV3ForCausalLM (deepseek_v3): 61 decoder layers"),
                                ("llama4", "Llama4ForCausalLM (llama4_text): 48 decoder layers")):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / model_type)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "COLUMNS": "200"})
        assert done.returncode == 0, done.stderr
        assert read_as in done.stdout
        assert int(done.stderr.split("peak")[-1]) < 2 * 2**20, done.stderr  # KiB


def test_models_refuses_a_config_transformers_cannot_build_in_one_line(tmp_path):
    """A config.json that loads but that the modeling code fails on (a negative MLP width: RuntimeError from torch)
    is refused in one line naming the model and what transformers raised, not a traceback."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=-1).save_pretrained(tmp_path)
    line = refused(run("models", tmp_path), "could not build model")
    assert "RuntimeError: Trying to create tensor with negative dimension" in line


def test_models_refuses_an_architecture_it_does_not_serve_in_one_line(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("diffllama", vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path)
    refused(run("models", tmp_path), "unsupported architecture DiffLlamaForCausalLM (model_type 'diffllama')")
    assert "`kvcal models` lists the" in run("models", tmp_path).stderr
    refused(run("models", tmp_path / "missing"), "model path")


def test_every_option_reads_the_env_var_docs_cli_names():
    """KVCAL_<COMMAND>_<OPTION> (click names it by the parameter, which must then be the option's long name), or the
    env var the option names itself (KVCAL_MODEL)."""
    import typer

    def commands(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from commands(sub, [*path, name])
        else:
            yield path, command

    for path, command in commands(typer.main.get_command(app), []):
        for param in command.params:
            longs = [opt for opt in param.opts if opt.startswith("--")]
            if param.param_type_name == "option" and param.envvar is None and longs and longs[0] != "--help":
                assert param.name == longs[0][2:].replace("-", "_"), (" ".join(path), longs[0], param.name)
