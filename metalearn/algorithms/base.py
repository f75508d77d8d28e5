"""The learner bases: `MetaLearner` (theta, inner-loop state, the meta-gradient) and
`MetaLossLearner` (algorithms whose meta-gradient is the gradient of a meta-loss).

Every algorithm is a small subclass. The training loop is the same for all of them::

    learner = MAML(model, inner_lr=0.4, inner_steps=1)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
    for tasks in sampler:
        opt.zero_grad()
        metrics = learner.backward(tasks)   # fills .grad of learner.parameters()
        opt.step()

``backward`` is the one method every algorithm must get right: MAML-style algorithms
(`MetaLossLearner`) get it from autograd through their `MetaLossLearner.meta_loss`; Reptile
and iMAML subclass `MetaLearner` and compute it their own way.

A meta-batch walks down the layers: the learner plans it (`metalearn.engine.plan.plan`), runs each
chunk in its mode (`metalearn.engine.outer.run_meta_batch`, or the chunk runner ``backward`` is
given: ``--compile``'s is `metalearn.engine.compiled.CompiledChunkRunner`) and accumulates the
chunks' gradients (`metalearn.engine.accumulate.ChunkedMetaGradient`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.engine import (
    AllTasksSkippedError,
    Chunk,
    ChunkCall,
    ChunkedMetaGradient,
    ChunkRunner,
    ChunkSize,
    InnerLoop,
    LossFn,
    MetaBatch,
    OnNonfinite,
    QueryFn,
    Task,
    TaskCall,
    TaskFn,
    Vectorize,
    plan,
    query_outputs,
    run_inner_loop,
    run_meta_batch,
    task_loss,
)
from metalearn.functional import accumulate_grad, detached
from metalearn.models import norm_parameter_names
from metalearn.normalisation import Normalisation, read_normalisation
from metalearn.optim import SGD, Hyperparameter, InnerOptimizer, check_hyperparameter, hyper_at

__all__ = [
    "InnerStart",
    "MetaLearner",
    "MetaLossLearner",
    "StepMetrics",
    "accumulate_grad",
    "adapted_keys",
    "check_loop_only",
]


@dataclass
class StepMetrics:
    """What one meta-step reports (plain floats, ready for logging)."""

    loss: float
    """Mean query loss over the meta-batch (after adaptation)."""
    accuracy: float
    """Mean query accuracy (NaN for regression)."""
    skipped: int = 0
    """Tasks dropped for a non-finite loss."""
    vectorized: int = 0
    """Tasks that ran under vmap."""


class InnerStart(NamedTuple):
    """Where a task's inner loop starts, and the support loss its first step descends."""

    loss: Callable[[dict[str, Tensor]], Tensor]
    """``adapted -> L_s``: the support loss as a function of the weights the first inner step
    adapts, every other input (the rest of theta, buffers, replaced heads) held fixed."""
    adapted: dict[str, Tensor]
    """The adapted weights' starting values phi_0 (detached), name -> tensor."""


