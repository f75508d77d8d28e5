"""`metalearn.engine.compiled` and `metalearn.algorithms.compiled`: a compiled meta-step gives
the eager meta-gradient, in one graph, through the learner's own ``backward``.

The references are the learner's own eager ``backward`` in float64 on the same tasks; the
graph counts come from Dynamo's counters, so a path that silently ran eagerly (no graph
compiled) fails too. Tiny networks keep each compile to seconds.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._dynamo.utils import counters

from metalearn.algorithms import IMAML, MAML, MAMLpp, MetaSGD, Reptile, make_learner
from metalearn.algorithms.compiled import CompiledMetaGradient, compile_blocker
from metalearn.checkpoint import load_checkpoint
from metalearn.engine import NonFiniteLossError, Task, TaskCall, TaskFn, TaskResult, task_loss
from metalearn.engine.outer import vmapped_task_results
from metalearn.models import MLP, Conv4
from metalearn.runs.lifecycle import UserError
from tests.algorithms.test_dropout import net as dropout_net
from tests.algorithms.test_dropout import tasks as dropout_tasks
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT
from tests.engine.test_chunking import RecordingRunner
from tests.experiments.test_omniglot_experiment import om, tiny_args

# Inductor's compile runs torch code that warns about torch's own deprecated APIs.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]
TOLERANCE = 1e-10
"""Max relative difference of a float64 meta-gradient from eager's (rounding is ~1e-15)."""


def _tasks(n: int, seed: int, nan_task: int | None = None) -> list[Task]:
    """``n`` random 3-way tasks of 4 features, 6 support and 6 query examples, float64."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(6) % 3
    tasks = [
        Task(support=(torch.randn(6, 4, generator=g, dtype=torch.float64), labels),
             query=(torch.randn(6, 4, generator=g, dtype=torch.float64), labels))
        for _ in range(n)
    ]  # fmt: skip
    if nan_task is not None:
        tasks[nan_task].support[0][0, 0] = float("nan")
    return tasks


def _learner(cls=MAML, **kwargs):
    torch.manual_seed(0)
    return cls(MLP(4, [8], 3).double(), inner_lr=0.4, inner_steps=2, **kwargs)


def _meta_gradient(backward, learner, tasks):
    for p in learner.parameters():
        p.grad = None
    metrics = backward(tasks)
    return metrics, {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}


def _relative_difference(grads, reference) -> float:
    assert grads.keys() == reference.keys()
    error = max(float((grads[n] - ref).abs().max()) for n, ref in reference.items())
    return error / max(float(ref.abs().max()) for ref in reference.values())


def _assert_same_step(learner, tasks, compiled):
    """The compiled step's metrics and meta-gradient against eager ``backward``."""
    got, grads = _meta_gradient(compiled, learner, tasks)
    want, reference = _meta_gradient(learner.backward, learner, tasks)
    assert _relative_difference(grads, reference) < TOLERANCE
    assert math.isclose(got.loss, want.loss, rel_tol=TOLERANCE)
    assert (got.accuracy, got.skipped) == (want.accuracy, want.skipped)
    return got, want


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [MAML, MetaSGD])
def test_a_vmapped_chunk_compiles_to_one_graph_with_eager_meta_gradient(cls):
    learner = _learner(cls, vectorize="vmap", chunk_size=None)
    compiled = CompiledMetaGradient(learner)
    for seed in (1, 2):  # new tasks and moved weights reuse the graph
        got, want = _assert_same_step(learner, _tasks(4, seed), compiled)
        assert got.vectorized == want.vectorized == 4
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.1 * p.grad)
    assert compiled.runner.whole and compiled.runner.break_reason is None
    assert counters["stats"]["unique_graphs"] == 1  # compiled once, no recompile
    assert not counters["graph_break"]


def test_a_second_order_conv4_chunk_traces_as_one_graph():
    """The experiments' network, with its batch norm from elementary ops: Dynamo alone."""
    learner = MAML(Conv4(in_channels=1, ways=5, hidden=8, pool="stride"), inner_lr=0.4)
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(5).repeat(2, 1)
    stacked = (torch.rand(2, 5, 1, 28, 28, generator=g), labels,
               torch.rand(2, 5, 1, 28, 28, generator=g), labels)  # fmt: skip
    settings = TaskCall((stacked[0][0], labels[0]), (stacked[2][0], labels[0]),
                        learner.inner_loop(), buffers=learner.buffers_dict())  # fmt: skip
    explained = torch._dynamo.explain(vmapped_task_results)(
        learner.task_fn(), learner.model, learner.theta(), settings, *stacked
    )
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_dropout_compiles_whole_and_draws_the_masks_eager_draws():
    """R2-D2's encoder with dropout: under one seed of torch's generator the compiled graph
    draws the masks eager draws (the same meta-gradient), another seed other masks."""
    learner = make_learner("r2d2", dropout_net(0.5), {"vectorize": "vmap"})
    compiled, batch = CompiledMetaGradient(learner), dropout_tasks(3)
    steps = {}
    for name, backward in (("eager", learner.backward), ("compiled", compiled)):
        for seed in (3, 4):
            torch.manual_seed(seed)
            steps[name, seed] = _meta_gradient(backward, learner, batch)[1]
    assert _relative_difference(steps["compiled", 3], steps["eager", 3]) < TOLERANCE
    assert _relative_difference(steps["compiled", 4], steps["eager", 4]) < TOLERANCE
    assert _relative_difference(steps["eager", 4], steps["eager", 3]) > 1e-3
    assert compiled.runner.whole and compiled.runner.break_reason is None


