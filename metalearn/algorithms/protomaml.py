"""Proto-MAML (Triantafillou et al., 2020, Sec. 4): MAML whose head starts at the prototypes.

MAML meta-learns one initial head for every task, although a task's labels are a random
order of its classes: the best such head is one that favours no label, and the inner loop
must build the classifier from it in a few steps. Proto-MAML instead starts each task's
inner loop from the head a prototypical network (Snell et al., 2017) would use. With
``f`` the network up to its head and ``c_k`` the mean of ``f(x)`` over class ``k``'s
support examples (its prototype), the negative squared distance is linear in ``f(x)``::

    -||f(x) - c_k||^2 = 2 c_k . f(x) - ||c_k||^2 - ||f(x)||^2

and the last term is the same for every class, so the head ``W_k = 2 c_k``,
``b_k = -||c_k||^2`` classifies as the prototypical network does (the paper's Eq. in
Sec. 4, "Proto-MAML"). The inner loop then adapts every weight, head included, as MAML
does. The prototypes depend on theta, and the meta-gradient flows through them exactly
(second order unless ``first_order``): nothing is detached.

The defaults are the reference's learner configuration (google-research/meta-dataset,
``meta_dataset/learn/gin/learners/maml_init_with_proto_config.gin``, its
``MAMLLearner``): first order (fo-Proto-MAML), 5 inner steps at 0.01 on the mean support
loss, batch norm's offset and scale held at theta in the inner loop
(``adapt_batch_norm = False``: ``gradient_descent_step`` in
``meta_dataset/learners/optimization_learners.py`` skips variables named ``offset`` or
``scale``), and the query set normalised with the support set's batch-norm moments at the
adapted weights, differentiated through (``Learner.transductive_batch_norm = False``,
``backprop_through_moments = True``: `support_normed_query`). docs/algorithms.md lists each
value with its line; the ``cpu`` preset of ``experiments/omniglot_maml.py`` names the
learner its documented result was measured with (0.4, 1 step, second order, norm layers
adapted, the query in its own batch).

The meta-learned head of the model is not used: `prototype_head` replaces it, and its
parameters get no gradient. ``f`` is computed by calling the model with an identity head,
so any model whose head is a ``nn.Linear`` named ``head`` (`metalearn.models.Conv4`,
`metalearn.models.ResNet12`) works without changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.base import MetaLossLearner, adapted_keys
from metalearn.engine import QueryFn, TaskCall, query_outputs
from metalearn.models.norm import NORM_TYPES, MetaBatchNorm

__all__ = ["ProtoMAML", "prototype_head", "reads_support_moments", "support_normed_query"]


def prototype_head(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    *,
    head: str = "head",
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Tensor]:
    """The head's weights from the support set's class prototypes.

    Args:
        model: the network; ``{head}.weight`` ``[N, D]`` (and ``{head}.bias`` ``[N]``, if
            present) are its linear classifier on ``D`` features.
        params: theta, name -> tensor.
        support: ``(x [S, ...], y [S])``, labels in ``0..N-1``, every class present.
        head: the classifier's name.
        buffers, model_kwargs: as for ``functional_call``.

    Returns:
        ``{head.weight: 2 c [N, D], head.bias: -||c||^2 [N]}``, ``c`` the prototypes.
    """
    weight = params[f"{head}.weight"]
    ways, dim = weight.shape
    identity = {f"{head}.weight": torch.eye(dim, dtype=weight.dtype, device=weight.device)}
    has_bias = f"{head}.bias" in params
    if has_bias:
        identity[f"{head}.bias"] = weight.new_zeros(dim)
    x, y = support
    features = functional_call(  # [S, D]: the model's output with an identity head
        model, {**(buffers or {}), **params, **identity}, (x,), dict(model_kwargs or {})
    )
    # [S, N] one-hot, written as a comparison so that it runs under vmap.
    onehot = (y[:, None] == torch.arange(ways, device=y.device)).to(features.dtype)
    prototypes = (onehot.T @ features) / onehot.sum(0)[:, None]  # [N, D]
    out = {f"{head}.weight": 2 * prototypes}
    if has_bias:
        out[f"{head}.bias"] = -(prototypes**2).sum(1)
    return out


def support_normed_query(model: nn.Module, params: Mapping[str, Tensor], call: TaskCall) -> Tensor:
    """The query outputs ``[Q, ...]`` at ``params`` with every batch norm reading the support
    set's moments (a `metalearn.engine.QueryFn`): the support and query images in one
    forward whose batch norms take their statistics from the support rows alone
    (``norm_rows``), the query rows returned. Each query output is then independent of
    the other queries, and the moments are differentiated through, as meta-dataset's
    ``transductive_batch_norm = False`` with ``backprop_through_moments = True``."""
    (xs, _), (xq, _) = call.support, call.query
    kwargs = {**(call.model_kwargs or {}), "norm_rows": xs.shape[0]}
    out = functional_call(model, {**(call.buffers or {}), **params}, (torch.cat([xs, xq]),), kwargs)
    return out[xs.shape[0] :]


def reads_support_moments(model: nn.Module, transductive: bool, learner: str) -> bool:
    """Whether ``learner`` (its name, for the message) normalises the query with the support
    set's statistics: not ``transductive`` and the model has normalisation layers (without,
    both readings are the same forward).

    Raises:
        ValueError: the non-transductive reading on a model whose forward takes no
            ``norm_rows`` or whose norm layers are not all `MetaBatchNorm`.
    """
    norms = [m for m in model.modules() if isinstance(m, NORM_TYPES)]
    if transductive or not norms:
        return False
    takes = "norm_rows" in inspect.signature(model.forward).parameters
    if not takes or any(not isinstance(m, MetaBatchNorm) for m in norms):
        raise ValueError(
            f"{learner} normalises the query with the support set's batch-norm statistics, "
            "which needs a network whose forward takes norm_rows and whose norm layers are "
            "MetaBatchNorm (Conv4, ResNet12, R2D2Net); pass transductive=True to normalise "
            "the query in its own batch"
        )
    return True


class ProtoMAML(MetaLossLearner):
    """MAML with each task's head initialised from its support prototypes.

    Args:
        model: the network, with a linear classifier named ``head``.
        head: the classifier's name.
        inner_lr: the inner step size on the mean support loss; 0.01, the reference's
            ``MAMLLearner.alpha`` (its loss is ``tf.losses.softmax_cross_entropy``, the mean).
        inner_steps: inner steps in training; 5, its ``num_update_steps`` (it evaluates
            with the same: ``additional_evaluation_update_steps = 0``).
        first_order: treat the inner gradients as constants; True, its ``first_order``
            (the prototypes still carry the meta-gradient to theta, as in the reference).
        adapt_norm: adapt the normalisation layers' weights in the inner loop too; False,
            its ``adapt_batch_norm``.
        transductive: normalise the query set with its own batch-norm statistics; False,
            its ``transductive_batch_norm``: with the support set's (`support_normed_query`).
        **kwargs: as for `metalearn.algorithms.base.MetaLearner` (``adapt_keys`` may not
            name a normalisation parameter unless ``adapt_norm``).

    Raises:
        ValueError: the model has no ``{head}.weight`` of shape ``[N, D]``, or reads the
            support set's moments with a network that cannot (`reads_support_moments`).
    """

    omniglot_inner_defaults = False  # meta-dataset's values, set for ImageNet-like data

    def __init__(
        self,
        model: nn.Module,
        head: str = "head",
        *,
        inner_lr: float = 0.01,
        inner_steps: int = 5,
        first_order: bool = True,
        adapt_norm: bool = False,
        transductive: bool = False,
        **kwargs: Any,
    ) -> None:
        weight = dict(model.named_parameters()).get(f"{head}.weight")
        if weight is None or weight.dim() != 2:
            raise ValueError(
                f"Proto-MAML sets a linear head from prototypes, but the model has no 2-d "
                f"parameter {head + '.weight'!r}; pass head= the linear classifier's name"
            )
        named = kwargs.get("adapt_keys")
        kwargs["adapt_keys"] = adapted_keys(model, named, adapt_norm)
        super().__init__(
            model, inner_lr=inner_lr, inner_steps=inner_steps, first_order=first_order, **kwargs
        )
        self.head = head
        self.adapt_norm, self._named_keys = adapt_norm, None if named is None else list(named)
        self.transductive = transductive
        self._support_moments = reads_support_moments(model, transductive, "Proto-MAML")

    @property
    def evaluation_norm(self) -> str:
        """``"support"``: each query normalised with the support set's statistics (the
        default), or ``"transductive"`` (the query set's own)."""
        return "support" if self._support_moments else "transductive"

    def query_fn(self) -> QueryFn:
        """`support_normed_query` unless ``transductive`` (or the model has no norm layers)."""
        return support_normed_query if self._support_moments else query_outputs

    def start(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall
    ) -> dict[str, Tensor]:
        """theta with its head set by `prototype_head` on the task's support set: where
        Proto-MAML's inner loop starts (theta's own head is never used)."""
        head = prototype_head(
            model, params, call.support, head=self.head, buffers=call.buffers,
            model_kwargs=call.model_kwargs,
        )  # fmt: skip
        return {**params, **head}
