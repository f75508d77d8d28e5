"""Claim 3: an HVP uses ~90% less memory and is 3-5x faster than forming the Hessian.

One Hessian-vector product (`metalearn.hvp`, forward-over-reverse) against the dense
Hessian (`metalearn.hessian(method="vmap")`, ``torch.func.hessian``) of the cross-entropy
of ``MLP(32, [h], 5)`` on a batch of 80, for widths ``h`` that give n = 100 ... 10,000
parameters. Time: CPU, median, interleaved. Memory: peak tensor bytes allocated during the
call above those live before it (``torch.profiler`` memory events, as `bench_hvp` does).
Sizes whose dense Hessian would need more than ``MAX_HESSIAN_GB`` are skipped and the
size at which it stops fitting in this machine's RAM is extrapolated.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from claims.common import (
    Config,
    median_ms,
    peak_memory_bytes,
    print_table,
    progress,
    time_interleaved,
)
from metalearn import hessian, hvp
from metalearn.functional import flatten_tree
from metalearn.models import MLP

__all__ = ["Problem", "make_problem", "run"]

IN_FEATURES, WAYS, BATCH = 32, 5, 80
SIZES = (100, 300, 1000, 3000, 10000)
MAX_HESSIAN_GB = 4.0


class Problem:
    """The loss of one MLP on one batch, as a function of its parameter dict."""

    def __init__(self, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        self.model: nn.Module = MLP(IN_FEATURES, [hidden], WAYS).to(dtype)
        g = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(BATCH, IN_FEATURES, generator=g, dtype=dtype)
        self.y = torch.randint(0, WAYS, (BATCH,), generator=g)
        self.params = {k: p.detach() for k, p in self.model.named_parameters()}
        self.v = {k: torch.randn(p.shape, generator=g, dtype=dtype) for k, p in self.params.items()}
        self.n = sum(p.numel() for p in self.params.values())

    def loss(self, params: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(functional_call(self.model, params, (self.x,)), self.y)

    def hessian(self) -> Tensor:
        """The dense ``[n, n]`` Hessian."""
        return hessian(self.loss, self.params, method="vmap")

    def hvp(self) -> Tensor:
        """H v, flattened ``[n]``."""
        return flatten_tree(hvp(self.loss, self.params, self.v))


def make_problem(target_params: int, dtype: torch.dtype = torch.float32) -> Problem:
    """The one-hidden-layer MLP whose parameter count is nearest ``target_params``."""
    hidden = max(1, round((target_params - WAYS) / (IN_FEATURES + 1 + WAYS)))
    return Problem(hidden, dtype=dtype)


def measure(problem: Problem, cfg: Config) -> dict[str, float]:
    fns = {"hessian": problem.hessian, "hvp": problem.hvp}
    repeats = cfg.repeats if problem.n < 3000 else max(1, min(cfg.repeats, 3))
    times = time_interleaved(fns, repeats, 1)
    peaks = {k: peak_memory_bytes(f, torch.device("cpu")) for k, f in fns.items()}
    H = problem.hessian()
    v = flatten_tree(problem.v)
    error = float((H @ v - problem.hvp()).abs().max() / (H @ v).abs().max())
    return {
        "n": problem.n,
        "hessian_ms": median_ms(times["hessian"]),
        "hvp_ms": median_ms(times["hvp"]),
        "hessian_mb": peaks["hessian"] / 2**20,
        "hvp_mb": peaks["hvp"] / 2**20,
        "h_mb": problem.n**2 * 4 / 2**20,
        "rel_error": error,
    }


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run(cfg: Config) -> None:
    sizes = SIZES[:3] if cfg.quick else SIZES
    rows: list[dict[str, float]] = []
    overhead = 1.0  # measured Hessian peak / the n x n matrix itself, at the last size run
    for target in sizes:
        problem = make_problem(target)
        predicted = overhead * problem.n**2 * 4
        if predicted > MAX_HESSIAN_GB * 2**30:
            progress(f"claim 3: n={problem.n:,} skipped, needs ~{predicted / 2**30:.1f} GB")
            rows.append({"n": problem.n, "skipped_gb": predicted / 2**30})
            continue
        progress(f"claim 3: n={problem.n:,}")
        row = measure(problem, cfg)
        overhead = max(1.0, row["hessian_mb"] / row["h_mb"])
        rows.append(row)
    fits = int((ram_bytes() / (4 * overhead)) ** 0.5)
    cfg.results["hessian"] = {"rows": rows, "overhead": overhead, "max_n_in_ram": fits}
    print_rows(rows)
    print(
        f"\nHessian peak = {overhead:.1f}x the n^2 float32 matrix at the largest size run; "
        f"with {ram_bytes() / 2**30:.0f} GB RAM the dense Hessian stops fitting near n = {fits:,}"
    )


def print_rows(rows: list[dict[str, float]]) -> None:
    print(f"\n### Claim 3: dense Hessian vs one HVP, MLP({IN_FEATURES}, [h], {WAYS}), batch 80\n")
    table = []
    for r in rows:
        if "skipped_gb" in r:
            table.append([f"{r['n']:,}", f"skipped: needs ~{r['skipped_gb']:.1f} GB"])
            continue
        table.append(
            [f"{r['n']:,}", f"{r['hessian_ms']:.1f}", f"{r['hvp_ms']:.2f}"]
            + [
                f"{r['hessian_ms'] / r['hvp_ms']:.1f}",
                f"{r['hessian_ms'] / r['n'] / r['hvp_ms']:.3f}",
            ]
            + [f"{r['hessian_mb']:.2f}", f"{r['hvp_mb']:.3f}"]
            + [f"{100 * (1 - r['hvp_mb'] / r['hessian_mb']):.2f}%", f"{r['rel_error']:.1e}"]
        )
    header = ["n params", "Hessian ms", "HVP ms", "time ratio", "Hessian / (n HVPs)"]
    header += ["Hessian peak MB", "HVP peak MB", "memory saved", "H@v vs hvp"]
    print_table(header, table)
