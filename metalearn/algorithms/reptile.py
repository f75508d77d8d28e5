"""Reptile (Nichol, Achiam & Schulman, 2018, "On First-Order Meta-Learning Algorithms").

Per task, train a copy of theta with k steps of an optimizer on the task's training data,
giving phi_i; then move theta toward the adapted weights. The batched update of the paper's
Algorithm 2 is::

    theta <- theta + epsilon * mean_i (phi_i - theta)

`Reptile.backward` writes ``mean_i (theta - phi_i)`` into ``.grad``, so that
``torch.optim.SGD(lr=epsilon).step()`` is exactly that update (`Reptile.outer_optimizer`);
any other optimiser (the paper mentions Adam) takes the Reptile direction as its gradient.
The paper's runs start at epsilon = 1.0 and anneal it linearly to 0 over training
(`Reptile.outer_lr_factor`). No graph to theta is built: the inner loop is first order by
construction.

The inner loop is the reference code's (``openai/supervised-reptile``, ``reptile.py``,
``models.py``): each step trains on a mini-batch of ``inner_batch`` examples of the task's
training data (`minibatch_indices`: consecutive slices of a stream of random permutations),
with TensorFlow's Adam at ``beta1 = 0`` (`tf_adam_update`) on the sum of the mini-batch's
per-example losses (``inner_loss="sum"``: ``models.py`` hands ``minimize`` the vector of
per-example cross-entropies, which ``tf.gradients`` sums); evaluation adapts with
mini-batches of ``eval_inner_batch``. The reference's Adam slots (its moments and step count)
are TensorFlow variables that its Reptile never restores in training (``VariableState``
holds the trainable variables only): they carry on from task to task and from meta-step to
meta-step, and evaluation starts from them and discards what it changed. ``inner_state``
``"carried"`` does the same (`AdamSlots`, saved with the learner's state); ``"task"`` starts
each task from zero moments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from metalearn.algorithms.base import (
    InnerStart,
    MetaLearner,
    StepMetrics,
    accumulate_grad,
    check_loop_only,
    support_start,
)
from metalearn.algorithms.metasgd import keyed_names
from metalearn.engine import AllTasksSkippedError, NonFiniteLossError, Task, accuracy
from metalearn.functional import detached
from metalearn.optim import check_hyperparameter

__all__ = ["EVAL_SEED", "AdamSlots", "Reptile", "minibatch_indices", "tf_adam_update"]

Slots = tuple[int, dict[str, Tensor], dict[str, Tensor]]
"""Adam's state: the steps taken, and the first and second moments by parameter name."""

INNER_OPTIMIZERS = ("adam", "sgd")
"""Reptile's inner optimizers (``inner_optimizer``)."""
INNER_STATES = ("carried", "task")
"""Where the inner Adam's state starts (``inner_state``)."""
INNER_LOSSES = ("sum", "mean")
"""How a mini-batch's per-example losses make the inner loss (``inner_loss``)."""
EVAL_SEED = 0
"""Seed of each task's mini-batch order in `Reptile.evaluate` and `Reptile.adapt` (so a
task's numbers are a function of the task alone, and validation does not move training's
random stream)."""


def minibatch_indices(
    n: int, batch: int | None, count: int, generator: torch.Generator | None = None
) -> list[Tensor]:
    """``count`` mini-batches of ``0..n-1``, as the reference's ``_mini_batches`` draws them
    without replacement: random permutations of the ``n`` examples, one after another, cut
    into consecutive slices of ``batch`` (a slice may span two permutations).

    Args:
        n: examples in the task's training data.
        batch: examples per mini-batch; None: every example at every step (full batch, no
            randomness).
        count: mini-batches wanted.
        generator: the random stream (None: torch's global one).

    Returns:
        ``count`` index tensors ``[batch]`` (``[n]`` for a full batch).
    """
    if batch is None or count == 0:
        return [torch.arange(n)] * count
    needed = math.ceil(count * batch / n)
    stream = torch.cat([torch.randperm(n, generator=generator) for _ in range(needed)])
    return [stream[i * batch : (i + 1) * batch] for i in range(count)]


