"""The README's set-up commands are the ones CI runs."""

import math

import pytest
import torch

from tests.conftest import ROOT, needs_omniglot


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


def test_the_first_screen_runs_without_local_paths_and_ci_then_runs_the_slow_tests():
    main_cmd, test_cmd = _readme_commands()
    assert "--data-root" not in main_cmd and "../" not in main_cmd  # $METALEARN_DATA, or download
    assert test_cmd.endswith('pytest -q -m "not slow"')  # the quick subset
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    slow = ci_lines.index(".venv/bin/python -m pytest -q -m slow")
    lint = next(i for i, line in enumerate(ci_lines) if "ruff check" in line)
    assert ci_lines.index(test_cmd) < slow < lint


def test_main_command_script_exists():
    main_cmd = _readme_commands()[0]
    script = next(tok for tok in main_cmd.split() if tok.startswith("experiments/"))
    assert (ROOT / script).is_file()


def _python_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


def test_readme_hvp_example_runs_and_matches_its_dense_hessian():
    code = next(block for block in _python_examples() if "hvp(" in block)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # the example as a user pastes it
    params, v, hv, H = scope["params"], scope["v"], scope["hv"], scope["H"]
    flat_v = torch.cat([v[k].reshape(-1) for k in params])
    flat_hv = torch.cat([hv[k].reshape(-1) for k in params])
    torch.testing.assert_close(flat_hv, H @ flat_v, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # it trains: 9-13 s on 2 cores
@needs_omniglot  # the example's load_omniglot() finds it through $METALEARN_DATA (conftest.py)
def test_readme_engine_example_trains_and_evaluates():
    code = next(block for block in _python_examples() if "learner.backward" in block)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["metrics"].skipped == 0 and math.isfinite(scope["metrics"].loss)
    assert scope["accuracies"].shape == (8,) and scope["losses"].isfinite().all()
    assert all(p.grad is not None for p in scope["learner"].parameters())
