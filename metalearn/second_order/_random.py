"""Where random start vectors and probes are drawn: on the generator's device."""

from __future__ import annotations

import torch


def generator_device(generator: torch.Generator | None) -> torch.device:
    """The device a `torch.Generator` draws on (the CPU's default generator when None)."""
    return generator.device if generator is not None else torch.device("cpu")
