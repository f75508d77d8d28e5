"""The outer step of MAML-TRPO (Finn et al., 2017, Sec. 5.3; Schulman et al., 2015).

maximise L(theta) subject to mean KL(pi_old || pi_theta) <= max_kl, with L and the KL those
of the adapted policies (`metalearn.rl.meta_objective.MetaObjective`), as in maml_rl.
The step direction is ``x = (F + damping I)^{-1} g``, g the surrogate's gradient and F the
KL's Hessian at theta_old (the Fisher information of the adapted policies through the inner
step), solved by `metalearn.second_order.conjugate_gradient` on exact Hessian-vector
products (`metalearn.second_order.hvp`; the paper's code took finite differences, to avoid
third derivatives). The step is scaled to the KL boundary of the quadratic model,
``sqrt(2 max_kl / x' (F + damping I) x) x``, then shortened by a backtracking line search
until the surrogate improves and the KL is within max_kl; a step that never passes is
rejected and theta kept. Defaults are rllab's ``ConjugateGradientOptimizer`` (as maml_rl
uses it): 10 CG iterations, damping 1e-5, 15 backtracks of ratio 0.8, max KL 0.01.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from metalearn.functional import tree_axpy, tree_dot
from metalearn.second_order import HVPMethod, conjugate_gradient, hvp

__all__ = ["TRPO", "TRPOResult"]

Objective = Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]
"""``params -> (surrogate [], mean KL [])``: the surrogate to maximise and the constraint."""


@dataclass
class TRPOResult:
    """One TRPO step's outcome (plain numbers except the parameters and the direction)."""

    params: dict[str, Tensor]
    """The new parameters (theta itself, detached, when the step was rejected)."""
    direction: dict[str, Tensor]
    """The CG solution x of (F + damping I) x = g."""
    accepted: bool
    surrogate_before: float
    surrogate_after: float
    kl: float
    """The mean KL at the accepted step (0 when rejected)."""
    step_fraction: float
    """The line search's accepted fraction of the full step (0 when rejected)."""
    cg_iterations: int


@dataclass(frozen=True)
class TRPO:
    """TRPO's settings (rllab's defaults, see the module docstring)."""

    max_kl: float = 0.01
    damping: float = 1e-5
    cg_iters: int = 10
    cg_tol: float = 1e-10
    backtracks: int = 15
    backtrack_ratio: float = 0.8
    hvp_method: HVPMethod = "double-backward"

    def direction(
        self, objective: Objective, params: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], int]:
        """``(surrogate, g, x, cg_iterations)`` at ``params``: x solves (F + damping I) x = g."""
        theta = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        surrogate, _ = objective(theta)
        grads = torch.autograd.grad(surrogate, list(theta.values()), allow_unused=True)
        g = {k: torch.zeros_like(v) if d is None else d for (k, v), d in zip(theta.items(), grads)}

        def fisher(v: dict[str, Tensor]) -> dict[str, Tensor]:
            return hvp(lambda p: objective(p)[1], theta, v, method=self.hvp_method)

        solved = conjugate_gradient(
            fisher, g, damping=self.damping, max_iter=self.cg_iters, tol=self.cg_tol
        )
        return surrogate.detach(), g, solved.x, solved.iterations

    def step(self, objective: Objective, params: Mapping[str, Tensor]) -> TRPOResult:
        """One TRPO step from ``params`` (returns new tensors; ``params`` is untouched)."""
        surrogate, _, x, iterations = self.direction(objective, params)
        theta = {k: v.detach() for k, v in params.items()}
        fx = hvp(lambda p: objective(p)[1], theta, x, method=self.hvp_method)
        curvature = float(tree_dot(x, tree_axpy(self.damping, x, fx)))
        scale = math.sqrt(2 * self.max_kl / (curvature + 1e-8))
        before = float(surrogate)
        for i in range(self.backtracks):
            fraction = self.backtrack_ratio**i
            candidate = tree_axpy(fraction * scale, x, theta)
            with torch.no_grad():
                value, kl = objective(candidate)
            value, kl = float(value), float(kl)
            if math.isfinite(value) and value > before and kl <= self.max_kl:
                return TRPOResult(candidate, x, True, before, value, kl, fraction, iterations)
        return TRPOResult(theta, x, False, before, before, 0.0, 0.0, iterations)
