"""Claims 5 and 6, measured: time, peak memory and agreement of each meta-step method.

Time: CPU time of one meta-step, median over repeats, methods interleaved, after the first
call (which for compiled methods is the compilation, timed separately by the wall clock,
from an empty inductor cache unless ``--warm-cache``). Peak memory: a fresh subprocess per
method and inner-step count runs one meta-step (compiling if needed), resets the kernel's
RSS high-water mark (``/proc/self/clear_refs``), runs one more and reports the peak RSS above
the RSS at that step's start; glibc's mmap threshold is pinned so freed tensors leave RSS
(the method of ``scripts/bench_maml.py``). Agreement: each method's float32 meta-gradient
against the eager loop's in float64, ``max|g - ref| / max|ref|``.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch._dynamo
from bench_maml import peak_step_mb, run_memory_probe

from claims.common import Config, median_ms, print_table, progress, time_interleaved
from claims.metastep import (
    COMPILED,
    EAGER,
    Workload,
    make_step,
    max_relative_difference,
    meta_gradient,
)

__all__ = ["measure_steps", "memory_in_subprocess", "probe_memory", "run"]


def probe_memory(method: str, work: Workload) -> float:
    """Peak RSS above the starting RSS of one warmed-up meta-step, MB (this process)."""
    tasks = work.make_tasks()
    step = make_step(method, work)
    return peak_step_mb(lambda: step(tasks))


def memory_in_subprocess(method: str, work: Workload) -> float | None:
    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_claims.py"
    )
    cmd = [
        sys.executable, script, "--probe-memory", f"{method}:{work.steps}",
        "--tasks", str(work.tasks), "--hidden", str(work.hidden),
    ]  # fmt: skip
    return run_memory_probe(cmd, f"{method} at {work.steps} steps")


def first_calls(
    methods: list[str], work: Workload, float64: bool = False
) -> tuple[dict, dict[str, dict[str, float]]]:
    """Build each method's step; its first call (compilation) timed, its gradient checked.

    With ``float64``, compiled methods are also compiled in float64 (another compilation)
    and compared with the float64 loop: that separates wrong maths from float32 rounding.
    """
    tasks, tasks64 = work.make_tasks(), work.make_tasks(torch.float64)
    reference = meta_gradient(make_step("loop", work, torch.float64), tasks64)
    steps, info = {}, {}
    for method in methods:
        progress(f"claims 5/6: {work.steps} inner steps, first call of {method}")
        steps[method] = make_step(method, work)
        torch._dynamo.utils.counters.clear()
        start = time.perf_counter()
        grads = meta_gradient(steps[method], tasks)
        info[method] = {
            "first_call_s": time.perf_counter() - start,
            "rel_diff": max_relative_difference(grads, reference),
            # A graph break inside vmap makes dynamo run the whole frame eagerly: then
            # no graph is compiled, which the break count alone (deduplicated) hides.
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        }
        if float64 and method in COMPILED:
            progress(f"claims 5/6: {work.steps} inner steps, {method} in float64")
            exact = meta_gradient(make_step(method, work, torch.float64), tasks64)
            info[method]["rel_diff_float64"] = max_relative_difference(exact, reference)
    return steps, info


def measure_steps(methods: list[str], work: Workload, cfg: Config, memory: bool = True) -> dict:
    """Time (interleaved), first-call time, gradient agreement and peak memory per method."""
    steps, info = first_calls(methods, work, cfg.compile_float64)
    tasks = work.make_tasks()
    repeats = min(cfg.repeats, 7) if work.steps <= 5 else min(cfg.repeats, 5)
    progress(f"claims 5/6: {work.steps} inner steps, timing {len(methods)} methods x {repeats}")
    fns = {m: lambda s=steps[m]: s(tasks) for m in methods}
    times = time_interleaved(fns, repeats, 1)
    for method in methods:
        info[method]["ms"] = median_ms(times[method])
    del steps, fns
    gc.collect()
    for method in methods if memory else []:
        progress(f"claims 5/6: {work.steps} inner steps, peak memory of {method}")
        info[method]["mb"] = memory_in_subprocess(method, work)
    return info


def run(cfg: Config) -> None:
    """Claims 5 and 6 share their measurements: one run prints both tables."""
    ks = sorted(set(cfg.checkpoint_steps) | set(cfg.compile_steps))
    by_k = {}
    for k in ks:
        methods = ["loop", "loop+ckpt"]
        if k in cfg.compile_steps:
            methods += ["vmap", *COMPILED]
        by_k[k] = measure_steps(methods, Workload(k, tasks=cfg.tasks, hidden=cfg.hidden), cfg)
    cfg.results["metastep"] = {"tasks": cfg.tasks, "by_steps": by_k}
    report_checkpoint({k: r for k, r in by_k.items() if k in cfg.checkpoint_steps})
    report_compile({k: r for k, r in by_k.items() if k in cfg.compile_steps})


def _mb(row: dict) -> str:
    return "failed" if row.get("mb") is None else f"{row['mb']:.0f}"


def report_checkpoint(by_k: dict[int, dict]) -> None:
    if not by_k:
        return
    print("\n### Claim 5b: inner-loop checkpointing (eager loop), median ms and peak MB\n")
    table = []
    for k, r in by_k.items():
        plain, ckpt = r["loop"], r["loop+ckpt"]
        mem = f"{ckpt['mb'] / plain['mb']:.2f}" if plain.get("mb") and ckpt.get("mb") else ""
        table.append(
            [str(k), f"{plain['ms']:.0f}", f"{ckpt['ms']:.0f}", f"{ckpt['ms'] / plain['ms']:.2f}"]
            + [_mb(plain), _mb(ckpt), mem, f"{plain['rel_diff']:.1e}", f"{ckpt['rel_diff']:.1e}"]
        )
    header = ["inner steps", "loop ms", "loop+ckpt ms", "time ratio", "loop MB", "loop+ckpt MB"]
    print_table([*header, "memory ratio", "loop grad vs float64", "ckpt grad vs float64"], table)


def report_compile(by_k: dict[int, dict]) -> None:
    if not by_k:
        print("\n(claims 5a and 6 not run: no --compile-steps)")
        return
    print("\n### Claim 5a: torch.compile of the vmapped meta-loss, and claim 6: combined\n")
    table = []
    for k, r in by_k.items():
        for m in ["loop", *EAGER[1:], *COMPILED]:
            row = r[m]
            compile_s = f"{row['first_call_s']:.0f}" if m in COMPILED else ""
            table.append(
                [str(k), m, f"{row['ms']:.0f}", f"{row['ms'] / r['loop']['ms']:.2f}"]
                + [f"{row['ms'] / r['vmap']['ms']:.2f}", _mb(row), compile_s]
                + [_graphs(row) if m in COMPILED else "", f"{row['rel_diff']:.1e}"]
            )
    header = ["inner steps", "method", "ms", "x loop", "x vmap", "peak MB", "first call s"]
    print_table([*header, "graphs / breaks", "grad vs float64"], table)
    for k, r in by_k.items():
        for m in COMPILED:
            if "rel_diff_float64" in r[m]:
                print(
                    f"{k} inner steps, {m} compiled in float64 vs float64 loop: "
                    f"{r[m]['rel_diff_float64']:.1e}"
                )


def _graphs(row: dict) -> str:
    return f"{row.get('graphs', '?')} / {row['graph_breaks']}"
