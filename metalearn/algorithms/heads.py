"""Learners whose per-task classifier is solved from the support features: no inner loop.

A metric or closed-form head (Snell et al., 2017; Bertinetto et al., 2019; Lee et al., 2019)
embeds a task's support and query sets with the backbone ``f`` (the model up to its linear
``head``), solves a linear classifier ``(W [C, D], b [C])`` on the support features, and
scores the query features with it; the meta-loss is the query loss, differentiated through
the solve into the backbone. Every such head is a `HeadLearner`: a
`metalearn.algorithms.base.MetaLossLearner` whose per-task meta-loss (`head_task_loss`, a
`metalearn.engine.TaskFn`) runs through the engine's planner, chunks, vmap or loop, and
``--compile``, as MAML's does. It differs from MAML's in two ways:

* the model's own ``head`` is not used (its parameters get no gradient): ``f`` is the model
  called with an identity head (as `metalearn.algorithms.protomaml` does), and the head is
  the solved one;
* the head is sized per task, from the task's labels: classes ``0..C-1`` with ``C`` at most
  the support size. Under vmap a task's class count is not a Python number, so the solve
  runs on ``columns`` = the support size and the logits of classes with no support example
  are set to ``-inf``: the softmax, loss and accuracy are those of the task's own ``C``-way
  head exactly. So a learner trains ``--train-ways`` classes per task and tests ``--ways``.

`HeadLearner.start` (and so `adapt`) is theta with the model's ``head.weight`` and
``head.bias`` replaced by the solved head (which has the model's ``ways`` rows), so the
deployed model (`metalearn.deploy`) computes what `HeadLearner.evaluate` scores.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.base import InnerStart, MetaLossLearner
from metalearn.algorithms.protomaml import reads_support_moments
from metalearn.engine import (
    InnerLoop,
    NonFiniteLossError,
    Task,
    TaskCall,
    TaskFn,
    TaskResult,
    accuracy,
)

__all__ = [
    "HeadLearner",
    "LinearHead",
    "class_targets",
    "features",
    "head_logits",
    "head_task_loss",
]


class LinearHead(NamedTuple):
    """A task's solved classifier: ``logits = features @ weight.T + bias``, masked."""

    weight: Tensor
    """``[C, D]``."""
    bias: Tensor
    """``[C]``."""
    present: Tensor
    """``[C]`` bool: the classes with a support example (the others' logits are -inf)."""

    def logits(self, x: Tensor) -> Tensor:
        """``[N, C]`` logits of features ``x [N, D]``; -inf for absent classes."""
        out = x @ self.weight.T + self.bias
        return torch.where(self.present, out, torch.full_like(out, float("-inf")))


