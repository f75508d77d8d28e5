"""MAML++ (Antoniou et al., 2019, "How to train your MAML"): MAML with five training fixes.

What is here, by the paper's names (Sec. 4):

* **MSL**, multi-step loss: the meta-loss of a task is ``sum_s w_s L_query(phi_{s+1})``
  over the inner steps, with weights annealed from uniform to the last step over the first
  ``msl_steps`` meta-steps, moving once every ``msl_epoch_length`` meta-steps (`msl_weights`).
  `multi_step_task_loss` computes it one inner step at a time; `metalearn.engine.outer` runs it in
  the vmap and loop modes alike (`MAMLpp.task_fn`).
* **DA**, derivative-order annealing: first order for the first ``first_order_steps``
  meta-steps, exact second order after.
* **LSLR**, per-layer per-step learning rates: a learnable ``Tensor[S]`` per adapted
  parameter tensor.
* **BNWB**, per-step batch-norm weights and biases: each inner step s uses its own copy of
  every `MetaBatchNorm` weight and bias (meta-learned, not adapted in the inner loop).
* **CA**, cosine annealing of the meta-optimiser's learning rate, is the run's outer loop:
  ``--lr-schedule cosine --eta-min 1e-5 --schedule-every 500`` (`metalearn.runs.outer_loop`).

The schedules are counted in meta-steps, which the training loop hands the learner
(`MAMLpp.schedule`). The defaults are the final Omniglot configurations of the reference
code (AntreasAntoniou/HowToTrainYourMAMLPytorch at 86964701,
``experiment_config/omniglot_maml++-omniglot_*.json``, read by ``utils/parser_utils.py``):
5 inner steps; initial rate 0.1 (the argparse default ``task_learning_rate``: the configs'
``init_inner_loop_learning_rate`` is never read); MSL over 10 epochs of 500 meta-steps
(``multi_step_loss_num_epochs``, ``total_iter_per_epoch``) with the weights moving once an
epoch (``few_shot_learning_system.py`` passes ``int(iter / 500)``); second order from the
start (``first_order_to_second_order_epoch: -1``); per-step batch norm; the norm layers
out of the inner loop (``enable_inner_loop_optimizable_bn_params: false``).

**BNRS** (per-step running statistics) does not apply: `MetaBatchNorm` is transductive and
keeps no running statistics (see `metalearn.models.batch_norm`); the reference's batch norm
normalises with the batch's statistics in training and evaluation alike (``F.batch_norm(...,
training=True)``), so its running statistics are never read either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from metalearn.algorithms.base import MetaLossLearner, _evaluation_loop, adapted_keys
from metalearn.algorithms.metasgd import adapted_names, keyed_names
from metalearn.engine import (
    InnerLoop,
    NonFiniteLossError,
    Task,
    TaskCall,
    TaskFn,
    TaskResult,
    run_inner_loop,
    task_loss,
)
from metalearn.functional import detached
from metalearn.models import MetaBatchNorm
from metalearn.optim import Hyperparameter

__all__ = ["MAMLpp", "batch_norm_names", "msl_weights", "multi_step_task_loss"]

StepParams = Sequence[Mapping[str, Tensor]]
"""Per inner step s, tensors that replace theta's entries during step s and the query after
it (BNWB); an index past the end uses the last entry, an empty sequence replaces nothing.
Give the replaced entries no learning rate: they are meta-learned, not adapted."""


def msl_weights(steps: int, progress: float, msl_steps: int) -> list[float]:
    """The multi-step-loss weights of Antoniou et al. (2019, Sec. 4, MSL) at ``progress``.

    Uniform ``1/S`` at 0; every non-final weight then falls by ``1/(S * msl_steps)`` per
    meta-step to a floor of ``0.03/S``, and the final weight rises by as much as they lose
    (to at most ``1 - (S-1) * 0.03/S``), so the weights always sum to 1. This is the
    reference code's ``get_per_step_loss_importance_vector`` with its epochs as
    ``msl_steps`` meta-steps (it is the same function of ``progress / msl_steps``).

    Args:
        steps: number of inner steps S (>= 1).
        progress: meta-steps taken (>= 0).
        msl_steps: meta-steps over which the non-final weights decay (>= 1).

    Returns:
        ``[w_0, ..., w_{S-1}]``, the weight of the query loss after each inner step.
    """
    if steps < 1 or msl_steps < 1 or progress < 0:
        raise ValueError(
            f"msl_weights needs steps >= 1, msl_steps >= 1 and progress >= 0, got "
            f"steps={steps}, msl_steps={msl_steps}, progress={progress}"
        )
    decay = 1.0 / steps / msl_steps
    floor = 0.03 / steps
    non_final = max(1.0 / steps - progress * decay, floor)
    final = min(1.0 / steps + progress * (steps - 1) * decay, 1.0 - (steps - 1) * floor)
    return [non_final] * (steps - 1) + [final]


def batch_norm_names(model: nn.Module) -> list[str]:
    """Names of the weight and bias of every `MetaBatchNorm` module of ``model``."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, MetaBatchNorm):
            names += [f"{prefix}.{p}" if prefix else p for p, _ in module.named_parameters()]
    return names


