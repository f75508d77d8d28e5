"""The README's set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_main_and_test_commands():
    main_cmd, test_cmd = _readme_commands()
    assert "experiments/" in main_cmd
    assert "pytest" in test_cmd


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = _readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines


def test_main_command_script_exists():
    main_cmd = _readme_commands()[0]
    script = next(tok for tok in main_cmd.split() if tok.startswith("experiments/"))
    assert (ROOT / script).is_file()
