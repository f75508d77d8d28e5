"""A network's normalisation, read from what its forward does: which parameters flow into the
weight and bias of a normalisation call, and how each call normalises (`read_normalisation`).

One forward of the model on an example input runs under a ``torch.overrides.TorchFunctionMode``
that sees every normalisation function it calls: torch's (``F.batch_norm``, ``F.layer_norm``,
``F.group_norm``, ``F.instance_norm``, ``F.rms_norm`` and the ``torch.*`` functions beneath
them) and any function marked `normalising` (metalearn's own batch norm, written from
elementary ops, dispatches through ``torch.overrides.handle_torch_function`` so the same mode
sees it). The parameters are matched by tensor identity: the mode follows every tensor that
the forward derives from a parameter (an indexed per-step copy, a reshape), so a weight is
named by the parameters it comes from, never by a module's class or name. The answer
(`Normalisation`) is what MAML's ``adapt_norm`` holds out of the inner loop, what the planner
reads for vmap (`NormCall.vmap_exact`) and what the second-order tools refuse
(`NormCall.updates_running_stats`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "NormCall",
    "Normalisation",
    "Statistics",
    "normalising",
    "read_normalisation",
    "watching_normalisation",
]

Statistics = Literal["batch", "example", "running"]
"""What a call normalises with: the statistics of the whole batch (batch norm in training),
of each example alone (layer, group, instance and RMS norm), or running estimates (batch norm
in evaluation)."""

_Fn = TypeVar("_Fn", bound=Callable[..., Tensor])


@dataclass(frozen=True)
class NormCall:
    """One normalisation call of a forward."""

    function: str
    """The function called, by its qualified name (``torch.nn.functional.batch_norm``)."""
    parameters: tuple[str, ...]
    """Names of the parameters that flow into its weight and bias, in the model's order."""
    statistics: Statistics
    """What it normalises with (`Statistics`)."""
    updates_running_stats: bool
    """It writes running statistics in place (batch norm in training with buffers)."""
    vmap_exact: bool
    """Its second derivative under ``vmap`` equals the loop's. False for torch's fused batch
    norm with batch statistics, instance norm and layer norm, each with a weight: measured on
    torch 2.13 (CPU, float64) a vmapped MAML meta-gradient through them missed the loop's by
    0.16, 0.63 and 0.73; their unweighted forms, batch norm at running statistics, group norm,
    RMS norm and metalearn's elementary batch norm agreed to 2e-15."""


@dataclass(frozen=True)
class Normalisation:
    """Every normalisation call of one forward, in call order."""

    calls: tuple[NormCall, ...]

    def parameter_names(self) -> set[str]:
        """Names of every parameter flowing into a normalisation weight or bias."""
        return {name for call in self.calls for name in call.parameters}

    def vmap_inexact(self) -> list[NormCall]:
        """The calls whose vmapped second derivative is wrong (`NormCall.vmap_exact`)."""
        return [call for call in self.calls if not call.vmap_exact]


@dataclass(frozen=True)
class _Reading:
    """What one call of a normalisation function passes: its weight and bias, what it
    normalises with, whether it writes running statistics and whether vmap is exact."""

    affine: tuple[Tensor | None, ...]
    statistics: Statistics
    updates: bool
    vmap_exact: bool


def _batch_norm(training: bool, running: Tensor | None, weight: Tensor | None, bias: Any):
    statistics: Statistics = "batch" if training else "running"
    updates = training and running is not None
    return _Reading((weight, bias), statistics, updates, not (training and weight is not None))


def _instance_norm(use_input_stats: bool, running: Tensor | None, weight: Tensor | None, bias):
    statistics: Statistics = "example" if use_input_stats else "running"
    updates = use_input_stats and running is not None
    exact = not (use_input_stats and weight is not None)
    return _Reading((weight, bias), statistics, updates, exact)


# Each of torch's normalisation functions read from its own signature, its arguments named as
# torch names them (a call may pass any by keyword); the torch.* forms order them unlike the
# F.* ones they sit beneath.


def _f_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                  *args, **kwargs) -> _Reading:  # fmt: skip
    return _batch_norm(training, running_mean, weight, bias)


def _torch_batch_norm(input, weight, bias, running_mean, running_var, training, *args,
                      **kwargs) -> _Reading:  # fmt: skip
    return _batch_norm(training, running_mean, weight, bias)


def _f_instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                     use_input_stats=True, *args, **kwargs) -> _Reading:  # fmt: skip
    return _instance_norm(use_input_stats, running_mean, weight, bias)


def _torch_instance_norm(input, weight, bias, running_mean, running_var, use_input_stats,
                         *args, **kwargs) -> _Reading:  # fmt: skip
    return _instance_norm(use_input_stats, running_mean, weight, bias)


def _layer_norm(input, normalized_shape, weight=None, bias=None, *args, **kwargs) -> _Reading:
    return _Reading((weight, bias), "example", False, weight is None)


def _group_norm(input, num_groups, weight=None, bias=None, *args, **kwargs) -> _Reading:
    return _Reading((weight, bias), "example", False, True)


def _rms_norm(input, normalized_shape, weight=None, *args, **kwargs) -> _Reading:
    return _Reading((weight,), "example", False, True)


