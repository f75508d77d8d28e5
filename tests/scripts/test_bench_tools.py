"""scripts/benchtools.py: interleaved timing order, the CPU peak-memory count (no timings), and
that it is the one module of scripts/ the scripts import."""

from __future__ import annotations

import ast

import torch

from tests.conftest import ROOT, script

SCRIPTS = ROOT / "scripts"
benchtools = script("benchtools")


def test_round_robin_rotates_the_starting_function_and_times_each_call() -> None:
    calls: list[str] = []
    ticks = iter(range(1000))
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = benchtools.time_round_robin(
        fns, repeats=3, warmup=1, device="cpu", clock=lambda: next(ticks)
    )
    # warm-up in the given order, then each repeat starts one function later
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    # a call is timed as the difference of two clock reads taken around it alone
    assert times == {"a": [1, 1, 1], "b": [1, 1, 1], "c": [1, 1, 1]}


def test_cpu_peak_memory_counts_a_temporary_tensor() -> None:
    n = 1 << 20  # 4 MiB of float32, freed before the call returns

    def make_and_drop() -> None:
        x = torch.empty(n, dtype=torch.float32)
        x.fill_(1.0)

    peak = benchtools.peak_memory_bytes(make_and_drop, "cpu")
    assert 4 * n <= peak < 4 * n + 4096


def imported_modules(source: str) -> set[str]:
    """The top-level names of the modules ``source`` imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_script_imports_another_only_benchtools() -> None:
    # What two scripts share lives in benchtools; a script importing another script turns
    # that script into a library whose changes break its importers.
    files = sorted(SCRIPTS.glob("*.py"))
    scripts = {f.stem for f in files}
    assert "benchtools" in scripts and "bench_maml" in scripts
    imports = {f.name: imported_modules(f.read_text()) & scripts for f in files}
    others = {name: found - {"benchtools"} for name, found in imports.items()}
    assert {name: found for name, found in others.items() if found} == {}
    assert imports["benchtools.py"] == set() and "benchtools" in imports["bench_maml.py"]


def test_the_import_check_sees_every_form_of_import() -> None:
    source = "import bench_maml\nfrom bench_hvp.x import y\nimport os.path as p\nfrom . import z\n"
    assert imported_modules(source) == {"bench_maml", "bench_hvp", "os"}
