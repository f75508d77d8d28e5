"""Conjugate gradient as aravindr93/imaml_dev's ``cg_solve`` runs it, written out in float64.

The reference (implicit_maml/utils.py, ``cg_solve``) starts from 0, takes
``alpha = r'r / p'Ap`` whatever the sign of ``p'Ap``, and stops after its steps or when
``r'r`` is below its tolerance. Here on a dense matrix, with every iterate and curvature
kept, so a test can read "continue" (the last iterate) and "stop" (the iterate before the
first ``p'Ap <= 0``) from it.
"""

from __future__ import annotations

import torch


def written_out_cg(
    a: torch.Tensor, b: torch.Tensor, steps: int
) -> list[tuple[torch.Tensor, float]]:
    """``[(x_k, p_k' A p_k) for k < steps] + [(x_steps, nan)]``: Hestenes-Stiefel from 0."""
    x, r = torch.zeros_like(b), b.clone()
    p, out = r.clone(), []
    for _ in range(steps):
        ap = a @ p
        curvature = float(p @ ap)
        alpha = float(r @ r) / curvature
        out.append((x.clone(), curvature))
        x = x + alpha * p
        r_new = r - alpha * ap
        p = r_new + float(r_new @ r_new) / float(r @ r) * p
        r = r_new
    out.append((x, float("nan")))
    return out


def first_negative_curvature(iterates: list[tuple[torch.Tensor, float]]) -> int | None:
    """The first k with ``p_k' A p_k <= 0`` in `written_out_cg`'s list, or None."""
    return next((k for k, (_, c) in enumerate(iterates[:-1]) if c <= 0), None)
