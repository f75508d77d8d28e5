"""Seeds for tasks and episodes, each a function of the run's seed and where it is used.

A task's goal and an episode's noise come from their own seed, derived from the run's root
seed and a path (the meta-iteration, the task's index, the phase, the episode's index) by
`numpy.random.SeedSequence`: the same path always gives the same seed, whatever the batch
sizes, so a run is reproducible and an episode does not change when its batch grows.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["derive_seed", "derive_seeds", "generator"]


def derive_seed(root: int, *path: int) -> int:
    """The seed at ``path`` under ``root`` (a non-negative int below 2**63)."""
    if root < 0 or any(p < 0 for p in path):
        raise ValueError(f"seeds and seed paths are non-negative ints, got {root} and {path}")
    state = np.random.SeedSequence(root, spawn_key=tuple(path)).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def derive_seeds(root: int, *path: int, count: int) -> list[int]:
    """``[derive_seed(root, *path, i) for i in range(count)]``: one seed per episode or task."""
    return [derive_seed(root, *path, i) for i in range(count)]


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)