def multi_step_task_loss(
    model: nn.Module,
    params: Mapping[str, Tensor],
    call: TaskCall,
    *,
    step_weights: Sequence[float] | None = None,
    step_params: StepParams = (),
) -> TaskResult:
    """MAML++'s meta-loss of one task: ``sum_s w_s L_query(phi_{s+1})`` (MSL, with BNWB).

    A `metalearn.engine.outer.TaskFn` once the two settings below are bound, so it runs under
    ``meta_batch(..., task_fn=partial(multi_step_task_loss, step_weights=..., ...))`` in
    both modes. Each inner step is one ``run_inner_loop`` call of one step with that step's
    learning rate and ``step_params``, so it is the same computation as `adapt`'s loop.

    If ``call.stop`` ends the inner loop after t < S steps, the remaining steps count as
    no-ops: their weights go to the query loss of ``phi_t``.

    Args:
        model, params, call: as for `metalearn.engine.outer.task_loss`.
        step_weights: ``[w_0, ..., w_{S-1}]`` (Python floats: zero weights skip their query
            pass); None puts all weight on the last step (plain MAML's loss).
        step_params: per-step replacements of theta's entries (BNWB), see `StepParams`.

    Returns:
        A `TaskResult`: the weighted query loss, the final weights' query accuracy, and the
        support loss before each inner step taken, ``Tensor[steps_taken]``.
    """
    steps = call.inner.steps if call.steps is None else call.steps
    weights = [0.0] * (steps - 1) + [1.0] if step_weights is None else list(step_weights)
    if len(weights) != max(steps, 1):
        raise ValueError(
            f"step_weights has {len(weights)} entries but the task takes {steps} inner steps; "
            "give one weight per step (or leave Task.steps unset under MAML++'s MSL)"
        )
    fast, support_losses, loss = dict(params), [], None
    for s in range(steps):
        new, losses = _one_step(model, {**fast, **_at(step_params, s)}, call, s)
        if len(losses) == 0:
            break  # `stop` ended this task's inner loop before step s
        fast = new
        support_losses.append(losses[0])
        if s < steps - 1 and weights[s] != 0.0:
            result = _query(model, fast, _at(step_params, s), call, s)
            loss = _add(loss, weights[s] * result.loss)
    taken = len(support_losses)
    last = max(taken - 1, 0)
    final = _query(model, fast, _at(step_params, last), call, last)
    loss = _add(loss, sum(weights[min(taken, steps - 1) :]) * final.loss)
    stacked = torch.stack(support_losses) if support_losses else torch.zeros(0)
    return TaskResult(loss, final.accuracy, stacked)


def _one_step(
    model: nn.Module, params: dict[str, Tensor], call: TaskCall, step: int
) -> tuple[dict[str, Tensor], Tensor]:
    """Inner step ``step`` of ``call``'s task alone: a one-step `run_inner_loop` with that
    step's rate."""
    stop = call.stop
    shifted = None if stop is None else (lambda _, value: stop(step, value))
    one = replace(call.inner, steps=1, lr=_rate_at(call.inner.lr, step))
    try:
        return run_inner_loop(
            model, params, call.support, one, buffers=call.buffers,
            model_kwargs=call.model_kwargs, regularizer=call.regularizer, stop=shifted,
            check_finite=call.check_finite, task_index=call.task_index,
        )  # fmt: skip
    except NonFiniteLossError as error:  # it counted this step as step 0
        raise NonFiniteLossError(error.kind, call.task_index, step, error.value) from None


def _query(
    model: nn.Module,
    fast: Mapping[str, Tensor],
    overrides: Mapping[str, Tensor],
    call: TaskCall,
    step: int,
) -> TaskResult:
    """Query loss and accuracy of ``fast`` (with ``overrides``) after inner step ``step``.

    `task_loss` with zero inner steps is exactly that (its support set goes unused).
    """
    query_only = replace(call, support=call.query, steps=0, stop=None, regularizer=None)
    try:
        return task_loss(model, {**fast, **overrides}, query_only)
    except NonFiniteLossError as error:
        raise NonFiniteLossError(error.kind, error.task_index, step, error.value) from None


