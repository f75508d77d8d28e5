"""Meta-Curvature (Park & Oliva, NeurIPS 2019): MAML whose inner gradient is transformed by a
meta-learned, Kronecker-factored matrix per layer.

The inner update (Park & Oliva, 2019, Eq. 5) is ``theta' = theta - alpha * M g`` with ``g``
the support loss's gradient and ``M`` a curvature matrix meta-learned with theta. For a
convolution kernel ``G`` of ``C_out x C_in x d`` entries (``d = k_h k_w``) the paper factors
``M`` as a Kronecker product, ``M = M_o (x) M_i (x) M_f`` (Eq. 7), applied as three small
tensor-matrix products (a mode product per axis, Eq. 8)::

    (M g)[o, i, f] = sum_{o', i', f'} M_o[o', o] M_i[i, i'] M_f[f, f'] G[o', i', f']

with ``M_o: C_out x C_out``, ``M_i: C_in x C_in``, ``M_f: d x d``; a fully connected weight
``[C_out, C_in]`` takes ``M_o`` and ``M_i`` alone, a bias an elementwise vector. Every factor
starts at the identity (ones for a bias), so the first meta-step's inner loop is MAML's. This is the
authors' code, ``silverbottlep/maml`` at ``e9ce654``, ``maml.py`` lines 70-91 (the factors,
``tf.diag([1.0] * n)``) and 100-118 (``transform_gradients``: ``M_out`` multiplies the
gradient from the right, ``M_f`` and ``M_in`` from the left, in TensorFlow's kernel layout
``[k_h, k_w, C_in, C_out]``); in torch's ``[C_out, C_in, k_h, k_w]`` the same sums read as
the formula above (for a linear weight, ``M_in G M_out`` there is ``M_out^T G M_in^T`` here):
on ``G`` flattened row-major, ``vec(M g) = (M_o^T (x) M_i (x) M_f) vec(G)``, ``M_o`` transposed
because it multiplies from the right.
The transform applies to every adapted parameter (the authors': every entry of MAML's
``weights`` dict, whose batch norm is not among them; here `MAML`'s ``adapt_norm`` decides).

The learner, `MetaCurvatureMAML` (``--algorithm metacurvature``), is `MAML` with this
inner update: its factors are ``learner.curvature`` (an ``nn.ParameterDict``), so
``learner.parameters()`` meta-learns them with theta (the paper's outer update); the inner loop
runs them through `MetaCurvatureSGD`, a `metalearn.optim.InnerOptimizer`, so the same code
runs under vmap and in the loop, second order through the factors and the gradient alike.
Its defaults are the authors' Omniglot 5-way commands (``README.md``: ``--update_lr=0.4
--num_updates=1 --meta_batch_size=32 --mc=True``, Adam 1e-3 from ``main.py``'s ``meta_lr``):
0.4 on a loss that ``utils.py``'s ``xent`` divides by K and ``tf.gradients`` sums over the
N K support examples, N = 5 times the mean, so 2.0 on the mean loss (as `MAML`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from metalearn.algorithms.maml import MAML
from metalearn.algorithms.metasgd import adapted_names, keyed_names
from metalearn.optim.base import InnerOptimizer

__all__ = ["MetaCurvatureMAML", "MetaCurvatureSGD", "curvature_factors", "transform_gradient"]


def curvature_factors(p: Tensor) -> list[Tensor]:
    """The factors of one parameter's curvature at their start (the identity).

    Args:
        p: a parameter: ``[C]`` (a bias), ``[C_out, C_in]`` (linear) or ``[C_out, C_in, *k]``
            (a convolution kernel).

    Returns:
        ``[ones(C)]``, ``[eye(C_out), eye(C_in)]`` or ``[eye(C_out), eye(C_in), eye(d)]``,
        on ``p``'s device and dtype.

    Raises:
        ValueError: a 0-dimensional parameter (no axis to factor).
    """
    like = dict(dtype=p.dtype, device=p.device)
    if p.dim() == 0:
        raise ValueError("Meta-Curvature transforms tensors of 1 or more dimensions, got a scalar")
    if p.dim() == 1:
        return [torch.ones(p.shape[0], **like)]
    sizes = [p.shape[0], p.shape[1]] + ([p[0, 0].numel()] if p.dim() > 2 else [])
    return [torch.eye(n, **like) for n in sizes]


def transform_gradient(g: Tensor, factors: list[Tensor]) -> Tensor:
    """``M g`` for one parameter's gradient (the module docstring's formula).

    Args:
        g: the gradient, a parameter's shape (see `curvature_factors`).
        factors: ``[m]`` (a bias: ``m * g``), ``[M_o, M_i]`` or ``[M_o, M_i, M_f]``.

    Returns:
        The transformed gradient, ``g``'s shape.
    """
    if g.dim() == 1:
        (m,) = factors
        return m * g
    if g.dim() == 2:
        m_out, m_in = factors
        return m_out.T @ g @ m_in.T  # the authors' M_in G M_out in TensorFlow's [in, out]
    m_out, m_in, m_f = factors
    flat = g.reshape(g.shape[0], g.shape[1], -1)  # [C_out, C_in, d]
    # One mode product at a time (Eq. 8), as the authors' three matmuls: a single einsum of
    # the four operands may contract the factors first, a C_out^2 C_in^2 d^2 tensor
    # (measured: 40x MAML's meta-step at 32 channels, out of memory at 64).
    out = torch.einsum("ao,abc->obc", m_out, flat)
    out = torch.einsum("ib,obc->oic", m_in, out)
    out = torch.einsum("fc,oic->oif", m_f, out)
    return out.reshape(g.shape)


@dataclass(frozen=True)
class MetaCurvatureSGD(InnerOptimizer):
    """The inner update ``p - lr * M g`` (`transform_gradient`), with no state.

    Attributes:
        factors: parameter name -> its factors (`curvature_factors`); a parameter without
            an entry steps as plain SGD.
    """

    factors: Mapping[str, list[Tensor]]

    def __post_init__(self) -> None:
        pass  # the factors are learned tensors, with no range to check

    def update_tensor(
        self,
        p: Tensor,
        g: Tensor,
        slots: tuple[Tensor, ...],
        lr: float | Tensor,
        *,
        name: str,
        step: int,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        factors = self.factors.get(name)
        return p - lr * (g if factors is None else transform_gradient(g, factors)), ()

    def detached(self) -> MetaCurvatureSGD:
        return MetaCurvatureSGD({k: [m.detach() for m in v] for k, v in self.factors.items()})


def factor_module(params: Mapping[str, Tensor], keys: Mapping[str, str]) -> nn.ParameterDict:
    """The learnable factors of the parameters ``keys`` names (name -> its ``nn.ParameterDict``
    key, `metalearn.algorithms.metasgd.keyed_names`), each at its start
    (`curvature_factors`), keyed ``"<key>/<axis>"``."""
    out = nn.ParameterDict()
    for name, key in keys.items():
        for axis, m in enumerate(curvature_factors(params[name].detach())):
            out[f"{key}/{axis}"] = nn.Parameter(m)
    return out


class MetaCurvatureMAML(MAML):
    """Meta-Curvature (Park & Oliva, 2019): `MAML` whose inner step is ``theta - alpha M g``
    (Eq. 5), ``M`` a Kronecker-factored matrix per adapted parameter (Eq. 7, `MetaCurvatureSGD`)
    meta-learned with theta, every factor starting at the identity (the authors' code).

    Its inner optimizer is that update, so the `InnerOptimizerLearner` choices are fixed
    (`fixed_arguments`); the rest are `MAML`'s, at the authors' values (the module docstring).
    The factors are meta-parameters, not the network's: `network_parameters` leaves them out,
    and a deployed network (`metalearn.deploy`) is the adapted model alone.

    Args:
        model: the network; its parameters are theta.
        inner_lr: alpha on the mean support loss (2.0: the authors' 0.4 on N = 5 times it).
        adapt_norm: adapt (and transform) the normalisation layers' weights too; False (the
            authors'): they are meta-learned only.
        **kwargs: as for `MAML`, less the inner optimizer's arguments.
    """

    fixed_arguments = ("inner_optimizer", "inner_momentum", "inner_beta1", "inner_beta2",
                       "inner_eps", "inner_alpha", "learn_inner_hyperparameters")  # fmt: skip
    takes_inner_optimizer = False

    def __init__(
        self, model: nn.Module, *, inner_lr: float = 2.0, adapt_norm: bool = False, **kwargs: Any
    ) -> None:
        if given := [k for k in self.fixed_arguments if k in kwargs]:
            raise ValueError(f"Meta-Curvature's inner update is its own; drop {', '.join(given)}")
        super().__init__(model, inner_lr=inner_lr, adapt_norm=adapt_norm, **kwargs)
        keys = keyed_names(adapted_names(model, self.adapt_keys))
        params = dict(model.named_parameters())
        self.curvature = factor_module(params, keys)
        self._factor_keys = {
            name: [k for k in self.curvature if k.rsplit("/", 1)[0] == key]
            for name, key in keys.items()
        }

    def factors(self) -> dict[str, list[Tensor]]:
        """Parameter name -> its factors (the ParameterDict's own tensors: gradients reach
        them)."""
        return {n: [self.curvature[k] for k in keys] for n, keys in self._factor_keys.items()}

    def inner_update(self) -> MetaCurvatureSGD:
        """``p - lr * M g`` with the current factors (Park & Oliva, 2019, Eq. 5)."""
        return MetaCurvatureSGD(self.factors())
