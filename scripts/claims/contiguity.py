"""Claim 1: non-contiguous tensors make ops 15-30% slower, and ``.view`` fails on them.

Each op runs on the same values twice: once from a contiguous tensor and once from a
transposed view of it (same shape, swapped strides). Shapes are Conv4's on Omniglot: a
meta-batch of 80 images ``[80, 1, 28, 28]`` and the first block's activation
``[80, 64, 14, 14]``; the matmul is a 1024 x 1024 layer. ``copy+op`` is the fix people
apply, ``x.contiguous()`` then the op, timed together; ``clone+op`` is its control, the same
fresh allocation and copy from the contiguous tensor (``x.clone()`` then the op), which
separates the cost of the strides from the cost of touching freshly allocated memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_maml import make_model
from torch import Tensor

from claims.common import Config, median_ms, print_table, progress, time_interleaved

__all__ = ["non_contiguous", "reshape_copies", "run", "view_raises"]


def non_contiguous(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    """A tensor of ``shape`` whose last two dimensions are a transposed view (strides swapped)."""
    g = torch.Generator().manual_seed(seed)
    *lead, h, w = shape
    return torch.randn(*lead, w, h, generator=g).transpose(-1, -2)


def view_raises(x: Tensor) -> bool:
    """Whether ``x.view(-1)`` raises (it does when the strides cannot be flattened)."""
    try:
        x.view(-1)
    except RuntimeError:
        return True
    return False


def reshape_copies(x: Tensor) -> bool:
    """Whether ``x.reshape(-1)`` had to copy (a new storage) rather than return a view."""
    return x.reshape(-1).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def conv4_fwd_bwd(x: Tensor, copy: bool = False) -> Callable[[], object]:
    """Forward + backward of MAML's Omniglot Conv4 on images ``x`` ``[N, 1, 28, 28]``.

    ``copy=True`` makes the input contiguous inside each call (the fix, timed with it).
    """
    model = make_model(torch.float32, seed=0)
    y = torch.arange(x.shape[0]) % 5

    def run() -> object:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.contiguous() if copy else x), y).backward()
        return None

    return run


def ops(size: str) -> dict[str, tuple[Tensor, Callable[[Tensor], object]]]:
    """op name -> (non-contiguous input, op). Sizes: Conv4's ("full") or tiny ("tiny")."""
    n, hidden, d = (80, 64, 1024) if size == "full" else (4, 8, 16)
    act = non_contiguous((n, hidden, 14, 14))
    images = non_contiguous((n, 1, 28, 28), seed=1)
    weight = torch.randn(hidden, hidden, 3, 3)
    other = torch.randn(act.shape)
    matrix = torch.randn(d, d)
    return {
        "conv2d 3x3/2 (block 2)": (act, lambda x: F.conv2d(x, weight, stride=2, padding=1)),
        "matmul (left transposed)": (non_contiguous((d, d), 2), lambda a: a @ matrix),
        "add": (act, lambda x: x + other),
        "relu": (act, torch.relu),
        "sum over N,H,W (batch norm)": (act, lambda x: x.sum((0, 2, 3))),
        "sum over last dim": (act, lambda x: x.sum(-1)),
        "Conv4 forward+backward": (images, None),
    }


def measure(size: str, cfg: Config, calls: int = 10) -> list[dict[str, float | str]]:
    """Per op: ms on the contiguous input, the non-contiguous one, and copy + op."""
    rows = []
    for name, (x_nc, op) in ops(size).items():
        progress(f"claim 1: {name}")
        x_c = x_nc.contiguous()
        if op is None:  # the whole network: build one closure per input
            f_c, f_nc = conv4_fwd_bwd(x_c), conv4_fwd_bwd(x_nc)
            fns = {"contiguous": f_c, "non-contiguous": f_nc, "copy+op": conv4_fwd_bwd(x_nc, True)}
            reps = 1
        else:
            fns = {
                "contiguous": lambda op=op, x=x_c: op(x),
                "non-contiguous": lambda op=op, x=x_nc: op(x),
                "copy+op": lambda op=op, x=x_nc: op(x.contiguous()),
                # Control: the same fresh allocation and copy, from a contiguous source.
                "clone+op": lambda op=op, x=x_c: op(x.clone()),
                "copy alone": lambda x=x_nc: x.contiguous(),
            }
            reps = calls  # ops under a millisecond: time `calls` of them per round
        timed = {k: _repeat(f, reps) for k, f in fns.items()}
        times = time_interleaved(timed, cfg.repeats, cfg.warmup)
        row: dict[str, float | str] = {"op": name, "shape": "x".join(map(str, x_nc.shape))}
        row.update({k: median_ms(t) / reps for k, t in times.items()})
        rows.append(row)
    return rows


def _repeat(fn: Callable[[], object], n: int) -> Callable[[], object]:
    def run() -> object:
        for _ in range(n):
            fn()
        return None

    return run


def run(cfg: Config) -> None:
    """Time every op both ways, check view/reshape, print the table."""
    x = non_contiguous((80, 64, 14, 14))
    checks = {"view raises": view_raises(x), "reshape copies": reshape_copies(x)}
    checks["reshape of contiguous copies"] = reshape_copies(x.contiguous())
    rows = measure("tiny" if cfg.quick else "full", cfg)
    cfg.results["contiguity"] = {"rows": rows, "checks": checks}
    print("\n### Claim 1: contiguous vs transposed inputs (ms per call, median)\n")
    table = []
    for r in rows:
        c, nc, cp = r["contiguous"], r["non-contiguous"], r["copy+op"]
        copy = f"{r['copy alone']:.3f}" if "copy alone" in r else "(inside)"
        clone = f"{r['clone+op'] / c:.2f}" if "clone+op" in r else ""
        table.append(
            [r["op"], r["shape"], f"{c:.3f}", f"{nc:.3f}", f"{nc / c:.2f}", copy, f"{cp / c:.2f}"]
            + [clone]
        )
    header = ["op", "input", "contiguous ms", "transposed ms", "ratio", "copy ms", "copy+op ratio"]
    print_table([*header, "clone+op ratio"], table)
    print(f"\nchecks on a transposed [80, 64, 14, 14]: {checks}")
