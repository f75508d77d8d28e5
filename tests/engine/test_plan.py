"""The planner (`metalearn.engine.plan.plan`) against its rule, restated here independently.

The rule, as a reader would check it by hand: on CPU a vmapped chunk holds at most 480
examples (support + query, summed over its tasks); ``chunk_size="auto"`` packs as many whole
tasks as fit and then spreads the tasks evenly over that many chunks; anything that needs the
loop (an early-stop rule, checkpointing, a fused norm module in second order) runs one task
per chunk; a chunk of one task runs in the loop; ``vectorize="vmap"`` with such a blocker
raises.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from metalearn.engine import VMAP_CHUNK_EXAMPLES, InnerLoop, Task, plan
from metalearn.models import MLP

F64 = torch.float64
CPU_LIMIT = 480


def _task(seed: int, examples: int, **kwargs) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(examples, 4, generator=g, dtype=F64)
    y = torch.arange(examples) % 3
    half = examples // 2
    return Task((x[:half], y[:half]), (x[half:], y[half:]), **kwargs)


def _tasks(count: int, examples: int, **kwargs) -> list[Task]:
    return [_task(i, examples, **kwargs) for i in range(count)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(4, [5], 3).to(F64)


def _expected_sizes(count: int, examples: int) -> list[int]:
    """The rule by hand: whole tasks that fit the limit, then spread evenly."""
    fit = max(1, CPU_LIMIT // examples)
    chunks = math.ceil(count / fit)
    size = math.ceil(count / chunks)
    return [min(size, count - start) for start in range(0, count, size)]


def _shape(chunks) -> list[tuple[int, str]]:
    return [(len(c.tasks), c.mode) for c in chunks]


def test_the_cpu_limit_is_the_measured_480() -> None:
    assert VMAP_CHUNK_EXAMPLES["cpu"] == CPU_LIMIT


@pytest.mark.parametrize(
    ("examples", "expected"),
    [(10, [(32, "vmap")]), (30, [(16, "vmap")] * 2), (80, [(6, "vmap")] * 5 + [(2, "vmap")])],
)
def test_representative_workloads(examples: int, expected: list) -> None:
    chunks = plan(_mlp(), _tasks(32, examples), InnerLoop())
    assert _shape(chunks) == expected
    assert [n for n, _ in expected] == _expected_sizes(32, examples)
    covered = [i for c in chunks for i in c.tasks]
    assert covered == list(range(32))
    for c in chunks:
        assert len(c.tasks) * examples <= CPU_LIMIT


def test_the_same_limit_in_first_order() -> None:
    chunks = plan(_mlp(), _tasks(32, 80), InnerLoop(first_order=True))
    assert _shape(chunks) == [(6, "vmap")] * 5 + [(2, "vmap")]


def test_a_task_larger_than_the_limit_runs_alone_in_the_loop() -> None:
    assert _shape(plan(_mlp(), _tasks(3, CPU_LIMIT + 2), InnerLoop())) == [(1, "loop")] * 3


def test_uneven_tasks_are_packed_by_the_largest() -> None:
    tasks = [*_tasks(6, 40), _task(9, 120)]  # 120 fits 4 per chunk: 7 tasks -> 2 chunks
    chunks = plan(_mlp(), tasks, InnerLoop())
    assert _shape(chunks) == [(4, "vmap"), (3, "vmap")]


@pytest.mark.parametrize(
    ("tasks", "inner"),
    [
        ([*_tasks(3, 10), _task(9, 10, stop=lambda step, loss: False)], InnerLoop()),
        (_tasks(4, 10), InnerLoop(checkpoint=True)),
    ],
    ids=["stop-rule", "checkpoint"],
)
def test_blockers_give_loop_chunks_of_one_task(tasks: list[Task], inner: InnerLoop) -> None:
    assert _shape(plan(_mlp(), tasks, inner)) == [(1, "loop")] * 4
    with pytest.raises(ValueError, match="vectorize='vmap' cannot run this meta-batch"):
        plan(_mlp(), tasks, inner, "vmap")


class _FusedNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.norm, self.head = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.l1(x))))


def test_fused_norm_modules_force_the_loop_in_second_order_only() -> None:
    model = _FusedNormNet().to(F64)
    tasks = _tasks(4, 10)
    assert _shape(plan(model, tasks, InnerLoop())) == [(1, "loop")] * 4
    with pytest.raises(ValueError, match="MetaBatchNorm"):
        plan(model, tasks, InnerLoop(), "vmap")
    assert _shape(plan(model, tasks, InnerLoop(first_order=True))) == [(4, "vmap")]


def test_explicit_chunk_sizes_and_the_loop() -> None:
    model, inner = _mlp(), InnerLoop()
    small = _tasks(5, 10)
    chunks = plan(model, small, inner, chunk_size=2)
    assert [c.tasks for c in chunks] == [range(0, 2), range(2, 4), range(4, 5)]
    assert [c.mode for c in chunks] == ["vmap", "vmap", "loop"]  # one task: nothing to batch
    assert _shape(plan(model, small, inner, chunk_size=None)) == [(5, "vmap")]
    assert _shape(plan(model, small, inner, "loop")) == [(1, "loop")] * 5
    assert _shape(plan(model, small, inner, "loop", chunk_size=None)) == [(5, "loop")]
    # An explicit chunk past the limit runs in the loop under "auto", vmapped when asked.
    big = _tasks(20, 30)  # 600 examples
    assert _shape(plan(model, big, inner, chunk_size=None)) == [(20, "loop")]
    assert _shape(plan(model, big, inner, "vmap", chunk_size=None)) == [(20, "vmap")]


def test_bad_arguments_name_the_fix() -> None:
    model, inner, tasks = _mlp(), InnerLoop(), _tasks(3, 10)
    for bad in (0, -1, 2.5, True, "big"):
        with pytest.raises(ValueError, match="chunk_size must be a positive int, 'auto' or None"):
            plan(model, tasks, inner, chunk_size=bad)
    with pytest.raises(ValueError, match="'vmap', 'loop' or 'auto'"):
        plan(model, tasks, inner, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        plan(model, [], inner)
