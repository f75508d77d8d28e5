"""Claim 4: a conditional skip branch (`DynamicBlock`) speeds inference ~20%.

Workload: `metalearn.dynamic.dynamic_conv` (a strided ConvBlock stem 1 -> 64 channels,
28 -> 14, then two residual 3x3 blocks at 64 x 14 x 14, mean-pool, linear head) on
Omniglot-shaped images. Two kinds of inference, each with no block skipped, one skipped
and both skipped:

* ``forward``: logits of a batch of 80 images under ``torch.no_grad``;
* ``adapt+predict``: a MAML learner's evaluation of 16 tasks (5-way 1-shot, 5 query per
  class, 1 inner step), i.e. what meta-test inference is. A ``mixed`` row gives half the
  tasks each branch, which splits the vmapped meta-batch into two buckets.

The saving predicted from the FLOPs the skipped bodies hold (``torch.utils.flop_counter``)
is printed beside the measured one; a static ``nn.Sequential`` of the same layers gives the
cost of the branch mechanism itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from bench_maml import Setting, make_tasks
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from claims.common import Config, median_ms, print_table, progress, time_interleaved
from metalearn.algorithms import MAML
from metalearn.dynamic import DynamicNet, dynamic_conv
from metalearn.outer import Task

__all__ = ["SKIPS", "flops", "make_net", "run", "static_equivalent"]

SKIPS: dict[str, tuple[bool, bool]] = {
    "none skipped": (False, False),
    "block 2 skipped": (False, True),
    "both skipped": (True, True),
}


def make_net(hidden: int = 64, seed: int = 0) -> DynamicNet:
    torch.manual_seed(seed)
    return dynamic_conv(in_channels=1, ways=5, hidden=hidden, depth=2)


class _Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + x


def static_equivalent(net: DynamicNet) -> nn.Module:
    """The same layers (shared weights) with no branch: plain residual blocks in sequence."""
    blocks = [_Residual(b.body) for b in net.blocks]
    return nn.Sequential(net.stem, *blocks, net.head)


def flops(net: DynamicNet, x: Tensor, skip: tuple[bool, bool]) -> int:
    """Floating-point operations of one forward pass with the given branch."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(x, skip=skip)
    return counter.get_total_flops()


def forward_fns(net: DynamicNet, x: Tensor) -> dict[str, Callable[[], object]]:
    static = static_equivalent(net)
    fns: dict[str, Callable[[], object]] = {"static (no branch)": lambda: static(x)}
    for name, skip in SKIPS.items():
        fns[name] = lambda skip=skip: net(x, skip=skip)
    return fns


def with_branch(tasks: list[Task], skips: list[tuple[bool, bool]]) -> list[Task]:
    return [Task(t.support, t.query, model_kwargs={"skip": s}) for t, s in zip(tasks, skips)]


def evaluate_fns(net: DynamicNet, n_tasks: int) -> dict[str, Callable[[], object]]:
    learner = MAML(net, inner_lr=0.4, inner_steps=1)
    tasks = make_tasks(Setting(5, False), n_tasks, torch.float32, seed=0)
    variants = {name: [skip] * n_tasks for name, skip in SKIPS.items()}
    half = n_tasks // 2
    mixed = [SKIPS["none skipped"]] * half + [SKIPS["both skipped"]] * (n_tasks - half)
    variants["mixed (half none, half both)"] = mixed
    fns: dict[str, Callable[[], object]] = {}
    for name, skips in variants.items():
        branched = with_branch(tasks, skips)
        fns[name] = lambda t=branched: learner.evaluate(t)
    return fns


def run(cfg: Config) -> None:
    hidden, batch, n_tasks = (8, 10, 4) if cfg.quick else (64, 80, 16)
    net = make_net(hidden).eval()
    x = torch.rand(batch, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    full = flops(net, x, SKIPS["none skipped"])
    results = {}
    for kind, fns in (("forward", forward_fns(net, x)), ("adapt+predict", None)):
        progress(f"claim 4: {kind}")
        fns = fns or evaluate_fns(net, n_tasks)
        with torch.no_grad():
            times = time_interleaved(fns, cfg.repeats, cfg.warmup)
        results[kind] = {name: median_ms(t) for name, t in times.items()}
    cfg.results["branch"] = {
        "ms": results,
        "flops": {n: flops(net, x, s) for n, s in SKIPS.items()},
    }
    print(f"\n### Claim 4: DynamicNet (dynamic_conv, hidden {hidden}), median ms\n")
    base = {kind: ms["none skipped"] for kind, ms in results.items()}
    table = []
    for name in results["forward"] | results["adapt+predict"]:
        saved = (
            f"{100 * (1 - cfg.results['branch']['flops'][name] / full):.0f}%"
            if name in SKIPS
            else ""
        )
        cells = [name, saved]
        for kind, ms in results.items():
            cells += (
                [f"{ms[name]:.1f}", f"{100 * (1 - ms[name] / base[kind]):.0f}%"]
                if name in ms
                else ["", ""]
            )
        table.append(cells)
    header = ["branch", "FLOPs saved (forward)", f"forward of {batch} ms", "time saved"]
    print_table(header + [f"adapt+predict {n_tasks} tasks ms", "time saved"], table)
