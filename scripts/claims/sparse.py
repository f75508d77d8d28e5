"""Claim 2: sparse COO vs CSR vs dense, storage and matmul time at several densities.

A square weight (or adjacency) matrix ``[n, n]`` with a uniformly random fraction
``density`` of non-zeros, times a dense ``[n, k]`` matrix. Storage is counted from the
tensors themselves: dense ``n*n`` values; COO its ``[2, nnz]`` int64 indices and ``nnz``
values; CSR its ``[n+1]`` row pointers, ``[nnz]`` column indices and ``nnz`` values.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from claims.common import Config, median_ms, print_table, progress, time_interleaved

__all__ = ["formats", "random_sparse", "run", "storage_bytes"]

DENSITIES = (0.001, 0.01, 0.1, 0.5)


def random_sparse(n: int, density: float, seed: int = 0) -> Tensor:
    """A dense ``[n, n]`` float32 matrix with about ``density * n * n`` non-zeros."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, n, generator=g) < density
    return torch.randn(n, n, generator=g) * mask


def formats(dense: Tensor) -> dict[str, Tensor]:
    """The same matrix as ``dense``, ``coo`` (coalesced) and ``csr``."""
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = dense.to_sparse_csr()
    return {"dense": dense, "coo": dense.to_sparse_coo().coalesce(), "csr": csr}


def storage_bytes(t: Tensor) -> int:
    """Bytes held by the tensor's own buffers (values plus any index arrays)."""
    if t.layout == torch.sparse_coo:
        parts = [t.indices(), t.values()]
    elif t.layout == torch.sparse_csr:
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    else:
        parts = [t]
    return sum(p.numel() * p.element_size() for p in parts)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for any of the three layouts (``torch.sparse.mm`` for COO)."""
    return torch.sparse.mm(a, b) if a.layout == torch.sparse_coo else a @ b


def run(cfg: Config) -> None:
    n, k = (512, 64) if cfg.quick else (4096, 64)
    rhs = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    rows, table = [], []
    for density in DENSITIES:
        progress(f"claim 2: density {density:g}")
        mats = formats(random_sparse(n, density))
        fns = {name: lambda m=m: matmul(m, rhs) for name, m in mats.items()}
        times = time_interleaved(fns, cfg.repeats, cfg.warmup)
        ms = {name: median_ms(t) for name, t in times.items()}
        mb = {name: storage_bytes(m) / 2**20 for name, m in mats.items()}
        rows.append({"density": density, "ms": ms, "mb": mb})
        table.append(
            [f"{100 * density:g}%"]
            + [f"{mb[f]:.1f}" for f in mats]
            + [f"{ms[f]:.2f}" for f in mats]
            + [f"{ms['dense'] / ms['coo']:.2f}", f"{ms['dense'] / ms['csr']:.2f}"]
        )
    cfg.results["sparse"] = {"n": n, "k": k, "rows": rows}
    print(f"\n### Claim 2: [{n}, {n}] sparse x [{n}, {k}] dense (float32)\n")
    header = ["density", "dense MB", "COO MB", "CSR MB", "dense ms", "COO ms", "CSR ms"]
    print_table([*header, "dense/COO time", "dense/CSR time"], table)