def _add(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total + term


def _rate_at(lr: Hyperparameter, step: int) -> Hyperparameter:
    """Step ``step``'s entry of a per-step list (clamped to the last), else ``lr`` itself."""
    if isinstance(lr, (list, tuple)):
        if not lr:
            raise ValueError("the per-step learning-rate list is empty; give at least one entry")
        return lr[min(step, len(lr) - 1)]
    return lr


def _at(step_params: StepParams, step: int) -> Mapping[str, Tensor]:
    return step_params[min(step, len(step_params) - 1)] if step_params else {}


class MAMLpp(MetaLossLearner):
    """MAML++ (Antoniou et al., 2019): MAML with MSL, DA, LSLR and BNWB (see the module).

    The trainer calls ``learner.schedule(step, total)`` before every meta-step; the step
    drives the MSL weights and the switch from first to second order. Evaluation (`adapt`,
    `evaluate`) uses the learned per-step rates and batch-norm copies and reports the final
    step only.

    Args:
        model: the network; its parameters are theta.
        inner_lr: the initial rate of every layer and step (LSLR).
        inner_steps: inner steps S >= 1 in training.
        msl_steps: meta-steps of multi-step loss; from this step on the meta-loss is the
            last inner step's query loss alone (as in the reference code). 0: no MSL.
        msl_epoch_length: meta-steps per epoch of MSL: the weights move once an epoch (at
            the reference's ``int(iter / 500)``); 1 moves them every meta-step.
        first_order_steps: meta-steps of first-order meta-gradients before exact second
            order (DA). 0: second order from the start.
        per_step_bn: give every inner step its own copy of each `MetaBatchNorm` weight and
            bias (BNWB), initialised from the model's. The copies are meta-learned and not
            adapted in the inner loop; the model's own batch-norm parameters then go unused.
            No effect on a model without `MetaBatchNorm`.
        adapt_norm: adapt the normalisation layers' weights in the inner loop (those that
            ``per_step_bn`` does not replace by per-step copies); False: meta-learned only.
        **kwargs: as for `metalearn.algorithms.base.MetaLearner` (``adapt_keys``, ...).
            ``first_order`` is not accepted: DA decides it from the meta-step.
    """

    fixed_arguments = ("first_order",)

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.1,
        inner_steps: int = 5,
        msl_steps: int = 5000,
        msl_epoch_length: int = 500,
        first_order_steps: int = 0,
        per_step_bn: bool = True,
        adapt_norm: bool = False,
        **kwargs: Any,
    ) -> None:
        if "first_order" in kwargs:
            raise ValueError(
                "MAML++ sets the derivative order from the meta-step (DA); pass "
                "first_order_steps (a large number for first order throughout, 0 for second "
                "order) instead"
            )
        if msl_epoch_length < 1:
            raise ValueError(
                f"msl_epoch_length={msl_epoch_length} must be >= 1 (meta-steps per epoch of "
                "MSL; the reference's 500, or 1 to move the weights every meta-step)"
            )
        named = kwargs.get("adapt_keys")
        kwargs["adapt_keys"] = adapted_keys(model, named, adapt_norm, sized_now=True)
        super().__init__(model, inner_lr=inner_lr, inner_steps=inner_steps, **kwargs)
        if self.inner_steps < 1:
            raise ValueError(f"MAML++ needs inner_steps >= 1, got {self.inner_steps}")
        if msl_steps < 0 or first_order_steps < 0:
            raise ValueError(
                f"msl_steps and first_order_steps must be >= 0, got {msl_steps} and "
                f"{first_order_steps}"
            )
        self.msl_steps, self.first_order_steps = msl_steps, first_order_steps
        self.msl_epoch_length = msl_epoch_length
        self.per_step_bn, self.adapt_norm = per_step_bn, adapt_norm
        self._named_keys = None if named is None else list(named)
        self.step = 0
        params = dict(model.named_parameters())
        bn = batch_norm_names(model) if per_step_bn else []
        if self.adapt_keys is not None and (both := sorted(set(bn) & set(self.adapt_keys))):
            raise ValueError(
                f"adapt_keys names batch-norm parameters {both[:4]}, which per_step_bn=True "
                "meta-learns per step instead of adapting; drop them or pass per_step_bn=False"
            )
        steps = self.inner_steps
        self._lr_keys = keyed_names(n for n in adapted_names(model, self.adapt_keys) if n not in bn)
        self.lrs = nn.ParameterDict({  # LSLR: one rate per adapted tensor and inner step
            key: torch.full((steps,), float(self.inner_lr), dtype=params[n].dtype,
                            device=params[n].device)
            for n, key in self._lr_keys.items()
        })  # fmt: skip
        self._bn_keys = keyed_names(bn)
        self.bn = nn.ParameterDict({  # BNWB: row s is step s's copy
            key: params[n].detach().expand(steps, *params[n].shape).clone()
            for n, key in self._bn_keys.items()
        })  # fmt: skip

    def schedule(self, step: int, total: int) -> dict[str, float]:
        """Set the meta-step that drives MSL's weights and DA's derivative order; returns
        ``train/second_order`` (1.0 from ``first_order_steps`` on, else 0.0) and
        ``train/msl_last_weight`` (the final inner step's weight in the meta-loss)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step = step
        return {"train/second_order": float(self.second_order),
                "train/msl_last_weight": self.step_weights()[-1]}  # fmt: skip

    @property
    def second_order(self) -> bool:
        """Whether the current meta-step uses exact second-order meta-gradients (DA)."""
        return self.step >= self.first_order_steps

    def step_weights(self) -> list[float]:
        """MSL's per-step weights now: `msl_weights` at the start of the current epoch of
        ``msl_epoch_length`` meta-steps (the reference's epoch ``int(iter / 500)`` is
        ``progress / 500``), or all on the last step after MSL."""
        if self.step < self.msl_steps:
            progress = self.step - self.step % self.msl_epoch_length
            return msl_weights(self.inner_steps, progress, self.msl_steps)
        return [0.0] * (self.inner_steps - 1) + [1.0]

    def learning_rate(self) -> list[dict[str, Tensor]]:
        """LSLR: per inner step, adapted parameter name -> that step's rate (0-dim)."""
        return [
            {name: self.lrs[key][s] for name, key in self._lr_keys.items()}
            for s in range(self.inner_steps)
        ]

    def step_params(self) -> list[dict[str, Tensor]]:
        """BNWB: per inner step, batch-norm parameter name -> that step's copy."""
        if not self._bn_keys:
            return []
        return [
            {name: self.bn[key][s] for name, key in self._bn_keys.items()}
            for s in range(self.inner_steps)
        ]

    def inner_loop(
        self,
        steps: int | None = None,
        first_order: bool | None = None,
        tasks: Sequence[Task] = (),
    ) -> InnerLoop:
        """`MetaLearner.inner_loop` with the derivative order of the current epoch (DA)."""
        return super().inner_loop(
            steps, not self.second_order if first_order is None else first_order, tasks
        )

    def task_fn(self) -> TaskFn:
        """`multi_step_task_loss` with the current MSL weights and batch-norm copies."""
        return partial(
            multi_step_task_loss, step_weights=self.step_weights(), step_params=self.step_params()
        )

    def start(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall
    ) -> dict[str, Tensor]:
        """theta with step 0's batch-norm copies (BNWB): where MAML++'s first inner step is
        taken (its parameters with a step-0 rate, LSLR, are the ones it adapts). Later
        steps swap in their own copies, so `task_fn` and `adapt` apply them step by step."""
        return {**params, **_at(self.step_params(), 0)}

    def adapt(self, task: Task, steps: int | None = None) -> dict[str, Tensor]:
        """Fast weights for one task, detached, with the final step's batch-norm copies."""
        steps = self.inner_steps if steps is None else steps
        inner = _evaluation_loop(self.inner_loop(steps, first_order=True, tasks=[task]))
        step_params = detached(self.step_params())
        fast = detached(self.theta())
        call = TaskCall(task.support, task.query, inner, buffers=self.buffers_dict(),
                        model_kwargs=task.model_kwargs, check_finite=True)  # fmt: skip
        with torch.no_grad():  # torch.func.grad inside still differentiates the support loss
            for s in range(steps):
                fast, _ = _one_step(self.model, {**fast, **_at(step_params, s)}, call, s)
        return {**fast, **_at(step_params, max(steps - 1, 0))}

    def network_parameters(self) -> list[Tensor]:
        """The model's weights and the per-step batch-norm copies (BNWB): the reference's
        classifier, whose gradients its ``meta_update`` clamps; not the LSLR rates."""
        return [*self.model.parameters(), *self.bn.values()]

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss and accuracy per task after ``steps`` inner steps: ``([T], [T])``.

        The final step's query loss (no MSL weights), with the learned per-step rates and
        batch-norm copies; otherwise as `MetaLearner.evaluate` (NaN for skipped tasks).
        """
        inner = _evaluation_loop(self.inner_loop(steps, first_order=True, tasks=tasks))
        task_fn = partial(multi_step_task_loss, step_params=detached(self.step_params()))
        return self._evaluate(tasks, inner, task_fn)
