"""One call that seeds every generator an experiment draws from."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device).

    Args:
        seed: a non-negative integer below 2**32 (NumPy's limit).

    Raises:
        ValueError: the seed is out of that range.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} is out of range; pass an integer in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (the legacy global generator np.random.* draws from)
    torch.manual_seed(seed)  # also seeds every CUDA device (torch.cuda.manual_seed_all)
