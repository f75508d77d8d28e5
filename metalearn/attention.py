"""Which attention kernel a differentiated forward runs: the rule for transformers.

``F.scaled_dot_product_attention`` (what `nn.MultiheadAttention` and
`nn.TransformerEncoderLayer` call) picks a fused kernel by default: on a CPU, torch 2.13's
``_scaled_dot_product_flash_attention_for_cpu``. Its backward is itself a fused op with no
derivative (``derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is
not implemented``), no forward-mode formula and no vmap batching rule. Second-order MAML
differentiates the inner gradient (Finn et al., 2017, Eq. 1 inside Eq. 2), and a
Hessian-vector product differentiates a gradient, so the forward whose backward is
differentiated again must run the math kernel, written from matmuls and a softmax, which
autograd differentiates to any order. One rule, in one place (`attention_kernel`):

* **twice differentiated** (the inner loop's support forward when ``first_order=False``, the
  HVP tools' ``f``): the math kernel (``sdpa_kernel(SDPBackend.MATH)``);
* **under vmap** (a vmapped meta-batch, whatever the order): the math kernel too, the fused
  one having no batching rule (torch falls back to a slow loop over the batch, and warns);
* **once, unbatched** (first order, the query forward, plain training): torch's default
  choice, the fast fused kernel. Nested inside a twice-differentiated block (a Hessian of the
  meta-loss), a block differentiated once keeps the math kernel: ``False`` never undoes an
  outer ``True``.

Either way `nn.MultiheadAttention`'s fast path (``torch._native_multi_head_attention``, taken
in eval mode when nothing requires grad, e.g. an evaluation's query forward under
``torch.no_grad``) is switched off for the call: it has no vmap batching rule and no
derivative, and under ``functional_call`` the one path of the module's Python code is the one
the tests check. The switch is torch's process-wide flag, set for the call and restored after
it; inside a graph being compiled it is left alone (Dynamo cannot trace the flag's setter, and
a compiled meta-gradient differentiates everything, which already keeps the fast path off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["attention_kernel"]


@contextmanager
def attention_kernel(twice_differentiated: bool, inputs: Tensor | None = None) -> Iterator[None]:
    """Run the attention of the code inside with the kernel its derivatives need.

    Example::

        with attention_kernel(twice_differentiated=not first_order, inputs=x):
            loss = loss_fn(functional_call(model, params, (x,)), y)

    Args:
        twice_differentiated: whether the forward's backward is itself differentiated
            (second-order meta-gradients, Hessian-vector products).
        inputs: the forward's input batch, read only to see whether it runs under
            ``torch.func.vmap``.

    Yields:
        Nothing; attention inside runs the math kernel when ``twice_differentiated`` or
        ``inputs`` is batched by vmap, otherwise torch's default (fused) kernel; the
        settings are restored after.
    """
    math = twice_differentiated or (inputs is not None and _under_vmap(inputs))
    kernel = sdpa_kernel(SDPBackend.MATH) if math else nullcontext()
    with kernel, _without_mha_fast_path():
        yield


def _under_vmap(x: Tensor) -> bool:
    """Whether ``x`` is a tensor batched by ``torch.func.vmap`` (a data batch is batched at
    its outermost level: the grad transforms wrap parameters, not the data)."""
    if torch.compiler.is_compiling():  # a compiled graph decomposes attention itself
        return False
    return torch._C._functorch.is_batchedtensor(x)


@contextmanager
def _without_mha_fast_path() -> Iterator[None]:
    """`nn.MultiheadAttention`'s fused fast path off for the block, restored after it."""
    if torch.compiler.is_compiling():  # see the module's docstring
        yield
        return
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