_TORCH: dict[Callable[..., Any], Callable[..., _Reading]] = {
    F.batch_norm: _f_batch_norm, torch.batch_norm: _torch_batch_norm,
    F.instance_norm: _f_instance_norm, torch.instance_norm: _torch_instance_norm,
    F.layer_norm: _layer_norm, torch.layer_norm: _layer_norm,
    F.group_norm: _group_norm, torch.group_norm: _group_norm,
    F.rms_norm: _rms_norm, torch.rms_norm: _rms_norm,
}  # fmt: skip


def normalising(*, statistics: Statistics, affine: tuple[str, ...] = ("weight", "bias")):
    """Mark a normalisation function written from elementary ops, so `read_normalisation`
    and `watching_normalisation` see its calls as they see ``F.batch_norm``'s.

    The function then dispatches through ``torch.overrides.handle_torch_function`` (a check
    that costs nothing unless a ``TorchFunctionMode`` is active or a tensor subclass is
    passed), and its second derivative under vmap is taken as exact: it is built from ops
    whose vmapped derivatives are (the marked function's own tests hold this).

    Args:
        statistics: what it normalises with (`Statistics`).
        affine: the names of its arguments that scale and shift the normalised input.
    """

    def mark(fn: _Fn) -> _Fn:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def dispatching(*args: Any, **kwargs: Any) -> Tensor:
            tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
            if has_torch_function(tensors):
                return handle_torch_function(dispatching, tensors, *args, **kwargs)
            return fn(*args, **kwargs)

        def read(*args: Any, **kwargs: Any) -> _Reading:
            bound = signature.bind(*args, **kwargs).arguments
            return _Reading(tuple(bound.get(a) for a in affine), statistics, False, True)

        dispatching.__normalisation__ = read  # type: ignore[attr-defined]
        return dispatching  # type: ignore[return-value]

    return mark


def _reader_of(func: Callable[..., Any]) -> Callable[..., _Reading] | None:
    """How to read a call of ``func``: torch's table, or the mark `normalising` left on it."""
    return _TORCH.get(func) or getattr(func, "__normalisation__", None)


class _Watch(TorchFunctionMode):
    """Follows which parameters each tensor derives from and hands every normalisation call,
    with the parameters flowing into its weight and bias, to ``on_call``."""

    def __init__(self, params: Mapping[str, Tensor], on_call: Callable[[NormCall], None]) -> None:
        super().__init__()
        self.order = {name: i for i, name in enumerate(params)}
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for name, tensor in params.items():
            self.origin[tensor] = self.origin.get(tensor, frozenset()) | {name}
        self.on_call = on_call

    def _from(self, values: Any) -> frozenset[str]:
        leaves = [t for t in tree_leaves(values) if isinstance(t, Tensor)]
        return frozenset().union(*(self.origin.get(t, frozenset()) for t in leaves))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if (reader := _reader_of(func)) is not None:
            reading = reader(*args, **kwargs)
            names = sorted(self._from(reading.affine), key=self.order.__getitem__)
            name = f"{getattr(func, '__module__', None) or 'torch'}.{func.__name__}"
            self.on_call(NormCall(name, tuple(names), reading.statistics, reading.updates,
                                  reading.vmap_exact))  # fmt: skip
        out = func(*args, **kwargs)
        if self.order and (origin := self._from((args, kwargs))):
            for leaf in tree_leaves(out):
                if isinstance(leaf, Tensor):
                    self.origin[leaf] = self.origin.get(leaf, frozenset()) | origin
        return out


@contextmanager
def watching_normalisation(
    params: Mapping[str, Tensor], on_call: Callable[[NormCall], None]
) -> Iterator[None]:
    """Inside the block, every normalisation call (torch's, or a `normalising` function's)
    is handed to ``on_call`` before it runs, named by the entries of ``params`` that flow
    into its weight and bias. ``on_call`` may raise to stop the call before it writes any
    buffer (the second-order tools' refusal of running-statistic updates)."""
    with _Watch(params, on_call):
        yield


def read_normalisation(
    model: nn.Module,
    x: Tensor,
    params: Mapping[str, Tensor] | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Normalisation:
    """The normalisation calls of one forward of ``model`` on ``x``.

    The forward runs as ``functional_call(model, {**buffers, **params}, (x,), kwargs)``
    without a graph, on copies of the buffers (a training-mode batch norm's running
    statistics are left as they were) and with torch's random state restored after it (a
    dropout layer draws nothing from the run's stream), in the model's current mode.

    Args:
        model: the network.
        x: an example input ``[N, ...]`` (a task's support set).
        params: the parameters, name -> tensor (None: ``model.named_parameters()``).
        buffers: the buffers (None: ``model.named_buffers()``).
        kwargs: keyword arguments of the forward.

    Returns:
        The `Normalisation`: each call, the parameters flowing into its weight and bias.
    """
    params = dict(model.named_parameters()) if params is None else dict(params)
    buffers = dict(model.named_buffers()) if buffers is None else buffers
    copies = {name: b.clone() for name, b in buffers.items()}
    calls: list[NormCall] = []
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices), _Watch(params, calls.append):
        functional_call(model, {**copies, **params}, (x,), dict(kwargs or {}))
    return Normalisation(tuple(calls))