def tf_adam_update(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, t: int, lr: float, beta1: float,
    beta2: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One step of TensorFlow's ``AdamOptimizer`` (Kingma & Ba, 2015, the "efficient" form
    of Sec. 2, end): ``eps`` is added before the bias correction.

    ``m_t = beta1 m + (1 - beta1) g``, ``v_t = beta2 v + (1 - beta2) g^2``,
    ``p_t = p - lr sqrt(1 - beta2^t) / (1 - beta1^t) * m_t / (sqrt(v_t) + eps)``, for step
    ``t = 1, 2, ...``; all tensors of ``p``'s shape. Returns ``(p_t, m_t, v_t)``.
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    rate = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
    return p - rate * m / (v.sqrt() + eps), m, v


class AdamSlots(nn.Module):
    """The inner Adam's state carried from task to task, as buffers (so a checkpoint holds it
    and a resumed run continues it): ``m`` and ``v`` of each adapted parameter, and the
    number of steps taken.

    Args:
        params: the adapted parameters, name -> tensor (the slots take their shapes).
    """

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.keys = keyed_names(params)
        for name, key in self.keys.items():
            self.register_buffer(f"m_{key}", torch.zeros_like(params[name]))
            self.register_buffer(f"v_{key}", torch.zeros_like(params[name]))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def read(self) -> Slots:
        """A copy of the state."""
        m = {n: self.get_buffer(f"m_{k}").clone() for n, k in self.keys.items()}
        v = {n: self.get_buffer(f"v_{k}").clone() for n, k in self.keys.items()}
        return int(self.steps), m, v

    def write(self, slots: Slots) -> None:
        """Store ``slots`` (the state after a meta-batch)."""
        steps, m, v = slots
        self.steps.fill_(steps)
        for n, k in self.keys.items():
            self.get_buffer(f"m_{k}").copy_(m[n])
            self.get_buffer(f"v_{k}").copy_(v[n])


