"""Plots of the curves in ``docs/claims.md`` (matplotlib, from the dev extra)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["write_plots"]


def write_plots(results: dict[str, Any], folder: str) -> list[str]:
    """Write ``claims_hvp.png`` and ``claims_checkpoint.png`` where the data exist."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    if "hessian" in results:
        written.append(_hessian_plot(results["hessian"], os.path.join(folder, "claims_hvp.png")))
    by_k = results.get("metastep", {}).get("by_steps", {})
    if by_k:
        written.append(_checkpoint_plot(by_k, os.path.join(folder, "claims_checkpoint.png")))
    return written


def _hessian_plot(data: dict[str, Any], path: str) -> str:
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if "skipped_gb" not in r]
    n = [r["n"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax_t.loglog(n, [r["hessian_ms"] for r in rows], "o-", label="dense Hessian")
    ax_t.loglog(n, [r["hvp_ms"] for r in rows], "s-", label="one HVP")
    ax_t.set(xlabel="parameters n", ylabel="CPU ms (median)", title="time")
    ax_m.loglog(n, [r["hessian_mb"] for r in rows], "o-", label="dense Hessian")
    ax_m.loglog(n, [max(r["hvp_mb"], 1e-3) for r in rows], "s-", label="one HVP")
    ax_m.set(xlabel="parameters n", ylabel="peak MB", title="peak tensor memory")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("MLP(32, [h], 5), batch 80, float32, 1 CPU thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _checkpoint_plot(by_k: dict[Any, Any], path: str) -> str:
    import matplotlib.pyplot as plt

    ks = sorted(by_k, key=int)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6))
    for method, marker in (("loop", "o-"), ("loop+ckpt", "s-")):
        ax_t.plot([int(k) for k in ks], [by_k[k][method]["ms"] for k in ks], marker, label=method)
        mb = [(int(k), by_k[k][method].get("mb")) for k in ks]
        ax_m.plot([k for k, m in mb if m], [m for _, m in mb if m], marker, label=method)
    ax_t.set(xlabel="inner steps", ylabel="CPU ms per meta-step", title="time")
    ax_m.set(xlabel="inner steps", ylabel="peak MB above step start", title="peak memory (RSS)")
    for ax in (ax_t, ax_m):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("MAML meta-step, Conv4, 16 tasks 5-way 1-shot 5 query, second order")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
