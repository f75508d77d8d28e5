"""The nine scripts/bench_*.py command lines: every invocation the docs, the scripts'
docstrings and scripts/gpu_check.sh show parses, each script's --help lists every field of its
Args, a value out of range is one line with exit status 2, and install_baselines.sh --help
prints its usage."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.conftest import script as load_script

SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py"))
TOKEN = re.compile(r"[\w.,:=+-]+|\.\./[\w./-]+")


def snippets(path: Path) -> list[str]:
    """The lines of code a reader would copy: a script's docstring lines, a markdown file's
    code blocks line by line and its inline code spans (which may wrap)."""
    text = path.read_text()
    if path.suffix == ".py":
        return text.replace("\\\\\n", " ").splitlines()
    text = text.replace("\\\n", " ")
    lines = [ln for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
             for ln in block.splitlines()]  # fmt: skip
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return lines + [span.replace("\n", " ") for span in spans]


def documented_commands() -> list[tuple[str, tuple[str, ...]]]:
    """Each ``scripts/bench_X.py FLAGS`` shown, as (script, flags); the flags end at a word
    that is not one (a comment, prose, a placeholder), and a command with a shell variable in
    its flags is left out."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "scripts").glob("bench_*.py"))]  # fmt: skip
    found = []
    for path in files:
        for line in snippets(path):
            for match in re.finditer(r"scripts/(bench_\w+)\.py((?:[ \t]+\S+)*)", line):
                tokens: list[str] | None = []
                for token in match.group(2).split():
                    if "$" in token:
                        tokens = None
                        break
                    if not TOKEN.fullmatch(token) or token.endswith(":"):
                        break
                    tokens.append(token)
                if tokens is not None:
                    found.append((match.group(1), tuple(tokens)))
    return sorted(set(found))


def gpu_check_commands() -> list[tuple[str, tuple[str, ...]]]:
    """scripts/gpu_check.sh's argument arrays (quick and full), with the script each feeds."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    feeds = {"MAML": ("bench_maml", ()), "HVP": ("bench_hvp", ()),
             "CHUNKS": ("bench_chunks", ()),
             "COMPILE": ("bench_maml", ("--methods", "auto,compile"))}  # fmt: skip
    found = []
    for name, values in re.findall(r"^\s*(MAML|HVP|CHUNKS|COMPILE)=\((.*)\)$", text, re.M):
        script, extra = feeds[name]
        found.append((script, ("--device", "cuda", *extra, *values.split())))
    return found


COMMANDS = documented_commands()
GPU_CHECK = gpu_check_commands()


def test_the_commands_are_found_for_every_script() -> None:
    # the extraction itself: it must see the documented commands, not silently none
    assert {script for script, _ in COMMANDS} == set(SCRIPTS)
    assert len([flags for _, flags in COMMANDS if flags]) >= 30
    assert len(GPU_CHECK) == 8  # four arrays, quick and full


@pytest.mark.parametrize(("script", "flags"), COMMANDS + GPU_CHECK)
def test_every_shown_command_parses(script: str, flags: tuple[str, ...]) -> None:
    load_script(script).parse_args(list(flags))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_field_as_a_flag_and_exits_0(script: str, capsys) -> None:
    module = load_script(script)
    with pytest.raises(SystemExit) as stop:
        module.parse_args(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    args = getattr(module, "Args", None) or module.BenchArgs
    for field in dataclasses.fields(args):
        assert "--" + field.name.replace("_", "-") in out, field.name


def test_flag_values_reach_their_fields() -> None:
    bench_claims, bench_hvp, bench_maml = map(
        load_script, ("bench_claims", "bench_hvp", "bench_maml")
    )
    hvp = bench_hvp.parse_args("--hessian-sizes 100 300 1000 --clock cpu".split())
    assert hvp.hessian_sizes == (100, 300, 1000) and hvp.clock == "cpu"
    assert (hvp.repeats, hvp.warmup) == (21, 2)
    quick = bench_hvp.parse_args(["--quick"])
    assert (quick.repeats, quick.warmup, quick.hessian_sizes) == (3, 1, (100, 300, 1000))
    assert bench_hvp.parse_args(["--quick", "--repeats", "7"]).repeats == 7
    maml = bench_maml.parse_args("--settings q1-second,q15-first --methods auto loop".split())
    assert maml.settings == ["q1-second", "q15-first"] and maml.methods == ["auto", "loop"]
    quick = bench_maml.parse_args(["--quick", "--repeats", "9"])
    assert (quick.repeats, quick.warmup, quick.memory) == (3, 1, False)
    claims = bench_claims.parse_args("--only sparse --only branch --scale 0".split())
    assert claims.only == ("sparse", "branch") and claims.scale == 0
    assert bench_claims.parse_args([]).only == ()


BAD = [
    ("bench_anomaly_guard", "--threads 0", "--threads 0: both must be at least 1"),
    ("bench_anomaly_guard", "--vectorize auto2", "invalid choice 'auto2' for argument"),
    ("bench_chunks", "--settings q1-first,q0-second", "--settings: unknown setting 'q0-second'"),
    ("bench_chunks", "--repeats 0", "--repeats and --max-examples must be at least 1"),
    ("bench_claims", "--only nothing", "invalid choice 'nothing' for argument '--only'"),
    ("bench_curvature", "--threads 0", "every count must be at least 1"),
    ("bench_distributed", "--meta-batch 1", "--meta-batch must be >= 2"),
    ("bench_distributed", "--worker", "--worker needs --out"),
    ("bench_hvp", "--max-hessian-gb 0", "--max-hessian-gb must be > 0"),
    ("bench_hvp", "--hessian-sizes 100 0", "--hessian-sizes must be >= 1, got [100, 0]"),
    ("bench_maml", "--methods auto,jax", "--methods: unknown jax; choose from loop"),
    ("bench_maml", "--settings q1-third", "--settings: unknown setting 'q1-third'"),
    ("bench_maml", "--repeat 3", "unknown option --repeat; did you mean --repeats"),
    ("bench_sampler", "--tasks 0", "--tasks, --repeats and --threads must be at least 1"),
    ("bench_sampler", "--split background", "invalid choice 'background' for argument"),
]


@pytest.mark.parametrize(("script", "argv", "message"), BAD)
def test_a_refused_value_is_one_line_and_exit_2(script: str, argv: str, message: str,
                                               capsys) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        load_script(script).parse_args(argv.split())
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_install_baselines_help_prints_its_usage_and_refuses_the_rest(tmp_path: Path) -> None:
    script = str(ROOT / "scripts" / "install_baselines.sh")
    done = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: bash scripts/install_baselines.sh [VENV_DIR]\n")
    assert "TORCH_SPEC" in done.stdout and ".venv-baselines" in done.stdout
    two = [str(tmp_path / "a"), str(tmp_path / "b")]
    for argv, message in ((["--upgrade"], "unknown option --upgrade"),
                          (two, "at most one argument")):  # fmt: skip
        done = subprocess.run(["bash", script, *argv], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and message in done.stderr and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing was created
