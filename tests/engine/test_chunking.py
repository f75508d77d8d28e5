"""Chunked meta-batches (`metalearn.engine.accumulate`) against the unchunked meta-gradient.

The reference is `MetaLearner.backward` with ``chunk_size=None``: one graph over the whole
meta-batch, one ``loss.backward()``. Chunking must give the same ``.grad`` (float64, 1e-12)
and the same metrics, with skipped tasks, learnable learning rates and MAML++'s multi-step
loss; and a non-finite loss must name the task's place in the whole meta-batch, whatever the
chunks and the mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from metalearn.algorithms import IMAML, MAML, MAMLpp, MetaLearner, MetaSGD, Reptile
from metalearn.engine import (
    AllTasksSkippedError,
    Chunk,
    ChunkCall,
    ChunkedMetaGradient,
    ChunkRunner,
    MetaBatch,
    NonFiniteLossError,
    Task,
    run_meta_batch,
)
from metalearn.models import Conv4

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


def _grads_after_backward(
    learner: MetaLearner, tasks: list[Task], **kwargs: Any
) -> tuple[dict, object]:
    learner.zero_grad(set_to_none=True)
    metrics = learner.backward(tasks, **kwargs)
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


class RecordingRunner:
    """A chunk runner that records each chunk it is handed, then runs it with ``runner``."""

    def __init__(self, runner: ChunkRunner = run_meta_batch) -> None:
        self.runner, self.chunks = runner, []

    def __call__(self, model: nn.Module, params: Any, chunk: ChunkCall) -> MetaBatch:
        start = chunk.first_index
        self.chunks.append(Chunk(range(start, start + len(chunk.tasks)), chunk.mode))
        return self.runner(model, params, chunk)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_backward_hands_its_plan_chunk_by_chunk_to_the_chunk_runner(chunk_size) -> None:
    tasks = [_image_task(i) for i in range(5)]
    learner = MAML(_conv(), inner_steps=2, vectorize="vmap", chunk_size=chunk_size)
    expected, m_ref = _grads_after_backward(learner, tasks)
    recording = RecordingRunner()
    got, m = _grads_after_backward(learner, tasks, run_chunk=recording)
    assert recording.chunks == learner.plan(tasks, learner.inner_loop())
    assert len(recording.chunks) == (1 if chunk_size is None else 3)
    _assert_same(got, expected)
    assert m == m_ref


def test_evaluate_in_chunks_equals_one_batch() -> None:
    tasks = [_image_task(i, query=3) for i in range(7)]
    whole = MAML(_conv(), chunk_size=None).evaluate(tasks, steps=3)
    chunked = MAML(_conv(), chunk_size=3).evaluate(tasks, steps=3)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_gradient_needs_a_leaf_to_fill() -> None:
    frozen = {k: v.detach() for k, v in _conv().named_parameters()}
    with pytest.raises(ValueError, match="requires grad"):
        ChunkedMetaGradient(frozen)


# ------------------------------------------------------------- non-finite: the task's place


def _inf_task_3() -> list[Task]:
    """5 tasks; task 3's support set holds an inf (its loss is not finite at step 0)."""
    tasks = [_image_task(i) for i in range(5)]
    tasks[3].support[0][0, 0, 0, 0] = float("inf")
    return tasks


MODES = [(v, c) for v in ("vmap", "loop") for c in (1, 2, "auto", None)]


@pytest.mark.parametrize(("vectorize", "chunk_size"), MODES)
def test_nonfinite_error_names_the_meta_batch_index(vectorize: str, chunk_size) -> None:
    tasks = _inf_task_3()
    learner = MAML(_conv(), inner_steps=2, vectorize=vectorize, chunk_size=chunk_size)
    for call in (learner.backward, learner.evaluate):
        with pytest.raises(NonFiniteLossError, match="task 3 at inner step 0") as info:
            call(tasks)
        assert info.value.task_index == 3


@pytest.mark.parametrize(("vectorize", "chunk_size"), MODES)
def test_skip_drops_the_same_task_in_backward_and_evaluate(vectorize: str, chunk_size) -> None:
    tasks = _inf_task_3()
    kept = [t for i, t in enumerate(tasks) if i != 3]
    settings = dict(inner_steps=2, vectorize=vectorize, on_nonfinite="skip")
    learner = MAML(_conv(), chunk_size=chunk_size, **settings)
    reference = MAML(_conv(), chunk_size=None, **{**settings, "on_nonfinite": "raise"})
    got, metrics = _grads_after_backward(learner, tasks)
    expected, ref_metrics = _grads_after_backward(reference, kept)
    _assert_same(got, expected)
    assert metrics.skipped == 1
    assert metrics.loss == pytest.approx(ref_metrics.loss, abs=1e-12)
    losses, accuracies = learner.evaluate(tasks)
    ref_losses, ref_accuracies = reference.evaluate(kept)
    assert torch.isnan(losses[3]) and torch.isnan(accuracies[3])
    keep = [0, 1, 2, 4]
    torch.testing.assert_close(losses[keep], ref_losses, rtol=0, atol=1e-12)
    torch.testing.assert_close(accuracies[keep], ref_accuracies, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [Reptile, IMAML])
def test_loop_learners_name_the_task_and_skip_it_in_evaluate(cls: type[MetaLearner]) -> None:
    tasks = _inf_task_3()
    # iMAML's CG needs damping on this net (see IMAML's cg_damping); Reptile takes none.
    extra = {"cg_damping": 10.0} if cls is IMAML else {}

    def learner(**kwargs) -> MetaLearner:
        return cls(_conv(), inner_steps=2, **extra, **kwargs)

    for call in (learner().evaluate, learner().backward):
        with pytest.raises(NonFiniteLossError, match="task 3"):
            call(tasks)
    losses, accuracies = learner(on_nonfinite="skip").evaluate(tasks)
    ref_losses, _ = learner().evaluate([t for i, t in enumerate(tasks) if i != 3])
    assert torch.isnan(losses[3]) and torch.isnan(accuracies[3])
    torch.testing.assert_close(losses[[0, 1, 2, 4]], ref_losses, rtol=0, atol=1e-12)
    assert learner(on_nonfinite="skip").backward(tasks).skipped == 1