class MetaLearner(nn.Module, abc.ABC):
    """The base every algorithm in this package specialises: theta, the inner loop, and
    `backward`, which each algorithm defines.

    An algorithm says where each task's inner loop starts (`start`: theta for MAML, the
    prototype head for Proto-MAML, a solved head for ProtoNet, R2D2 and MetaOptNet) and, if
    its meta-loss is not MAML's, what one task's meta-loss is (`task_fn`). From these two
    the base derives the meta-loss, `adapt`, `evaluate` and `inner_start`.

    Args:
        model: the network; its parameters are theta. Called through ``functional_call``.
        inner_lr: inner-loop learning rate alpha (a float: fixed, not learned).
        inner_steps: inner gradient steps during meta-training.
        first_order: drop second-order terms (FOMAML).
        adapt_keys: names of the parameters adapted in the inner loop (None: all). ANIL
            passes the head's.
        loss_fn: ``loss_fn(outputs, targets) -> Tensor[]``.
        vectorize: ``"vmap"``, ``"loop"`` or ``"auto"``: how a meta-batch runs
            (`metalearn.engine.plan.plan`).
        gradient_checkpointing: recompute inner steps in the backward pass: memory grows by
            one copy of the fast weights per inner step instead of each step's activations
            (0.48x the plain loop's peak at 20 steps, for about 2x the time; docs/claims.md).
        on_nonfinite: ``"raise"`` or ``"skip"`` tasks whose loss is not finite, in `backward`
            and `evaluate` alike (`evaluate` gives skipped tasks NaN loss and accuracy).
        chunk_size: tasks per chunk of the meta-batch: each chunk's graph is built,
            differentiated and freed in turn (same meta-gradient, less memory; on a CPU
            also faster, see `metalearn.engine.plan`). ``"auto"`` (default) picks by workload,
            None runs the whole meta-batch as one graph.

    Class attributes:
        fixed_arguments: `MetaLearner` arguments the subclass decides itself (FOMAML's
            ``first_order``, ANIL's ``adapt_keys``), so a record of its arguments leaves them
            out (`metalearn.algorithms.registry`).
        default_outer_lr: the outer step size `outer_optimizer` takes when given none.
        default_outer_optimizer: the name of `outer_optimizer`'s kind (``"adam"``,
            ``"sgd"``), what an experiment's ``--outer-optimizer`` records when left open.
        head_sized_per_task: whether the learner sizes its classifier from each task's
            labels (the solved heads of `metalearn.algorithms.heads`), so it can train on
            tasks with more classes than the model's head has outputs; False for learners
            that adapt the model's own head.
        not_compiled: why the learner's meta-step cannot run under ``torch.compile``
            (`metalearn.algorithms.compiled.compile_blocker` refuses it, naming this); None
            when it can.
        scores_adapted_weights: the query predictions `evaluate` scores are the network's
            output at `adapt`'s weights in the query's own batch (an ensemble of
            checkpoints averages them, `metalearn.runs.evaluation`); False for the solved
            heads and Reptile, which score queries otherwise (their `query_logits` give
            their own predictions).
        has_inner_loop: the learner adapts by inner gradient steps (takes ``inner_lr`` and
            ``inner_steps``); False for the solved heads.
        takes_inner_optimizer: the inner loop's optimizer is chosen (``inner_optimizer`` and
            its hyperparameters, `metalearn.algorithms.inner_optimizer`).
        measures_curvature: `metalearn.algorithms.curvature` measures it: an inner loop and
            a meta-loss to differentiate (`MetaLossLearner`).
        omniglot_inner_defaults: the constructor's ``inner_lr`` and ``inner_steps`` are
            its reference's Omniglot values, so `experiments/fewshot_maml.py` gives an open
            one the MAML paper's mini-ImageNet value; False where the reference set them
            for other data (BOIL's CIFAR-FS, Proto-MAML's meta-dataset), kept there.

        The experiments and tools read these through `metalearn.algorithms.registry.can`
        and `~metalearn.algorithms.registry.algorithms_that`, never from a list of names.
    """

    fixed_arguments: ClassVar[tuple[str, ...]] = ()
    default_outer_lr: ClassVar[float] = 1e-3
    default_outer_optimizer: ClassVar[str] = "adam"
    head_sized_per_task: ClassVar[bool] = False
    not_compiled: ClassVar[str | None] = None
    has_inner_loop: ClassVar[bool] = True
    takes_inner_optimizer: ClassVar[bool] = False
    measures_curvature: ClassVar[bool] = False
    scores_adapted_weights: ClassVar[bool] = True
    omniglot_inner_defaults: ClassVar[bool] = True
    adapt_norm: bool = True
    """Adapt the parameters that flow into normalisation weights; the MAML family's
    constructors take it (False by default there: their references hold them)."""
    _named_keys: list[str] | None = None
    """The ``adapt_keys`` the caller named, refused if the forward shows a normalisation
    weight among them while ``adapt_norm`` is False (`fast_weight_names`)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.4,
        inner_steps: int = 1,
        first_order: bool = False,
        adapt_keys: Collection[str] | None = None,
        loss_fn: LossFn = F.cross_entropy,
        vectorize: Vectorize = "auto",
        gradient_checkpointing: bool = False,
        on_nonfinite: OnNonfinite = "raise",
        chunk_size: ChunkSize = "auto",
    ) -> None:
        super().__init__()
        if inner_steps < 0:
            raise ValueError(f"inner_steps must be >= 0, got {inner_steps}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        check_hyperparameter("lr", inner_lr, "inner_lr")
        self.model = model
        self.inner_lr = inner_lr
        self.inner_steps = inner_steps
        self.first_order = first_order
        self.adapt_keys = None if adapt_keys is None else list(adapt_keys)
        if self.adapt_keys is not None:
            names = dict(model.named_parameters())
            if missing := [k for k in self.adapt_keys if k not in names]:
                raise ValueError(
                    f"adapt_keys names parameters the model lacks: {missing}; "
                    f"the model has {list(names)[:8]}..."
                )
        self.loss_fn = loss_fn
        self.vectorize = vectorize
        self.gradient_checkpointing = gradient_checkpointing
        self.on_nonfinite = on_nonfinite
        self.chunk_size = chunk_size
        # The model's normalisation read from its forward, by input signature (`normalisation`).
        self._normalisations: dict[tuple[Any, ...], Normalisation] = {}

    @property
    def evaluation_norm(self) -> str:
        """How `evaluate` batches a task's query examples, which batch norm sees:
        ``"transductive"``, the whole query set in one batch. Named as
        `metalearn.deploy.adapted_model`'s ``norm``, so a deployed network can be read the
        same way (Reptile's default scores each query beside the support set:
        ``"beside_support"``)."""
        return "transductive"

    @abc.abstractmethod
    def backward(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate the meta-gradient of a meta-batch into ``.grad`` (like loss.backward)."""

    # ------------------------------------------------------------------ pieces to override

    def theta(self) -> dict[str, Tensor]:
        """The model's parameters as a dict (the tensors themselves: gradients reach them)."""
        return dict(self.model.named_parameters())

    def buffers_dict(self) -> dict[str, Tensor]:
        """The model's buffers, name -> tensor, for ``functional_call``."""
        return dict(self.model.named_buffers())

    def learning_rate(self) -> Hyperparameter:
        """The inner learning rate(s), a `metalearn.optim.Hyperparameter` (see
        `metalearn.engine.inner.InnerLoop`)."""
        return self.inner_lr

    def inner_update(self) -> InnerOptimizer:
        """The inner loop's optimizer (`metalearn.optim`): ``SGD()``, MAML's Eq. 1, unless the
        learner takes another (`metalearn.algorithms.inner_optimizer`)."""
        return SGD()

    def normalisation(self, task: Task) -> Normalisation:
        """The model's normalisation calls on inputs like ``task``'s support set
        (`metalearn.normalisation.read_normalisation`), read once per input signature (the
        example's shape after the batch dimension, dtype, device, the model's mode and the
        forward's keyword arguments) and kept on the learner."""
        x = task.support[0]
        kwargs = tuple(sorted((k, _signature(v)) for k, v in task.model_kwargs.items()))
        key = (tuple(x.shape[1:]), x.dtype, x.device, self.model.training, kwargs)
        if (found := self._normalisations.get(key)) is None:
            found = read_normalisation(
                self.model, x, buffers=self.buffers_dict(), kwargs=task.model_kwargs
            )
            self._normalisations[key] = found
        return found

    def fast_weight_names(self, tasks: Sequence[Task]) -> list[str] | None:
        """The parameters the inner loop adapts on ``tasks`` (None: every one).

        ``adapt_keys``, less every parameter that the forward feeds into a normalisation
        weight or bias (`normalisation`) unless ``adapt_norm``: MAML's references keep the
        norm layers out of the fast weights (cbfinn/maml's batch-norm variables are not in
        ``weights``; HowToTrainYourMAMLPytorch's ``get_inner_loop_parameter_dict`` drops
        them), so they are meta-learned only.

        Without tasks there is no forward to read: the norm modules found by type are held
        (`adapted_keys`), the guess made before any input is seen.

        Raises:
            ValueError: ``adapt_keys`` named a normalisation parameter while ``adapt_norm``
                is False.
        """
        if self.adapt_norm:
            return self.adapt_keys
        if not tasks:
            return adapted_keys(self.model, self.adapt_keys, adapt_norm=False, sized_now=True)
        norms = set().union(*(self.normalisation(t).parameter_names() for t in tasks))
        if named := [k for k in self._named_keys or () if k in norms]:
            raise ValueError(
                f"adapt_keys names normalisation parameters {named[:4]} (their forward feeds "
                "them to a norm's weight or bias), which adapt_norm=False keeps out of the "
                "inner loop; drop them or pass adapt_norm=True"
            )
        if not norms:
            return self.adapt_keys
        names = self.adapt_keys
        if names is None:
            names = [n for n, _ in self.model.named_parameters()]
        return [k for k in names if k not in norms]

    def inner_loop(
        self,
        steps: int | None = None,
        first_order: bool | None = None,
        tasks: Sequence[Task] = (),
    ) -> InnerLoop:
        """The inner-loop settings for the current state (learnable rates included), adapting
        `fast_weight_names` of ``tasks``, the tasks it will run (their forward decides which
        normalisation weights are held)."""
        return InnerLoop(
            steps=self.inner_steps if steps is None else steps,
            lr=self.learning_rate(),
            first_order=self.first_order if first_order is None else first_order,
            adapt_keys=self.fast_weight_names(tasks),
            loss_fn=self.loss_fn,
            checkpoint=self.gradient_checkpointing,
            optimizer=self.inner_update(),
        )

    def plan(self, tasks: Sequence[Task], inner: InnerLoop) -> list[Chunk]:
        """How `backward` and `evaluate` split ``tasks`` and run each chunk (the vmap choice
        read from the model's normalisation on the first task, `normalisation`)."""
        norm = self.normalisation(tasks[0]) if tasks and self.vectorize != "loop" else None
        return plan(self.model, tasks, inner, self.vectorize, self.chunk_size, norm)

    # ------------------------------------------------------------------ the outer loop

    def outer_optimizer(self, lr: float | None = None) -> torch.optim.Optimizer:
        """The optimiser of theta that `backward`'s ``.grad`` is meant for: Adam (Finn et al.,
        2017, Sec. 5.2), step ``lr`` (None: `default_outer_lr`)."""
        return torch.optim.Adam(self.parameters(), lr=self.default_outer_lr if lr is None else lr)

    def outer_lr_factor(self, step: int, total: int) -> float:
        """The outer step size at meta-step ``step`` of ``total``, as a factor of its start.

        Constant (1.0) unless the algorithm anneals it (Reptile). A function of the step
        alone, so a resumed run continues the schedule where it stopped.
        """
        return 1.0

    def schedule(self, step: int, total: int) -> dict[str, float]:
        """Set what depends on training progress for meta-step ``step`` (0-based) of ``total``.

        The training loop calls it before each meta-step; the learner's state after the call
        is a function of ``step`` alone (MAML++'s loss weights and derivative order), so a
        resumed run is where an uninterrupted one would be. Returns the values to log with
        the step (``{}`` for algorithms with no schedule).
        """
        return {}

    # ------------------------------------------------------------------ the extension point

    def start(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall
    ) -> Mapping[str, Tensor]:
        """Where a task's inner loop starts: phi_0 from theta ``params`` and the task.

        The one method an algorithm overrides to start elsewhere than theta (MAML's phi_0,
        Finn et al., 2017, Eq. 1): Proto-MAML sets the head from the support prototypes,
        the solved-head learners solve it, MAML++ puts in its step-0 batch-norm copies.
        Differentiable in ``params`` (the meta-gradient flows through it), and a function of
        ``model`` and ``call`` (the task's sets, buffers and forward kwargs), not of
        ``self.model``, so it runs under vmap and ``torch.compile`` inside `task_fn`.

        Args:
            model: the network.
            params: theta, name -> tensor.
            call: the task (`metalearn.engine.TaskCall`).

        Returns:
            phi_0, name -> tensor, with every key of ``params``.
        """
        return params

    def query_fn(self) -> QueryFn:
        """How the network at adapted weights scores a task's query inputs, in `task_fn`
        and `query_logits`: `metalearn.engine.query_outputs` (the query batch alone), unless
        the learner reads batch norm otherwise (Proto-MAML: the support set's statistics)."""
        return query_outputs

    def task_fn(self) -> TaskFn:
        """The meta-loss of one task (a `metalearn.engine.TaskFn`): `metalearn.engine.task_loss`
        from `start` (Finn et al., 2017, Eq. 2 for one task), its query scored by `query_fn`.
        Algorithms whose meta-loss is another override it (MAML++'s multi-step loss, the
        solved heads' query loss)."""
        bound: dict[str, Any] = {}
        if type(self).start is not MetaLearner.start:
            bound["start"] = self.start
        query = self.query_fn()
        if query is not query_outputs:
            bound["query"] = query
        return partial(task_loss, **bound) if bound else task_loss

    # ------------------------------------------------------------------ derived from start

    def inner_start(self, task: Task) -> InnerStart:
        """The support loss of ``task`` at `start`, where this learner's inner loop starts.

        Its first step adapts the parameters that have a learning rate at step 0 (MAML's
        ``adapt_keys``), the others held where `start` puts them (Proto-MAML's prototype
        head, MAML++'s step-0 batch-norm copies), so that what is measured there
        (`metalearn.algorithms.curvature.support_curvature`) is where the algorithm is.
        The loss holds no regulariser (iMAML's proximal term).

        Raises:
            ValueError: no parameter is adapted at the first inner step.
        """
        return support_start(self, self.start_of(task), task.support, task)

    def start_of(self, task: Task) -> dict[str, Tensor]:
        """`start` for ``task`` at the current theta, detached (no graph is built)."""
        call = TaskCall.of(task, self.inner_loop(tasks=[task]), buffers=self.buffers_dict())
        with torch.no_grad():
            return detached(dict(self.start(self.model, detached(self.theta()), call)))

    def adapt(self, task: Task, steps: int | None = None) -> dict[str, Tensor]:
        """Fast weights for one task, detached (for evaluation and deployment): the inner loop
        from `start`, first order (the same weights; no graph is built)."""
        inner = _evaluation_loop(self.inner_loop(steps, first_order=True, tasks=[task]))
        buffers = self.buffers_dict()
        call = TaskCall.of(task, inner, buffers=buffers)
        with torch.no_grad():  # torch.func.grad inside still differentiates
            phi = self.start(self.model, detached(self.theta()), call)
            fast, _ = run_inner_loop(
                self.model, phi, task.support, inner, buffers=buffers,
                model_kwargs=task.model_kwargs,
            )  # fmt: skip
        return detached(fast)

    def query_logits(self, task: Task, steps: int | None = None) -> Tensor:
        """The predictions `evaluate` scores on ``task``'s query inputs, ``[Q, C]``: the
        network's output at `adapt`'s weights, read by `query_fn` (the solved heads and
        Reptile give theirs)."""
        fast = self.adapt(task, steps)
        call = TaskCall.of(task, self.inner_loop(tasks=[task]), buffers=self.buffers_dict())
        with torch.no_grad():
            return self.query_fn()(self.model, fast, call)

    def network_parameters(self) -> list[Tensor]:
        """The meta-parameters that are the network's weights (the model's; MAML++ adds its
        per-step batch-norm copies), not the inner loop's learned rates: what a meta-gradient
        clamp bounds (`metalearn.runs.outer_loop.clamp_meta_gradient`)."""
        return list(self.model.parameters())

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss and accuracy per task after ``steps`` inner steps: ``([T], [T])``.

        `task_fn` on each task with no outer graph (evaluation never needs the
        meta-gradient), so the inner loop is first order, which gives the same adapted
        weights. Planned and run as `backward` runs, so evaluation is vmapped exactly when
        training would be. Under ``on_nonfinite="skip"`` a task whose loss is not finite
        gets NaN loss and accuracy.
        """
        inner = _evaluation_loop(self.inner_loop(steps, first_order=True, tasks=tasks))
        return self._evaluate(tasks, inner, self.task_fn())

    def _evaluate(
        self, tasks: Sequence[Task], inner: InnerLoop, task_fn: TaskFn
    ) -> tuple[Tensor, Tensor]:
        """`evaluate` with a given per-task function (MAML++ passes its final-step loss)."""
        theta = detached(self.theta())
        losses, accuracies = [], []
        with torch.no_grad():
            for chunk in self.plan(tasks, inner):
                try:
                    result = self._run_chunk(theta, tasks, chunk, inner, task_fn)
                except AllTasksSkippedError:
                    nan = torch.full((len(chunk.tasks),), float("nan"))
                    result = MetaBatch(nan[0], nan[0], nan, nan, [], 0)
                losses.append(result.task_losses)
                accuracies.append(result.task_accuracies)
        return torch.cat(losses), torch.cat(accuracies)

    def _run_chunk(
        self,
        theta: Mapping[str, Tensor],
        tasks: Sequence[Task],
        chunk: Chunk,
        inner: InnerLoop,
        task_fn: TaskFn,
        run_chunk: ChunkRunner = run_meta_batch,
    ) -> MetaBatch:
        """One chunk of a plan through ``run_chunk`` (`metalearn.engine.outer.run_meta_batch`
        unless `MetaLossLearner.backward` was given another)."""
        call = ChunkCall(
            [tasks[i] for i in chunk.tasks], inner, chunk.mode, task_fn,
            buffers=self.buffers_dict(), on_nonfinite=self.on_nonfinite,
            first_index=chunk.tasks.start,
        )  # fmt: skip
        return run_chunk(self.model, theta, call)


class MetaLossLearner(MetaLearner):
    """MAML (Finn et al., 2017) and its relatives: the meta-gradient is the gradient of
    `meta_loss`, the mean query loss after adaptation. Arguments as for `MetaLearner`."""

    measures_curvature = True

    def meta_loss(self, tasks: Sequence[Task]) -> MetaBatch:
        """Mean query loss after adaptation, one graph over all of ``tasks``; differentiable
        w.r.t. ``self.parameters()``."""
        inner = self.inner_loop(tasks=tasks)
        norm = self.normalisation(tasks[0]) if tasks else None
        (chunk,) = plan(self.model, tasks, inner, self.vectorize, None, norm)
        return self._run_chunk(self.theta(), tasks, chunk, inner, self.task_fn())

    def backward(
        self, tasks: Sequence[Task], run_chunk: ChunkRunner = run_meta_batch
    ) -> StepMetrics:
        """Accumulate the meta-gradient of a meta-batch into ``.grad``, chunk by chunk.

        Args:
            tasks: the meta-batch.
            run_chunk: runs each chunk of the plan (`metalearn.engine.outer.ChunkRunner`):
                `metalearn.engine.outer.run_meta_batch` by default; ``--compile`` passes a
                `metalearn.engine.compiled.CompiledChunkRunner`. Whichever runs the chunks,
                the plan, the per-task function and the accumulation are this method's.

        Returns:
            The step's `StepMetrics`.
        """
        inner = self.inner_loop(tasks=tasks)
        chunks = self.plan(tasks, inner)
        theta, task_fn = self.theta(), self.task_fn()
        if len(chunks) == 1:
            result = self._run_chunk(theta, tasks, chunks[0], inner, task_fn, run_chunk)
            result.loss.backward()
            return _metrics(result)
        total = ChunkedMetaGradient(dict(self.named_parameters()))
        for chunk in chunks:
            try:
                part = self._run_chunk(theta, tasks, chunk, inner, task_fn, run_chunk)
            except AllTasksSkippedError:
                part = None
            total.add(chunk.tasks, part)
        return _metrics(total.finish())


def support_start(
    learner: MetaLearner,
    start: Mapping[str, Tensor],
    data: tuple[Tensor, Tensor],
    task: Task,
) -> InnerStart:
    """The `InnerStart` of an inner loop from ``start`` (every parameter, detached) on
    ``data`` ``(x [N, ...], y [N])``: the parameters with a rate at step 0 are the variables
    (as `metalearn.engine.inner` selects them), the others and the buffers are held fixed.

    Raises:
        ValueError: no parameter is adapted at the first inner step.
    """
    lr = learner.learning_rate()
    adapted = learner.fast_weight_names([task])
    keys = [
        k for k in start
        if (adapted is None or k in adapted)
        and hyper_at(lr, k, 0) is not None
    ]  # fmt: skip
    if not keys:
        raise ValueError(
            f"{type(learner).__name__} adapts no parameter at its first inner step; give it "
            "a learning rate for some parameter (or adapt_keys naming some)"
        )
    x, y = data
    fixed = {**learner.buffers_dict(), **{k: v for k, v in start.items() if k not in keys}}
    kwargs = dict(task.model_kwargs)

    def loss(adapted: dict[str, Tensor]) -> Tensor:
        out = functional_call(learner.model, {**fixed, **adapted}, (x,), kwargs)
        return learner.loss_fn(out, y)

    return InnerStart(loss, {k: start[k] for k in keys})


def adapted_keys(
    model: nn.Module,
    adapt_keys: Collection[str] | None,
    adapt_norm: bool,
    sized_now: bool = False,
) -> list[str] | None:
    """The ``adapt_keys`` a learner that takes ``adapt_norm`` starts from.

    What its inner loop holds out is read from the forward when it first sees a task
    (`MetaLearner.fast_weight_names`). A learner that builds per-parameter state at
    construction (``sized_now``: Meta-SGD's and MAML++'s rates, learned inner
    hyperparameters) sizes it before any input exists, so it leaves out the parameters of
    the model's norm modules by type (`metalearn.models.norm_parameter_names`), as before;
    a parameter that guess misses and the forward shows to be a normalisation weight keeps a
    rate that goes unused.

    Args:
        model: the network.
        adapt_keys: the parameters the learner was asked to adapt (None: all).
        adapt_norm: adapt the normalisation weights too.
        sized_now: the learner builds per-parameter state from the result at construction.

    Returns:
        ``adapt_keys`` as given, except that for ``sized_now`` with ``adapt_norm`` False, None
        becomes every parameter outside the norm modules (in the model's order).
    """
    if adapt_norm or not sized_now or adapt_keys is not None:
        return None if adapt_keys is None else list(adapt_keys)
    norms = set(norm_parameter_names(model))
    return [n for n, _ in model.named_parameters() if n not in norms] if norms else None


def _signature(value: object) -> object:
    """A forward keyword argument as a cache key: itself when it is a plain value (a branch
    index), else its type (a tensor argument does not change which calls the forward makes
    in any network of this package)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(value)


def _metrics(result: MetaBatch) -> StepMetrics:
    return StepMetrics(
        float(result.loss.detach()), float(result.accuracy), len(result.skipped), result.vectorized
    )


def _evaluation_loop(inner: InnerLoop) -> InnerLoop:
    """``inner`` with detached learning rates and optimizer hyperparameters: evaluation
    builds no graph to them."""
    return replace(inner, lr=detached(inner.lr), optimizer=inner.optimizer.detached())


def check_loop_only(learner: MetaLearner, name: str) -> None:
    """Raise if a learner that runs its tasks in a loop was asked for ``vectorize="vmap"``."""
    if learner.vectorize not in ("auto", "loop"):
        raise ValueError(
            f"{name} runs its tasks in a Python loop; vectorize={learner.vectorize!r} is not "
            "supported, pass vectorize='loop' or 'auto'"
        )
    if learner.gradient_checkpointing:
        raise ValueError(
            f"{name} keeps no graph through the inner loop, so gradient_checkpointing=True "
            "does nothing; drop it"
        )