def class_targets(labels: Tensor, columns: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One-hot targets ``[S, columns]`` of ``labels [S]`` and which columns occur ``[columns]``.

    Written as a comparison so that it runs under vmap (labels outside ``0..columns-1``
    give an all-zero row).
    """
    onehot = (labels[:, None] == torch.arange(columns, device=labels.device)).to(dtype)
    return onehot, onehot.sum(0) > 0


def features(
    model: nn.Module,
    params: Mapping[str, Tensor],
    x: Tensor,
    *,
    head: str = "head",
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """The backbone's features ``[N, D]``: the model's output with an identity ``head``.

    Args:
        model: a network whose last layer is the linear ``head`` (``{head}.weight [N, D]``).
        params: theta, name -> tensor.
        x: inputs ``[N, ...]``.
        head, buffers, model_kwargs: the head's name; as for ``functional_call``.
    """
    weight = params[f"{head}.weight"]
    dim = weight.shape[1]
    identity = {f"{head}.weight": torch.eye(dim, dtype=weight.dtype, device=weight.device)}
    if f"{head}.bias" in params:
        identity[f"{head}.bias"] = weight.new_zeros(dim)
    return functional_call(
        model, {**(buffers or {}), **params, **identity}, (x,), dict(model_kwargs or {})
    )


def head_task_loss(
    model: nn.Module,
    params: Mapping[str, Tensor],
    call: TaskCall,
    *,
    learner: HeadLearner,
) -> TaskResult:
    """One task's meta-loss: solve the head on the support features, score the query.

    A `metalearn.engine.TaskFn` once ``learner`` is bound (`HeadLearner.task_fn`); the same
    function under vmap and in the loop. Its ``support_losses`` are empty (no inner step).
    """
    logits = head_logits(model, params, call, learner=learner)
    loss = call.inner.loss_fn(logits, call.query[1])
    if call.check_finite and not torch.isfinite(loss):
        raise NonFiniteLossError("query", call.task_index, None, float(loss))
    return TaskResult(loss, accuracy(logits, call.query[1]), loss.new_zeros(0))


def head_logits(
    model: nn.Module,
    params: Mapping[str, Tensor],
    call: TaskCall,
    *,
    learner: HeadLearner,
    columns: int | None = None,
) -> Tensor:
    """The query logits ``[Q, C]`` of the head solved on the task's support features.

    ``C`` is ``columns``, by default `HeadLearner.columns` (the support size: a number vmap
    knows; the classes with no support example are -inf).

    ``learner.transductive`` (or a network without norm layers): the support and the query
    sets are embedded each in its own batch (the query's batch norm reads the query set's
    statistics). Otherwise the two go
    through one forward whose batch norms take their statistics from the support rows alone
    (``norm_rows``, as `metalearn.algorithms.protomaml.support_normed_query`): the support
    features are the same, and each query's are those of that query on its own beside the
    support set, so a query is classified independently of the others (inductive).
    """
    (xs, ys), (xq, _) = call.support, call.query
    embed = partial(features, model, params, head=learner.head, buffers=call.buffers)
    columns = columns or learner.columns(ys)
    if not learner.support_moments:
        # The support set, its solve, then the query, in that order: a compiled graph then
        # draws a dropout network's masks in eager's order.
        solved = learner.solve(embed(xs, model_kwargs=call.model_kwargs), ys, columns)
        return solved.logits(embed(xq, model_kwargs=call.model_kwargs))
    kwargs = {**(call.model_kwargs or {}), "norm_rows": xs.shape[0]}
    both = embed(torch.cat([xs, xq]), model_kwargs=kwargs)
    return learner.solve(both[: xs.shape[0]], ys, columns).logits(both[xs.shape[0] :])


class HeadLearner(MetaLossLearner):
    """A `MetaLossLearner` whose classifier is solved per task (see the module docstring).

    Subclasses define `solve`. Inner-loop arguments (``inner_lr``, ``inner_steps``,
    ``first_order``, ``adapt_keys``, ``gradient_checkpointing``) do not apply and are not
    taken; the ``steps`` of `evaluate` and `adapt` are ignored.

    Args:
        model: the network, with a linear classifier named ``head`` that has a bias.
        head: the classifier's name.
        transductive: embed the query set in its own batch (its batch norms read the query
            set's statistics; the default, as these learners have trained here); False:
            each query beside the support set, its batch norms at the support set's
            statistics (`head_logits`), so every query is classified on its own, in
            training and evaluation alike.
        **kwargs: as for `metalearn.algorithms.base.MetaLearner` (``loss_fn``,
            ``vectorize``, ``on_nonfinite``, ``chunk_size``).

    Raises:
        ValueError: the model has no 2-d ``{head}.weight`` and ``{head}.bias``; not
            ``transductive`` with a network that cannot read the support set's statistics
            (`metalearn.algorithms.protomaml.reads_support_moments`).
    """

    fixed_arguments = (
        "inner_lr",
        "inner_steps",
        "first_order",
        "adapt_keys",
        "gradient_checkpointing",
    )
    head_sized_per_task = True
    has_inner_loop = False
    measures_curvature = False  # no inner loop: no support Hessian where it starts
    scores_adapted_weights = False  # the query is scored by the solved head

    def __init__(
        self, model: nn.Module, head: str = "head", *, transductive: bool = True, **kwargs: Any
    ) -> None:
        params = dict(model.named_parameters())
        weight, bias = params.get(f"{head}.weight"), params.get(f"{head}.bias")
        if weight is None or weight.dim() != 2 or bias is None:
            raise ValueError(
                f"{type(self).__name__} replaces the model's linear head by a solved one, but "
                f"the model has no 2-d {head + '.weight'!r} with a {head + '.bias'!r}; pass "
                "head= the name of its last nn.Linear (with a bias)"
            )
        for name in self.fixed_arguments:
            if kwargs.pop(name, None) not in (None, False, 0, 0.0):
                raise ValueError(f"{type(self).__name__} has no inner loop; drop {name}")
        # No inner loop: the meta-gradient has no second-order inner terms to drop, and
        # first_order=True tells the planner so (the fused-norm vmap blocker is about those).
        super().__init__(model, inner_lr=0.0, inner_steps=0, first_order=True, **kwargs)
        self.head = head
        self.transductive = transductive
        self.support_moments = reads_support_moments(model, transductive, type(self).__name__)

    @property
    def evaluation_norm(self) -> str:
        """``"transductive"`` (the query set in its own batch) or ``"support"`` (each query
        at the support set's batch-norm statistics)."""
        return "support" if self.support_moments else "transductive"

    def query_logits(self, task: Task, steps: int | None = None) -> Tensor:
        """The solved head's logits on ``task``'s query inputs, ``[Q, C]`` with ``C`` the
        task's classes (`head_logits`): the predictions `evaluate` scores. ``steps`` is
        ignored (no inner loop)."""
        call = TaskCall.of(task, self.inner_loop(tasks=[task]), buffers=self.buffers_dict())
        classes = int(task.support[1].max()) + 1
        with torch.no_grad():
            return head_logits(self.model, self.theta(), call, learner=self, columns=classes)

    @abc.abstractmethod
    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """The task's head from its support features.

        Args:
            support: support features ``[S, D]``.
            labels: their classes ``[S]``, in ``0..columns-1``.
            columns: the head's rows ``C``.

        Returns:
            A `LinearHead` of ``C`` rows, differentiable w.r.t. ``support`` and the
            learner's own parameters.
        """

    def columns(self, labels: Tensor) -> int:
        """The rows of the head solved in training and evaluation: the support size, a
        static number under vmap (absent classes are masked; see the module docstring)."""
        return labels.shape[-1]

    def task_fn(self) -> TaskFn:
        """`head_task_loss` with this learner's head."""
        return partial(head_task_loss, learner=self)

    def inner_start(self, task: Task) -> InnerStart:
        """Refused: the head is solved in closed form, no inner loop descends a support loss.

        Raises:
            ValueError: always, naming the learner.
        """
        raise ValueError(
            f"{type(self).__name__} solves its head in closed form and has no inner loop, so "
            "there is no support loss where an inner loop starts; measure a MAML-family learner"
        )

    def inner_loop(
        self,
        steps: int | None = None,
        first_order: bool | None = None,
        tasks: Sequence[Task] = (),
    ) -> InnerLoop:
        """No inner step, whatever ``steps`` asks (`adapt` and `evaluate` ignore it)."""
        return super().inner_loop(0, first_order=True, tasks=tasks)

    def start(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall
    ) -> dict[str, Tensor]:
        """theta with the model's head replaced by the task's solved head.

        The head has the model's ``ways`` rows, so the deployed network (`adapt`) scores
        the task's classes as `evaluate` does; training and `evaluate` solve heads sized
        per task instead (`head_task_loss`, this learner's `task_fn`).

        Raises:
            ValueError: the support set's classes are not ``0..ways-1``, each present.
        """
        ways = params[f"{self.head}.weight"].shape[0]
        x, y = call.support
        classes = sorted(set(y.tolist()))
        if classes != list(range(ways)):
            raise ValueError(
                f"the support set's labels must be 0..{ways - 1}, each with an example (the "
                f"model's head has {ways} outputs); got classes {classes}"
            )
        support = features(model, params, x, head=self.head, buffers=call.buffers,
                           model_kwargs=call.model_kwargs)  # fmt: skip
        solved = self.solve(support, y, ways)
        return {**params, f"{self.head}.weight": solved.weight, f"{self.head}.bias": solved.bias}
