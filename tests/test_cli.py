"""The command line on tiny local model directories: a full profile-gradients + inspect run, and the
bad-input matrix (one line on stderr, exit code 2, no output file)."""

import pytest
from typer.testing import CliRunner

from kvcal.artifacts import read_artifact
from kvcal.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


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
        "unsupported architecture": (["--model", tiny_model_dir("gpt2")], "unsupported architecture GPT2LMHeadModel"),
        "text shorter than one window": (["--model", llama, "--dataset", short], "fewer than one window"),
        "seqlen above max positions": (["--model", llama, "--dataset", corpus, "--seqlen", 512], "above the model's maximum of 256"),
        "nsamples 0": (["--model", llama, "--nsamples", 0], "--nsamples must be at least 1"),
        "unwritable output": (["--model", llama, "--dataset", corpus, "--out", blocker / "p.safetensors"], "not a writable folder"),
    }


def test_bad_input_gives_one_line_exit_2_and_no_file(tiny_model_dir, corpus, tmp_path):
    for case, (args, message) in bad_inputs(tmp_path, tiny_model_dir, corpus).items():
        out_dir = tmp_path / case.replace(" ", "-")
        default_out = ["--out", out_dir / "profile.safetensors"] if "--out" not in args else []
        result = run("profile-gradients", "--seqlen", 64, "--nsamples", 2, *args, *default_out)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2, (case, result.output)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (case, result.stderr)
        assert not out_dir.exists(), case


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


def test_eval_refuses_an_artifact_made_for_another_model(tiny_profile, tiny_model_dir, tiny_corpus, tmp_path):
    _, profile = tiny_profile
    nuq = tmp_path / "nuq.safetensors"
    assert run("fit-nuq", profile, "--out", nuq).exit_code == 0
    other = tiny_model_dir("qwen2")
    result = run("eval", "ppl", "--model", other, "--quant", nuq, "--dataset", tiny_corpus, "--seqlen", 32, "--windows", 1)
    assert result.exit_code == 2
    assert "calibrated for another model (LlamaForCausalLM" in result.stderr and "Qwen2ForCausalLM" in result.stderr


@pytest.mark.parametrize("args, message", [(["--bits", 5], "outside 1-4"), (["--outliers", 0.5], r"outside [0, 0.1]")])
def test_fit_nuq_bad_input(tiny_profile, tmp_path, args, message):
    out = tmp_path / "x.safetensors"
    result = run("fit-nuq", tiny_profile[1], *args, "--out", out)
    assert result.exit_code == 2 and message in result.stderr and not out.exists()


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
    memory = run("eval", "memory", "--model", model, "--dataset", tiny_corpus, *bundles, "--context", 200, "--json", tmp_path / "m.json")
    assert memory.exit_code == 0, memory.output
    for row in json.loads((tmp_path / "m.json").read_text())["results"]:
        assert row["live_bytes"] == row["formula_bytes"] < row["fp16_bytes"]
    too_long = run("eval", "memory", "--model", model, "--dataset", tiny_corpus, *bundles, "--context", 100_000)
    assert too_long.exit_code == 2 and len(too_long.stderr.strip().splitlines()) == 1
