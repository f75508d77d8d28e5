"""The linear feature baseline (Duan et al., 2016), rllab's ``LinearFeatureBaseline``.

Features of a step: the observation clipped to [-10, 10], its square, the time t / 100,
its square and cube, and 1. The coefficients are a ridge regression of the returns on the
features (regularisation 1e-5, raised tenfold up to five times while the solve is not
finite, as rllab). Fitted per task, batched over any leading dims.

Fitting the baseline on the batch it is applied to (as maml_rl and learn2learn do) makes it
depend on that batch's actions, so the estimator it enters is not exactly unbiased; the
exact tests (``tests/rl/test_rl_exact.py``) use advantages without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["baseline_features", "fit_linear_baseline", "linear_baseline_values"]


def baseline_features(obs: Tensor) -> Tensor:
    """``obs [..., B, T, d]`` -> features ``[..., B, T, 2d + 4]``."""
    o = obs.clamp(-10, 10)
    t = torch.arange(obs.shape[-2], dtype=obs.dtype, device=obs.device) / 100.0
    t = t[:, None].expand(*obs.shape[:-1], 1)
    return torch.cat([o, o**2, t, t**2, t**3, torch.ones_like(t)], dim=-1)


def fit_linear_baseline(
    obs: Tensor, returns: Tensor, mask: Tensor, reg_coeff: float = 1e-5
) -> Tensor:
    """Ridge coefficients ``[..., 2d + 4]`` fitted on the valid steps of each task's batch.

    Args:
        obs: ``[..., B, T, d]``.
        returns: ``[..., B, T]``, the targets (discounted returns-to-go).
        mask: ``[..., B, T]``.
        reg_coeff: the ridge term's starting coefficient.
    """
    features = baseline_features(obs) * mask[..., None]
    x = features.flatten(-3, -2)  # [..., B*T, F]
    y = (returns * mask).flatten(-2)
    gram = x.transpose(-1, -2) @ x
    rhs = (x.transpose(-1, -2) @ y[..., None])[..., 0]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    # CPU: gelsd (SVD), as numpy's lstsq in rllab's baseline; the default gelsy returned
    # different bits for the same input from call to call, so runs were not repeatable.
    # CUDA has gels only.
    driver = "gelsd" if gram.device.type == "cpu" else "gels"
    for _ in range(5):
        solved = torch.linalg.lstsq(gram + reg_coeff * eye, rhs[..., None], driver=driver)
        coeffs = solved.solution[..., 0]
        if torch.isfinite(coeffs).all():
            break
        reg_coeff *= 10
    return coeffs


def linear_baseline_values(coeffs: Tensor, obs: Tensor, mask: Tensor) -> Tensor:
    """The baseline's values ``[..., B, T]`` (0 past each episode's end)."""
    return (baseline_features(obs) @ coeffs[..., None, :, None])[..., 0] * mask