class Reptile(MetaLearner):
    """Reptile: theta moves toward each task's adapted weights.

    The inner loop trains on the task's *training* data, as in the paper (Alg. 1-2): the
    support set by default, so the reported query loss and accuracy are held-out numbers
    after adaptation. ``train_on_query=True`` trains on support and query together: the
    reference trains on ``--train-shots`` examples per class, more than it evaluates with
    (the presets set ``query`` to the difference); the reported query metrics are then
    training metrics.

    Defaults: the reference's Omniglot 5-way commands (``openai/supervised-reptile``,
    ``README.md``): 5 inner iterations of Adam at 1e-3 with ``beta1 = 0`` on the summed
    loss of mini-batches of 10, evaluation mini-batches of 5; outer step 1.0 annealed
    linearly to 0.

    Args:
        model: the network; its parameters are theta.
        inner_lr: the inner optimizer's step size (``--learning-rate``).
        inner_steps: k, the inner iterations per task (``--inner-iters``). Per-task
            ``Task.steps`` and ``Task.stop`` apply.
        inner_optimizer: ``"adam"`` (the reference's ``AdamOptimizer(beta1=0)``) or
            ``"sgd"`` (plain gradient descent, ``--sgd``).
        inner_state: ``"carried"`` (Adam's state carries on across tasks and meta-steps, as
            in the reference's TensorFlow graph; evaluation starts from it and discards its
            changes) or ``"task"`` (zero moments at each task's start).
        inner_beta1, inner_beta2, inner_eps: Adam's (TensorFlow's form, `tf_adam_update`).
        inner_loss: ``"sum"`` (the reference's: ``loss_fn``, a mean over the mini-batch,
            times the mini-batch's size, the sum of the per-example losses that
            ``supervised_reptile/models.py`` lines 27-30 minimise) or ``"mean"``
            (``loss_fn`` itself). Under Adam the two differ through ``inner_eps`` alone
            (the sum is the mean scaled by the batch size, which Adam's step divides out
            but for its epsilon); under SGD the step is the batch size times larger.
        inner_batch: examples per inner mini-batch in training (``--inner-batch``); None:
            the whole training data at every step.
        eval_inner_batch: the same in `evaluate` and `adapt` (``--eval-batch``).
        transductive: score the query set in one batch (its examples share batch-norm
            statistics, ``--transductive``); False: each query example in a batch with the
            support set alone, its logits the last row (the reference's default,
            ``Reptile._test_predictions``).
        train_on_query: train the inner loop on support + query (concatenated along dim 0)
            instead of the support set only.
        anneal: anneal the outer step size linearly to 0 over training
            (``--meta-step-final 0``); False keeps it constant.
        **kwargs: as for `MetaLearner` (``adapt_keys``, ``loss_fn``, ``on_nonfinite``).
            ``vectorize`` must be ``"auto"`` or ``"loop"``.
    """

    takes_inner_optimizer = True

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 1e-3,
        inner_steps: int = 5,
        inner_optimizer: Literal["adam", "sgd"] = "adam",
        inner_state: Literal["carried", "task"] = "carried",
        inner_beta1: float = 0.0,
        inner_beta2: float = 0.999,
        inner_eps: float = 1e-8,
        inner_loss: Literal["sum", "mean"] = "sum",
        inner_batch: int | None = 10,
        eval_inner_batch: int | None = 5,
        transductive: bool = False,
        train_on_query: bool = False,
        anneal: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("first_order", True) is not True:
            raise ValueError(
                "Reptile is first order by definition (no graph through the inner loop); "
                "drop first_order=False, or use MAML for second-order meta-gradients"
            )
        super().__init__(
            model, inner_lr=inner_lr, inner_steps=inner_steps, first_order=True, **kwargs
        )
        check_loop_only(self, "Reptile")
        if inner_optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"Reptile's inner_optimizer {inner_optimizer!r}; choose one of "
                             f"{', '.join(INNER_OPTIMIZERS)}")  # fmt: skip
        if inner_state not in INNER_STATES:
            raise ValueError(f"inner_state {inner_state!r}; choose one of "
                             f"{', '.join(INNER_STATES)}")  # fmt: skip
        if inner_loss not in INNER_LOSSES:
            raise ValueError(f"Reptile's inner_loss {inner_loss!r}; choose one of "
                             f"{', '.join(INNER_LOSSES)}")  # fmt: skip
        for name, value in (("beta1", inner_beta1), ("beta2", inner_beta2), ("eps", inner_eps)):
            check_hyperparameter(name, value, f"inner_{name}")
        for name, value in (("inner_batch", inner_batch), ("eval_inner_batch", eval_inner_batch)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: the whole set), got {value}")
        self.inner_optimizer = inner_optimizer
        self.inner_state = inner_state
        self.inner_loss = inner_loss
        self.adam = (inner_beta1, inner_beta2, inner_eps)
        if self.carries_state:
            theta = self.theta()
            self.adam_slots = AdamSlots({k: theta[k].detach() for k in self._adapted()})
        self.inner_batch = inner_batch
        self.eval_inner_batch = eval_inner_batch
        self.transductive = transductive
        self.train_on_query = train_on_query
        self.anneal = anneal

    fixed_arguments = ("first_order",)
    default_outer_lr = 1.0  # the reference's --meta-step 1 (every README command)
    default_outer_optimizer = "sgd"  # plain SGD: exactly Alg. 2's update
    scores_adapted_weights = False  # each query is scored beside the support set

    @property
    def carries_state(self) -> bool:
        """Whether the inner Adam's state carries on from task to task (`AdamSlots`)."""
        return self.inner_optimizer == "adam" and self.inner_state == "carried"

    @property
    def evaluation_norm(self) -> str:
        """``"transductive"`` (the query set in one batch) or, by default,
        ``"beside_support"``: each query example in a batch with the support set (`_logits`)."""
        return "transductive" if self.transductive else "beside_support"

    def _adapted(self) -> list[str]:
        """The names of the parameters the inner loop trains (``adapt_keys``; None: all)."""
        return list(self.theta()) if self.adapt_keys is None else list(self.adapt_keys)

    def _slots(self) -> Slots:
        """Where a task's inner Adam starts: the carried state, or zero moments."""
        if self.carries_state:
            return self.adam_slots.read()
        theta = self.theta()
        zeros = {k: torch.zeros_like(theta[k]).detach() for k in self._adapted()}
        return 0, zeros, {k: z.clone() for k, z in zeros.items()}

    def outer_optimizer(self, lr: float | None = None) -> torch.optim.Optimizer:
        """Plain SGD with step epsilon (None: 1.0): exactly Alg. 2's update on `backward`'s
        ``.grad``."""
        return torch.optim.SGD(self.parameters(), lr=self.default_outer_lr if lr is None else lr)

    def outer_lr_factor(self, step: int, total: int) -> float:
        """``1 - step / total`` (epsilon annealed linearly to 0, the reference's
        ``frac_done`` interpolation in ``train.py``), or 1.0 without ``anneal``."""
        return 1.0 - step / total if self.anneal else 1.0

    def backward(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate ``mean_i (theta - phi_i)`` into ``.grad`` of theta.

        Training mini-batches are drawn from torch's global random stream (a run saves and
        restores it, so a resumed run draws what an uninterrupted one would). The tasks run
        one after another; with a carried inner state, each starts from the state the
        previous one left (a skipped task leaves none), and the last one's is kept.

        Args:
            tasks: the meta-batch (T tasks).

        Returns:
            `StepMetrics` with the mean query loss and accuracy of the adapted weights.
        """
        if not tasks:
            raise ValueError("the meta-batch is empty; pass at least one Task")
        theta = self.theta()
        start = detached(theta)
        directions, losses, accs, skipped = [], [], [], 0
        slots = self._slots()
        for i, task in enumerate(tasks):
            try:
                fast, after = self._train(start, task, self._train_data(task), None,
                                          self.inner_batch, None, i, slots)  # fmt: skip
                loss, acc = self._query(fast, task, i)
            except NonFiniteLossError:
                if self.on_nonfinite == "raise":
                    raise
                skipped += 1
                continue
            slots = after if self.carries_state else self._slots()
            # Alg. 2: the direction is theta - phi_i, so a descent step moves toward phi_i.
            directions.append({k: start[k] - fast[k] for k in start})
            losses.append(loss)
            accs.append(acc)
        if not directions:
            raise AllTasksSkippedError(len(tasks))
        mean = {k: torch.stack([d[k] for d in directions]).mean(0) for k in start}
        accumulate_grad(theta, mean)
        if self.carries_state:
            self.adam_slots.write(slots)
        return StepMetrics(
            float(torch.stack(losses).mean()), float(torch.stack(accs).mean()), skipped, 0
        )

    def adapt(self, task: Task, steps: int | None = None) -> dict[str, Tensor]:
        """Fast weights for one task (evaluation, deployment): the inner loop on the support
        set with mini-batches of ``eval_inner_batch`` (their order seeded by `EVAL_SEED`)."""
        return self._evaluation_fast(detached(self.theta()), task, steps, None)

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss and accuracy per task after `adapt` with ``steps`` inner steps:
        ``([T], [T])``; NaN for a task whose loss is not finite under
        ``on_nonfinite="skip"``. Each task draws its mini-batches from `EVAL_SEED`, as
        `adapt` does, so a task's numbers do not depend on the tasks beside it."""
        theta = detached(self.theta())
        losses, accs = [], []
        for i, task in enumerate(tasks):
            try:
                loss, acc = self._query(self._evaluation_fast(theta, task, steps, i), task, i)
            except NonFiniteLossError:
                if self.on_nonfinite == "raise":
                    raise
                loss = acc = torch.tensor(float("nan"))
            losses.append(loss)
            accs.append(acc)
        return torch.stack(losses), torch.stack(accs)

    def query_logits(self, task: Task, steps: int | None = None) -> Tensor:
        """The query outputs ``[Q, C]`` that `evaluate` scores: at `adapt`'s weights, each
        query beside the support set, or the query batch (``transductive``)."""
        fast = self._evaluation_fast(detached(self.theta()), task, steps, None)
        with torch.no_grad():
            return self._logits(fast, task)

    def _evaluation_fast(
        self, theta: Mapping[str, Tensor], task: Task, steps: int | None, index: int | None
    ) -> dict[str, Tensor]:
        """`adapt`'s fast weights: the inner loop on the support set from ``theta`` and the
        inner state's start, mini-batches of ``eval_inner_batch`` ordered by `EVAL_SEED`."""
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return self._train(theta, task, task.support, steps, self.eval_inner_batch, gen, index,
                           self._slots())[0]  # fmt: skip

    def inner_start(self, task: Task) -> InnerStart:
        """The loss at theta on the data the inner loop trains on (support, plus the query
        with ``train_on_query``)."""
        return support_start(self, self.start_of(task), self._train_data(task), task)

    def _train_data(self, task: Task) -> tuple[Tensor, Tensor]:
        """The task's training data: the support set, or support + query (dim 0)."""
        if not self.train_on_query:
            return task.support
        return (torch.cat([task.support[0], task.query[0]]),
                torch.cat([task.support[1], task.query[1]]))  # fmt: skip

    def _train(
        self,
        theta: Mapping[str, Tensor],
        task: Task,
        data: tuple[Tensor, Tensor],
        steps: int | None,
        batch: int | None,
        generator: torch.Generator | None,
        index: int | None,
        slots: Slots,
    ) -> tuple[dict[str, Tensor], Slots]:
        """phi: ``steps`` (None: the task's, else ``inner_steps``) inner iterations from
        ``theta`` on mini-batches of ``data``, without a graph, and Adam's state after them
        (from ``slots``; unchanged for SGD). Each step descends ``inner_loss``; the
        finiteness check and ``task.stop`` read ``loss_fn``'s value, the mean.

        Raises:
            NonFiniteLossError: a support loss that is not finite (naming task and step).
        """
        count = steps if steps is not None else (
            self.inner_steps if task.steps is None else task.steps)  # fmt: skip
        x, y = data
        keys = self._adapted()
        fast = dict(theta)
        buffers = dict(self.model.named_buffers())
        kwargs = dict(task.model_kwargs)

        def loss_of(adapted: dict[str, Tensor], xb: Tensor, yb: Tensor
                    ) -> tuple[Tensor, Tensor]:  # fmt: skip
            out = functional_call(self.model, {**buffers, **fast, **adapted}, (xb,), kwargs)
            mean = self.loss_fn(out, yb)
            # the reference's minimize(loss vector): tf.gradients sums the per-example losses
            return (mean * xb.shape[0] if self.inner_loss == "sum" else mean), mean

        taken, m, v = slots[0], dict(slots[1]), dict(slots[2])
        beta1, beta2, eps = self.adam
        for step, rows in enumerate(minibatch_indices(x.shape[0], batch, count, generator)):
            rows = rows.to(x.device)
            grads, (_, mean) = grad_and_value(loss_of, has_aux=True)(
                {k: fast[k] for k in keys}, x[rows], y[rows]
            )
            value = float(mean)
            if not math.isfinite(value):
                raise NonFiniteLossError("support", index, step, value)
            if task.stop is not None and task.stop(step, value):
                break
            if self.inner_optimizer == "sgd":
                fast.update({k: fast[k] - self.inner_lr * grads[k] for k in keys})
                continue
            taken += 1
            for k in keys:
                fast[k], m[k], v[k] = tf_adam_update(fast[k], grads[k], m[k], v[k], t=taken,
                                                     lr=self.inner_lr, beta1=beta1,
                                                     beta2=beta2, eps=eps)  # fmt: skip
        return fast, (taken, m, v)

    def _query(self, fast: Mapping[str, Tensor], task: Task, index: int | None
               ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """The query loss and accuracy at ``fast``, without a graph (`_logits`)."""
        with torch.no_grad():
            out = self._logits(fast, task)
            loss = self.loss_fn(out, task.query[1])
        if not torch.isfinite(loss):
            raise NonFiniteLossError("query", index, None, float(loss))
        return loss, accuracy(out, task.query[1])

    def _logits(self, fast: Mapping[str, Tensor], task: Task) -> Tensor:
        """The query outputs ``[Q, ...]``: of the query batch (``transductive``), or of each
        query example as the last row of the support set plus that example."""
        params = {**dict(self.model.named_buffers()), **fast}
        kwargs = dict(task.model_kwargs)
        xq = task.query[0]
        if self.transductive:
            return functional_call(self.model, params, (xq,), kwargs)
        xs = task.support[0]

        def last(x: Tensor) -> Tensor:
            batch = torch.cat([xs, x[None]])
            return functional_call(self.model, params, (batch,), kwargs)[-1]

        return torch.func.vmap(last)(xq)