def test_loop_chunks_run_the_compiled_per_task_function():
    learner = _learner(vectorize="loop")  # chunks of one task each
    compiled = CompiledMetaGradient(learner)
    got, _ = _assert_same_step(learner, _tasks(3, 1), compiled)
    assert got.vectorized == 0
    assert counters["stats"]["unique_graphs"] == 1  # one per-task graph, reused by every task
    assert not counters["graph_break"]


# Dynamo reads .grad of MAML++'s per-step rates (views of a parameter) while tracing.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_mamlpp_multi_step_loss_compiles_whole_with_eager_meta_gradient():
    """Its query passes take no inner step; their empty loss record no longer breaks the graph."""
    learner = _learner(MAMLpp, vectorize="vmap", chunk_size=None)
    compiled = CompiledMetaGradient(learner)
    got, want = _assert_same_step(learner, _tasks(3, 1), compiled)
    assert got.vectorized == want.vectorized == 3
    runner = compiled.runner
    assert runner.whole and runner.per_task and runner.break_reason is None
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def _task_loss_with_a_graph_break(model, params, call: TaskCall) -> TaskResult:
    torch._dynamo.graph_break()  # a no-op when eager
    return task_loss(model, params, call)


class _GraphBreaking(MAML):
    def task_fn(self) -> TaskFn:
        return _task_loss_with_a_graph_break


def test_a_chunk_that_breaks_the_graph_runs_eagerly_with_eager_meta_gradient():
    learner = _learner(_GraphBreaking, vectorize="vmap", chunk_size=None)
    compiled = CompiledMetaGradient(learner)
    _assert_same_step(learner, _tasks(3, 1), compiled)
    assert not (compiled.runner.whole or compiled.runner.per_task)  # both fell back
    assert "graph_break" in compiled.runner.break_reason
    assert not counters["graph_break"]  # nothing compiled with a break


def test_the_compiled_step_is_backward_handing_its_plan_to_the_compiled_runner():
    """No chunk loop of its own: each chunk of the learner's plan, the one-task chunk
    included, reaches the compiled runner through ``backward``."""
    learner = _learner(vectorize="vmap", chunk_size=2)  # chunks of 2, 2 and 1 tasks
    tasks = _tasks(5, 1)
    compiled = CompiledMetaGradient(learner)
    compiled.runner = recording = RecordingRunner(compiled.runner)
    got, want = _assert_same_step(learner, tasks, compiled)
    assert recording.chunks == learner.plan(tasks, learner.inner_loop())
    assert got.vectorized == want.vectorized == 4  # the one-task chunk runs as a task
    assert counters["stats"]["unique_graphs"] == 2  # the 2-task chunk's and the per-task one
    assert not counters["graph_break"]


@pytest.mark.parametrize("vectorize", ["vmap", "loop"])
def test_non_finite_losses_raise_or_skip_as_eager(vectorize):
    tasks = _tasks(4, 1, nan_task=2)
    raising = CompiledMetaGradient(_learner(vectorize=vectorize, chunk_size=None))
    with pytest.raises(NonFiniteLossError, match="task 2"):
        raising(tasks)
    learner = _learner(vectorize=vectorize, chunk_size=None, on_nonfinite="skip")
    got, want = _assert_same_step(learner, tasks, CompiledMetaGradient(learner))
    assert got.skipped == want.skipped == 1


@pytest.mark.parametrize(
    ("learner", "message"),
    [
        (_learner(Reptile), "Reptile computes its meta-gradient its own way"),
        (_learner(IMAML), "IMAML computes its meta-gradient its own way"),
        (
            _learner(vectorize="loop", gradient_checkpointing=True),
            "gradient_checkpointing=True: .*drop checkpointing",
        ),
    ],
)
def test_what_cannot_be_compiled_is_refused_in_one_line(learner, message):
    assert "\n" not in compile_blocker(learner)
    with pytest.raises(ValueError, match=message):
        CompiledMetaGradient(learner)


def test_a_learner_that_overrides_backward_is_refused():
    class Custom(MAML):
        def backward(self, tasks):
            return super().backward(tasks)

    with pytest.raises(ValueError, match="Custom overrides backward"):
        CompiledMetaGradient(copy.deepcopy(_learner(Custom)))


# --------------------------------------------------------------------------- the experiments


def test_compile_in_the_omniglot_experiment_runs_compiled_and_resumes_uncompiled(tmp_path):
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    run = dict(run_name="compiled", algorithm="fomaml")  # first order: a smaller graph
    om.main(tiny_args(tmp_path, compile=True, **run))
    assert counters["stats"]["unique_graphs"] >= 1  # the meta-steps really ran compiled
    assert not counters["graph_break"]
    saved = load_checkpoint(tmp_path / "compiled" / "checkpoint.pt")
    assert saved["args"]["compile"] is True and saved["iteration"] == 2
    om.main(tiny_args(tmp_path, iterations=3, resume=True, **run))  # and --no-compile
    resumed = load_checkpoint(tmp_path / "compiled" / "checkpoint.pt")
    assert resumed["args"]["compile"] is False and resumed["iteration"] == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algorithm": "reptile"}, "--compile with --algorithm reptile: Reptile computes"),
        ({"algorithm": "imaml"}, "--compile with --algorithm imaml: IMAML computes"),
    ],
)
def test_compile_where_it_cannot_apply_is_refused_before_anything_is_written(
    tmp_path, overrides, message
):
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    with pytest.raises(UserError, match=message) as refused:
        om.main(tiny_args(tmp_path, compile=True, **overrides))
    assert "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())
