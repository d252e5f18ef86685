"""The README and docs/ run as written. CI runs the README's test command (kept in step with .ci/run); the README's
Python runs on the packaged SmolLM2 after a short `kvcal calibrate`; every shell example of the README and of docs/
runs as written on a tiny random model; every relative link resolves; the results they show are generated from
benchmarks/results (benchmarks/report.py).

How the shell examples run: each fenced `bash` block (but the two set-up commands, which install packages) of the
README, then of docs/cli.md, then of the other pages of docs/, is split into commands (backslash continuations joined, `#` comments dropped) and each `kvcal ...` command
is invoked through typer's CliRunner, in a temp folder laid out like a checkout (`../shared/data/wikitext-2`
beside it), in README order. The environment does the scaling, as the README documents: `KVCAL_MODEL` (the
default `--model` of every command) is a tiny random Llama saved as a folder named `SmolLM2-135M-Instruct`,
so the default output folder and every path the README names are the same as with the real model, and
`KVCAL_<COMMAND>_<OPTION>` variables scale the defaults the examples rely on (16 x 512 windows, 40 eval
windows, 128 new tokens, ...) down to seconds; an option written in the README always wins over them. A
block preceded by the line `<!-- readme-test: skip -->` is not run (none is today).

How the Python runs: `kvcal calibrate` (the set-up's main job, scaled down to one 32-token window with
KVCAL_CALIBRATE_NSAMPLES / KVCAL_CALIBRATE_SEQLEN) writes artifacts/SmolLM2-135M-Instruct/ in a temp
folder, then every `python` block runs in README order in one namespace (later blocks continue the first,
complete example). SmolLM2 is read once: the test memoizes kvcal.models.load_model for both."""

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import WIKITEXT_VALID
from helpers.tiny_models import tiny_model
from kvcal.cli import app
from kvcal.version import transformers_from

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, REPO / "docs" / "cli.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "cli.md")]
PAGES = [*DOCS, REPO / "CONTRIBUTING.md"]
ARTIFACTS = Path("artifacts") / "SmolLM2-135M-Instruct"
SKIP_MARKER = "<!-- readme-test: skip -->"
SETUP_PREFIX = "pip install torch==2.13.0"
SCALED_DOWN = {
    "KVCAL_CALIBRATE_NSAMPLES": "2", "KVCAL_CALIBRATE_SEQLEN": "64",
    "KVCAL_PROFILE_GRADIENTS_NSAMPLES": "2", "KVCAL_PROFILE_GRADIENTS_SEQLEN": "64",
    "KVCAL_EVAL_PPL_SEQLEN": "64", "KVCAL_EVAL_PPL_WINDOWS": "2",
    "KVCAL_EVAL_GENERATE_PROMPTS": "2", "KVCAL_EVAL_GENERATE_PROMPT_TOKENS": "24", "KVCAL_EVAL_GENERATE_NEW_TOKENS": "4",
    "KVCAL_EVAL_PASSKEY_LENGTHS": "96", "KVCAL_EVAL_PASSKEY_SAMPLES": "1",
    "KVCAL_EVAL_MEMORY_CONTEXT": "256",
}


def blocks(language: str, page: Path = README) -> list[tuple[int, str]]:
    """(line number, code) of a page's fenced blocks in `language`, without those marked to skip."""
    lines = page.read_text().splitlines()
    found, start = [], None
    for number, line in enumerate(lines, 1):
        if start is None and line.startswith("```"):
            start = (number, line[3:].strip(), lines[number - 2].strip() == SKIP_MARKER if number > 1 else False)
        elif start is not None and line.startswith("```"):
            first, lang, skip = start
            if lang == language and not skip:
                found.append((first, "\n".join(lines[first:number - 1]) + "\n"))
            start = None
    return found


def shell_commands() -> list[tuple[str, list[str]]]:
    """(page and line, argv) of every command of the pages' bash blocks but the set-up commands, in page order."""
    commands = []
    for page in DOCS:
        for first, code in blocks("bash", page):
            for line in code.replace("\\\n", " ").splitlines():
                if line.startswith(SETUP_PREFIX):
                    continue
                argv = shlex.split(line, comments=True)
                if argv:
                    commands.append((f"{page.relative_to(REPO)} line {first}", argv))
    return commands


def test_every_runnable_example_is_offline_and_a_kvcal_command():
    commands = shell_commands()
    assert len(commands) >= 10 and len(blocks("python")) >= 2
    assert not any(blocks("python", page) for page in DOCS[1:]), "Python examples live in the README (its test runs them)"
    for where, argv in commands:
        assert argv[0] == "kvcal", f"{where}: {argv}"
        assert "--model" not in argv, f"{where}: examples use the packaged model (or $KVCAL_MODEL)"
    for page in DOCS:
        for _, code in blocks("python", page) + blocks("bash", page):
            assert not re.search(r"HuggingFaceTB/|huggingface\.co|hf\.co/", code), code
            assert "smollm2/" not in code, "paths are where `kvcal calibrate` writes: artifacts/SmolLM2-135M-Instruct/"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_relative_link_of_the_readme_and_docs_resolves():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.relative_to(REPO)}: link to {target}: no such file"
            if anchor:
                assert anchor in anchors(resolved), f"{page.relative_to(REPO)}: link to {target}: no such heading"
            checked += 1
    assert checked >= 20


