"""Measure six widely repeated PyTorch performance claims on this library's workloads.

What: each claim (1-6 below) timed on metalearn's real workloads, methods interleaved,
ratios against a baseline measured in the same run; the verdicts live in ``docs/claims.md``.

1. non-contiguous (transposed) tensors make ops 15-30% slower, and ``.view`` fails on them
   (`claims.contiguity`);
2. sparse COO vs CSR vs dense: storage and matmul time at several densities (`claims.sparse`);
3. an HVP uses ~90% less memory and is 3-5x faster than forming the Hessian, over model
   size (`claims.hessian_curve`);
4. a conditional skip branch (`DynamicBlock`) speeds inference ~20% (`claims.branch`);
5. ``torch.compile`` of a MAML meta-step, and checkpointing of the inner loop, over 1-20
   inner steps: time and peak memory (`claims.metastep`, `claims.metastep_bench`);
6. compile + checkpointing combined: ~40% faster and ~60% less memory (measured with 5).

Timing is this process's CPU time with one torch thread (the machine is shared), median
over repeats after warm-up, methods round-robin. Compilation starts from an empty inductor
cache (a temporary directory) unless ``--warm-cache``; on 2 cores it takes minutes per
inner-step count, so compile runs only at ``--compile-steps`` (default 1 and 5).

Command::

    .venv/bin/python scripts/bench_claims.py                  # all, ~25 min on 2 cores
    .venv/bin/python scripts/bench_claims.py --only 3 --only 4
    .venv/bin/python scripts/bench_claims.py --quick          # tiny sizes, no compile
    .venv/bin/python scripts/bench_claims.py --json out.json --plots docs

Expected: one markdown table per claim (claims 5 and 6 share one run and print together).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence

import torch
from claims import branch, contiguity, hessian_curve, metastep_bench, sparse
from claims.common import Config, hardware, progress
from claims.metastep import Workload

CLAIMS = {
    "1": contiguity.run,
    "2": sparse.run,
    "3": hessian_curve.run,
    "4": branch.run,
    "5": metastep_bench.run,
}
"""Claim number -> its run; claim 6 is measured by claim 5's run (``--only 6`` runs it)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=[*CLAIMS, "6"], help="repeatable")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats, no compile")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 11)")
    p.add_argument("--compile-steps", type=int, nargs="*", default=None, help="default 1 5")
    p.add_argument("--checkpoint-steps", type=int, nargs="*", default=None, help="1 5 10 20")
    p.add_argument("--tasks", type=int, default=16, help="tasks per meta-batch (claims 5, 6)")
    p.add_argument("--hidden", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument(
        "--compile-float64", action="store_true", help="check compiled maths in float64 too"
    )
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache")
    p.add_argument("--json", default="", help="write every number measured to this file")
    p.add_argument("--plots", default="", help="write claims_*.png plots into this folder")
    p.add_argument("--probe-memory", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if any(k < 1 for k in (args.compile_steps or []) + (args.checkpoint_steps or [])):
        p.error("inner-step counts must be >= 1")
    return args


def make_config(args: argparse.Namespace) -> Config:
    cfg = Config(quick=args.quick, tasks=args.tasks, hidden=args.hidden)
    cfg.compile_float64 = args.compile_float64
    if args.quick:
        cfg.repeats, cfg.warmup, cfg.compile_steps, cfg.checkpoint_steps = 3, 1, [], [1, 2]
        cfg.tasks, cfg.hidden = min(args.tasks, 4), min(args.hidden, 16)
    cfg.repeats = args.repeats or cfg.repeats
    if args.compile_steps is not None:
        cfg.compile_steps = args.compile_steps
    if args.checkpoint_steps is not None:
        cfg.checkpoint_steps = args.checkpoint_steps
    return cfg


@contextlib.contextmanager
def cold_compile_cache(cold: bool) -> Iterator[None]:
    """An empty inductor cache for the run (removed after it), so compile times are cold.

    The memory subprocesses inherit it, by then warm. Importing ``torch._inductor`` already
    set ``TORCHINDUCTOR_CACHE_DIR`` to its default, so it is overridden, then restored.
    """
    if not cold:
        yield
        return
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = tempfile.mkdtemp(prefix="bench_claims_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> Config:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.probe_memory:  # internal: one method's peak memory, in a fresh process
        method, steps = args.probe_memory.split(":")
        work = Workload(int(steps), tasks=args.tasks, hidden=args.hidden)
        print(json.dumps({"peak_mb": metastep_bench.probe_memory(method, work)}))
        return Config()
    cfg = make_config(args)
    only = sorted({"5" if c == "6" else c for c in args.only or CLAIMS})
    print(f"# Performance claims, measured\n\n{hardware()}\ncommand: {' '.join(sys.argv)}\n")
    with cold_compile_cache("5" in only and bool(cfg.compile_steps) and not args.warm_cache):
        for claim in only:
            progress(f"claim {claim}{' (and 6)' if claim == '5' else ''}")
            CLAIMS[claim](cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware(), **cfg.results}, f, indent=1)
    if args.plots:
        from claims.plots import write_plots

        write_plots(cfg.results, args.plots)
    return cfg


if __name__ == "__main__":
    main()
