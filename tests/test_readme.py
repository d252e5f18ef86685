"""CI runs the README's test command: keep .ci/run and README.md in step."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install torch==2.13.0")]
    assert len(commands) == 2, "the README has exactly two set-up commands"
    main_job, test_command = commands
    assert main_job.endswith("kvcal profile-gradients") or main_job.endswith("kvcal calibrate")
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()
