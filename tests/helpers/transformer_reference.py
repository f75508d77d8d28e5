"""A transformer classifier written out by hand: the reference the attention tests use.

`reference_logits` computes `metalearn.models.SequenceTransformer`'s function from its
parameter dict with elementary ops only (matmuls, a softmax, layer norm from mean and
variance), so its derivatives of every order are autograd's of those ops, independent of
torch's attention kernels. A LoRA copy's parameters (`metalearn.models.lora`) are merged into
the weights they update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def weight(p: Mapping[str, Tensor], name: str, scaling: float) -> Tensor:
    """A linear weight ``name`` plus its LoRA update ``scaling * B A`` where the dict has one."""
    layer = name.removesuffix(".weight")
    w = p[name]
    if f"{layer}.lora_A" in p:
        w = w + scaling * (p[f"{layer}.lora_B"] @ p[f"{layer}.lora_A"])
    return w


def layer_norm(h: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    mean = h.mean(-1, keepdim=True)
    var = ((h - mean) ** 2).mean(-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * w + b


def attention(p: Mapping[str, Tensor], at: str, h: Tensor, heads: int, scaling: float) -> Tensor:
    """Multi-head self-attention ``[N, L, E] -> [N, L, E]`` (Vaswani et al., 2017, Eq. 1)."""
    n, length, width = h.shape
    w_in = p[f"{at}.in_proj_weight"]
    if f"{at}.in_proj_lora_A" in p:
        w_in = w_in + scaling * (p[f"{at}.in_proj_lora_B"] @ p[f"{at}.in_proj_lora_A"])
    w_out = p[f"{at}.out_proj.weight"]
    if f"{at}.out_proj_lora_A" in p:
        w_out = w_out + scaling * (p[f"{at}.out_proj_lora_B"] @ p[f"{at}.out_proj_lora_A"])
    qkv = h @ w_in.T + p[f"{at}.in_proj_bias"]
    q, k, v = (t.reshape(n, length, heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n, length, width)
    return out @ w_out.T + p[f"{at}.out_proj.bias"]


def reference_logits(
    p: Mapping[str, Tensor], tokens: Tensor, *, heads: int, layers: int, scaling: float = 1.0
) -> Tensor:
    """`SequenceTransformer`'s logits ``[N, ways]`` of ``tokens [N, L]``, post-norm ReLU layers."""
    h = p["embed.weight"][tokens] + p["position"][: tokens.shape[-1]]
    for i in range(layers):
        at = f"encoder.layers.{i}"
        h = layer_norm(
            h + attention(p, f"{at}.self_attn", h, heads, scaling),
            p[f"{at}.norm1.weight"], p[f"{at}.norm1.bias"],
        )  # fmt: skip
        w1, w2 = (
            weight(p, f"{at}.linear1.weight", scaling),
            weight(p, f"{at}.linear2.weight", scaling),
        )
        ff = F.relu(h @ w1.T + p[f"{at}.linear1.bias"]) @ w2.T + p[f"{at}.linear2.bias"]
        h = layer_norm(h + ff, p[f"{at}.norm2.weight"], p[f"{at}.norm2.bias"])
    return h.mean(1) @ weight(p, "head.weight", scaling).T + p["head.bias"]


def reference_meta_gradient(
    p: Mapping[str, Tensor],
    tasks: list,
    adapt: list[str],
    *,
    lr: float,
    steps: int,
    heads: int,
    layers: int,
    scaling: float = 1.0,
    first_order: bool = False,
) -> dict[str, Tensor]:
    """MAML's meta-gradient (Finn et al., 2017, Eq. 1 inside Eq. 2) written out: a loop of
    ``steps`` inner steps on ``adapt`` with ``create_graph=True`` (or detached gradients for
    ``first_order``), the mean query loss over tasks, its gradient w.r.t. every parameter."""
    theta = {k: v.detach().clone().requires_grad_() for k, v in p.items()}

    def loss(q: Mapping[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(
            reference_logits(q, x, heads=heads, layers=layers, scaling=scaling), y
        )

    total = 0.0
    for task in tasks:
        phi = dict(theta)
        for _ in range(steps):
            grads = torch.autograd.grad(
                loss(phi, *task.support), [phi[k] for k in adapt], create_graph=not first_order
            )
            phi = {**phi, **{k: phi[k] - lr * g for k, g in zip(adapt, grads)}}
        total = total + loss(phi, *task.query)
    grads = torch.autograd.grad(total / len(tasks), list(theta.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(theta.items(), grads)}
