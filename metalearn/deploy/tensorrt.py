"""A TensorRT engine of the adapted network, built through ``torch_tensorrt`` (CUDA only).

Needs a CUDA device and ``torch_tensorrt`` built for the installed torch; `check_tensorrt`
says which is missing before any work. The engine is built in memory, for measuring and
checking it against eager; ``torch_tensorrt.save`` can write it where one is deployed.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.export import Dim

__all__ = ["check_tensorrt", "compile_tensorrt"]


def check_tensorrt() -> None:
    """Raise ``ValueError`` naming what ``--tensorrt`` lacks here (the package, CUDA)."""
    missing = []
    if importlib.util.find_spec("torch_tensorrt") is None:
        missing.append(
            f"torch_tensorrt (pip install torch-tensorrt, the release matching torch "
            f"{torch.__version__})"
        )
    if not torch.cuda.is_available():
        missing.append("a CUDA device (this torch sees none)")
    if missing:
        raise ValueError(f"--tensorrt needs {' and '.join(missing)}; or leave out --tensorrt")


def compile_tensorrt(
    model: nn.Module, example_x: Tensor, *, dynamic_batch: bool = True
) -> Callable[[Tensor], Tensor]:
    """Build a TensorRT engine of ``model`` on the current CUDA device.

    Args:
        model: the adapted network (`adapted_model`), ``[B, C, H, W] -> [B, ways]``, on
            any device (a copy is moved to CUDA).
        example_x: example images ``[N, C, H, W]`` (the support set).
        dynamic_batch: build for batches of 1 to ``N`` images (optimised for 1, the
            latency case); False: for ``N`` only.

    Returns:
        A callable on CUDA images ``[B, C, H, W]`` returning logits ``[B, ways]``.

    Raises:
        ValueError: see `check_tensorrt`.
    """
    check_tensorrt()
    import torch_tensorrt

    device = torch.device("cuda")
    model = copy.deepcopy(model).to(device).eval()
    x = example_x.to(device)
    shape, rest = tuple(x.shape), tuple(x.shape[1:])
    if dynamic_batch and shape[0] > 1:
        batch = Dim("batch", min=1, max=shape[0])
        program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
        inputs = [torch_tensorrt.Input(min_shape=(1, *rest), opt_shape=(1, *rest),
                                       max_shape=shape, dtype=x.dtype)]  # fmt: skip
    else:
        program = torch.export.export(model, (x,))
        inputs = [torch_tensorrt.Input(shape=shape, dtype=x.dtype)]
    return torch_tensorrt.dynamo.compile(program, inputs=inputs)