def test_the_results_in_the_readme_and_docs_are_generated_from_benchmarks_results():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_benchmark_command_of_the_readme_and_docs_names_a_module_and_mode_that_exist():
    """`python -m benchmarks.<harness> [MODE]` and `python -m tools.<tool>` in any page but results.md (whose records
    quote the commands as they ran at their commit): the module is there and, for a harness of modes, so is the mode
    (their options are each mode's own --help, checked by its tests)."""
    import importlib
    import importlib.util

    found = set()
    for page in (p for p in PAGES if p.name != "results.md"):
        found |= set(re.findall(r"python3? -m ((?:benchmarks|tools)\.[\w.]+)(?: ([a-z][\w-]*))?", page.read_text()))
    assert len(found) >= 8
    for module, mode in found:
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        modes = getattr(importlib.import_module(module), "MODES", None)
        if modes is not None:
            assert mode in modes, f"python -m {module} {mode}: no such mode (modes: {', '.join(modes)})"


def test_the_supported_architectures_table_names_every_model_type_kvcal_serves():
    """docs/models.md's table, which the README links to, against kvcal.adapters' list: an architecture added there is
    documented, one documented is served."""
    from kvcal.adapters import SUPPORTED_MODEL_TYPES

    rows = [line.split("|")[1] for line in (REPO / "docs" / "models.md").read_text().splitlines() if line.startswith("| `")]
    assert sorted(name for row in rows for name in re.findall(r"`([\w-]+)`", row)) == sorted(SUPPORTED_MODEL_TYPES)


def test_the_readme_reads_in_two_minutes():
    assert len(README.read_text().splitlines()) <= 200


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install torch==2.13.0")]
    assert len(commands) == 2, "the README has exactly two set-up commands"
    main_job, test_command = commands
    assert main_job.endswith("kvcal profile-gradients") or main_job.endswith("kvcal calibrate")
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


@pytest.fixture
def checkout(tmp_path, tiny_tokenizer, monkeypatch):
    """A temp checkout with ../shared/data/wikitext-2 beside it, and a tiny Llama named like the packaged model."""
    work = tmp_path / "checkout"
    work.mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "wikitext-2").symlink_to(WIKITEXT_VALID.parent)
    stand_in = tmp_path / "models" / "SmolLM2-135M-Instruct"
    tiny_model("llama", max_positions=1024, hidden_size=256).save_pretrained(stand_in)  # head_dim 64, KV width 128
    tiny_tokenizer.save_pretrained(stand_in)
    monkeypatch.chdir(work)
    return work, stand_in


@pytest.mark.model
def test_readme_shell_examples_run_as_written(checkout, wikitext_valid):
    work, stand_in = checkout
    env = {"KVCAL_MODEL": str(stand_in), **SCALED_DOWN}
    runner = CliRunner()
    for where, argv in shell_commands():
        result = runner.invoke(app, argv[1:], env=env)
        assert result.exit_code == 0, f"{where}: {shlex.join(argv)}\n{result.output}"
    for name in ("profile", "nuq", "skvq", "bundle", "kivi"):
        assert (work / ARTIFACTS / f"{name}.safetensors").is_file(), name
    assert (work / ARTIFACTS / "importance.png").stat().st_size > 10_000 and (work / "ppl.json").is_file()


@pytest.mark.model
def test_readme_python_runs_on_the_packaged_model(tmp_path, monkeypatch, capsys):
    import kvcal.models
    import kvcal.profile

    real_load_model, loaded = kvcal.models.load_model, {}

    def load_once(spec=None, dtype="auto", device="cpu"):
        if (spec, dtype, device) not in loaded:
            loaded[spec, dtype, device] = real_load_model(spec, dtype, device)
        return loaded[spec, dtype, device]

    monkeypatch.setattr(kvcal.models, "load_model", load_once)
    monkeypatch.setattr(kvcal.profile, "load_model", load_once)
    monkeypatch.chdir(tmp_path)
    calibrated = CliRunner().invoke(app, ["calibrate"], env={"KVCAL_MODEL": None, "KVCAL_CALIBRATE_NSAMPLES": "1",
                                                             "KVCAL_CALIBRATE_SEQLEN": "32"})
    assert calibrated.exit_code == 0, calibrated.output
    assert sorted(p.name for p in (tmp_path / ARTIFACTS).iterdir()) == ["bundle.safetensors", "nuq.safetensors", "profile.safetensors"]
    namespace = {"__name__": "__readme__"}
    for line, code in blocks("python"):
        if not transformers_from(5, 24):  # as the README's comment says: the argument's name before 5.24
            code = code.replace("cache=cache", "past_key_values=cache")
        exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)  # noqa: S102 - the README's own code
    assert len(loaded) == 1, "the README loads the model the calibration used"
    batch, out = namespace["batch"], namespace["out"]
    assert namespace["tokenizer"].padding_side == "left" and batch["attention_mask"][:, 0].tolist().count(0) == 1
    assert out.shape[0] == 2 and out.shape[1] > batch["input_ids"].shape[1]
    printed = capsys.readouterr().out
    assert printed.startswith("[") and "LayerRecipe(method='nuq', k_bits=3" in printed
