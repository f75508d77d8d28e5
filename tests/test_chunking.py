"""Chunked meta-batches (`metalearn.chunking`) against the unchunked meta-gradient.

The reference is `MetaLearner.backward` with ``chunk_size=None``: one graph over the whole
meta-batch, one ``loss.backward()``. Chunking must give the same ``.grad`` (float64, 1e-12)
and the same metrics, with skipped tasks, learnable learning rates and MAML++'s multi-step
loss; and `plan_chunks` must follow its documented rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from metalearn.algorithms import MAML, MAMLpp, MetaLearner, MetaSGD
from metalearn.chunking import AUTO_CHUNK_EXAMPLES, meta_backward, plan_chunks
from metalearn.models import MLP, Conv4
from metalearn.outer import AllTasksSkippedError, InnerLoop, Task

F64 = torch.float64


def _conv(seed: int = 0) -> Conv4:
    torch.manual_seed(seed)
    return Conv4(ways=3, hidden=3).to(F64)


def _image_task(seed: int, query: int = 2, nan: bool = False) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 + 3 * query, 1, 8, 8, generator=g, dtype=F64)
    if nan:
        x[0, 0, 0, 0] = float("nan")
    y = torch.arange(len(x)) % 3
    return Task((x[:3], y[:3]), (x[3:], y[3:]))


def _vector_task(seed: int, per_task: int = 12, **kwargs) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(per_task, 4, generator=g, dtype=F64)
    y = torch.arange(per_task) % 3
    half = per_task // 2
    return Task((x[:half], y[:half]), (x[half:], y[half:]), **kwargs)


def _grads_after_backward(learner: MetaLearner, tasks: list[Task]) -> tuple[dict, object]:
    learner.zero_grad(set_to_none=True)
    metrics = learner.backward(tasks)
    grads = {k: p.grad.clone() for k, p in learner.named_parameters() if p.grad is not None}
    return grads, metrics


def _assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("vectorize", ["vmap", "loop", "auto"])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, "auto"])
def test_chunked_meta_gradient_equals_one_graph(vectorize: str, chunk_size) -> None:
    tasks = [_image_task(i) for i in range(7)]  # 7 tasks: chunks of 2 and 3 leave a remainder
    reference = MAML(_conv(), inner_steps=2, vectorize=vectorize, chunk_size=None)
    chunked = MAML(_conv(), inner_steps=2, vectorize=vectorize, chunk_size=chunk_size)
    expected, m_ref = _grads_after_backward(reference, tasks)
    got, m = _grads_after_backward(chunked, tasks)
    _assert_same(got, expected)
    assert m.loss == pytest.approx(m_ref.loss, abs=1e-12)
    # Accuracies are float32 (a mean of 0/1 hits), whatever the model's dtype.
    assert m.accuracy == pytest.approx(m_ref.accuracy, abs=1e-6)


@pytest.mark.parametrize("cls", [MetaSGD, MAMLpp])
def test_chunking_keeps_learnable_rates_and_multi_step_loss(cls: type[MetaLearner]) -> None:
    tasks = [_image_task(i) for i in range(5)]
    expected, _ = _grads_after_backward(cls(_conv(), inner_steps=2, chunk_size=None), tasks)
    got, _ = _grads_after_backward(cls(_conv(), inner_steps=2, chunk_size=2), tasks)
    _assert_same(got, expected)
    assert len(expected) > len(dict(_conv().named_parameters()))  # rates / copies included


def test_skipped_tasks_are_weighted_out_even_when_a_chunk_loses_all() -> None:
    # Task 2 alone in its chunk (chunk_size=1) and task 4 beside a finite one (chunk_size=2).
    tasks = [_image_task(i, nan=i in (2, 4)) for i in range(6)]
    expected, m_ref = _grads_after_backward(
        MAML(_conv(), on_nonfinite="skip", chunk_size=None), tasks
    )
    for size in (1, 2):
        got, m = _grads_after_backward(MAML(_conv(), on_nonfinite="skip", chunk_size=size), tasks)
        _assert_same(got, expected)
        assert (m.skipped, m_ref.skipped) == (2, 2)
        assert m.loss == pytest.approx(m_ref.loss, abs=1e-12)


def test_all_tasks_skipped_raises_across_chunks() -> None:
    tasks = [_image_task(i, nan=True) for i in range(3)]
    learner = MAML(_conv(), on_nonfinite="skip", chunk_size=1)
    with pytest.raises(AllTasksSkippedError, match="all 3 tasks"):
        learner.backward(tasks)


def test_existing_grads_accumulate_like_backward() -> None:
    tasks = [_image_task(i) for i in range(4)]
    once, _ = _grads_after_backward(MAML(_conv(), chunk_size=None), tasks)
    learner = MAML(_conv(), chunk_size=2)
    learner.backward(tasks)
    learner.backward(tasks)  # no zero_grad in between: the gradients add up
    _assert_same(
        {k: p.grad for k, p in learner.named_parameters()}, {k: 2 * g for k, g in once.items()}
    )


def test_evaluate_in_chunks_equals_one_batch() -> None:
    tasks = [_image_task(i, query=3) for i in range(7)]
    whole = MAML(_conv(), chunk_size=None).evaluate(tasks, steps=3)
    chunked = MAML(_conv(), chunk_size=3).evaluate(tasks, steps=3)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_plan_chunks_rule() -> None:
    torch.manual_seed(0)
    model = MLP(4, [5], 3).to(F64)
    inner = InnerLoop()
    limit = AUTO_CHUNK_EXAMPLES["cpu"]
    small = [_vector_task(i, per_task=10) for i in range(32)]  # 320 examples: one chunk
    assert [len(c) for c in plan_chunks(model, small, inner)] == [32]
    mid = [_vector_task(i, per_task=30) for i in range(32)]  # 960: 2 chunks of 16
    assert [len(c) for c in plan_chunks(model, mid, inner)] == [16, 16]
    big = [_vector_task(i, per_task=80) for i in range(32)]  # 2560: 6 chunks' worth -> 6 each
    assert [len(c) for c in plan_chunks(model, big, inner)] == [6] * 5 + [2]
    assert [len(c) for c in plan_chunks(model, big[:10], inner)] == [5, 5]  # 800: 2 chunks
    few = [_vector_task(i, per_task=10) for i in range(5)]
    assert plan_chunks(model, few, inner) == [range(5)]
    first = InnerLoop(first_order=True)  # the same limit in first order
    assert [len(c) for c in plan_chunks(model, big, first)] == [6] * 5 + [2]
    huge = [_vector_task(i, per_task=limit + 2) for i in range(3)]
    assert [len(c) for c in plan_chunks(model, huge, inner)] == [1, 1, 1]
    assert [len(c) for c in plan_chunks(model, small, inner, "loop")] == [1] * 32
    stopping = [*small[:3], _vector_task(9, stop=lambda step, loss: False)]
    assert [len(c) for c in plan_chunks(model, stopping, inner)] == [1] * 4
    assert plan_chunks(model, small, inner, chunk_size=None) == [range(32)]
    assert plan_chunks(model, small[:5], inner, chunk_size=2) == [
        range(0, 2),
        range(2, 4),
        range(4, 5),
    ]
    for bad in (0, -1, 2.5, True, "big"):
        with pytest.raises(ValueError, match="chunk_size must be"):
            plan_chunks(model, small, inner, chunk_size=bad)
    with pytest.raises(ValueError, match="early-stopping"):
        plan_chunks(model, stopping, inner, "vmap")


def test_meta_backward_needs_a_leaf_to_fill() -> None:
    frozen = {k: v.detach() for k, v in _conv().named_parameters()}
    with pytest.raises(ValueError, match="requires grad"):
        meta_backward(lambda ts: None, frozen, [_image_task(0)], [range(1)])  # type: ignore
