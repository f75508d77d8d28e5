"""`meta_batch`'s two paths (vmap buckets, Python loop) against each other, against finite
differences, and against running each task on its own; and the rule that picks the path.

All in float64 with fixed seeds and fixed tolerances, on Conv4(hidden=3) with 8x8 images
(318 parameters) and a small MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.engine import (
    InnerLoop,
    Task,
    TaskCall,
    TaskResult,
    Vectorize,
    adapt,
    meta_batch,
    plan,
    task_loss,
)
from metalearn.engine.outer import vmap_buckets
from metalearn.models import MLP, Conv4, MetaBatchNorm

F64 = torch.float64
Params = dict[str, Tensor]


def _conv(norm: str = "meta", seed: int = 0) -> Conv4:
    """Conv4 with MetaBatchNorm ("meta"), no batch norm ("none") or the fused kernel."""
    torch.manual_seed(seed)
    norm_layers: dict[str, Callable[[int], nn.Module]] = {
        "meta": MetaBatchNorm,
        "none": lambda c: nn.Identity(),
        "fused": lambda c: nn.BatchNorm2d(c, track_running_stats=False),
    }
    return Conv4(ways=3, hidden=3, norm_layer=norm_layers[norm]).to(F64)


def _image_task(seed: int, shots: int = 2, query: int = 2, ways: int = 3) -> Task:
    g = torch.Generator().manual_seed(seed)
    n_s, n_q = shots * ways, query * ways
    x = torch.randn(n_s + n_q, 1, 8, 8, generator=g, dtype=F64)
    y = torch.arange(n_s + n_q) % ways
    return Task((x[:n_s], y[:n_s]), (x[n_s:], y[n_s:]))


def _vector_task(seed: int, shots: int = 2, ways: int = 3, **kwargs) -> Task:
    g = torch.Generator().manual_seed(seed)
    n = shots * ways
    x = torch.randn(2 * n, 4, generator=g, dtype=F64)
    y = torch.arange(2 * n) % ways
    return Task((x[:n], y[:n]), (x[n:], y[n:]), **kwargs)


def _one_chunk_mode(
    model: nn.Module, tasks: list[Task], inner: InnerLoop, vectorize: Vectorize
) -> str:
    """The mode `plan` gives a meta-batch run as one chunk (what `meta_batch` runs)."""
    (chunk,) = plan(model, tasks, inner, vectorize, chunk_size=None)
    return chunk.mode


def _mlp(out: int = 3, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(4, [5], out, activation=nn.Tanh).to(F64)


def _theta(model: nn.Module) -> Params:
    return {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}


def _grads(loss: Tensor, theta: Params) -> Params:
    return dict(zip(theta, torch.autograd.grad(loss, list(theta.values()))))


def _assert_close(a: Params, b: Params, atol: float) -> None:
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol)


def _one_by_one(model: nn.Module, theta: Params, tasks: list[Task], inner: InnerLoop) -> Tensor:
    """The meta-batch loss written out: each task adapted on its own, then the mean."""
    losses = []
    for t in tasks:
        steps = inner.steps if t.steps is None else t.steps
        kwargs = dict(t.model_kwargs)
        fast = adapt(
            model, theta, t.support, steps=steps, lr=inner.lr, stop=t.stop,
            first_order=inner.first_order, adapt_keys=inner.adapt_keys, model_kwargs=kwargs,
        )  # fmt: skip
        out = functional_call(model, fast, (t.query[0],), kwargs)
        losses.append(F.cross_entropy(out, t.query[1]))
    return torch.stack(losses).mean()


# --------------------------------------------------------------------------- vmap vs loop


# Seed 1 without batch norm: with seed 0, 3 filters and no normalisation the features die
# (one task's are all zero), which would make the comparison weak.
@pytest.mark.parametrize(("norm", "seed"), [("meta", 0), ("none", 1)])
def test_vmap_and_loop_give_the_same_meta_gradient(norm: str, seed: int) -> None:
    model = _conv(norm, seed)
    theta = _theta(model)
    tasks = [_image_task(i) for i in range(4)]
    inner = InnerLoop(steps=2, lr=0.3)
    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    looped = meta_batch(model, theta, tasks, inner, vectorize="loop")
    assert (vmapped.vectorized, looped.vectorized) == (4, 0)
    torch.testing.assert_close(vmapped.task_losses, looped.task_losses, rtol=0, atol=1e-12)
    torch.testing.assert_close(vmapped.accuracy, looped.accuracy, rtol=0, atol=0)
    _assert_close(_grads(vmapped.loss, theta), _grads(looped.loss, theta), atol=1e-10)


def test_vmap_meta_gradient_with_batch_norm_matches_finite_differences() -> None:
    """Directional derivatives along random directions: the fused batch-norm kernel's trap
    (its vmapped second-order meta-gradient 10-72% off finite differences, measured in
    ``tests/models/test_models.py``) would show here.

    The step is small on purpose: with ReLU the inner gradient, hence the MAML objective,
    jumps where a pre-activation changes sign, and at eps=1e-5 one direction crosses such a
    jump (error 2e-3). At eps=1e-6 the errors were 8e-10, 4e-10 and 4e-9 (|grad.v| <= 2.4).
    """
    model = _conv("meta")
    theta = _theta(model)
    tasks = [_image_task(i) for i in range(3)]
    inner = InnerLoop(steps=2, lr=0.3)

    def objective(p: Params) -> Tensor:
        return meta_batch(model, p, tasks, inner, vectorize="vmap").loss

    grads = _grads(objective(theta), theta)
    g = torch.Generator().manual_seed(11)
    eps = 1e-6
    for _ in range(3):
        v = {k: torch.randn(t.shape, generator=g, dtype=F64) for k, t in theta.items()}
        with torch.no_grad():
            plus = objective({k: theta[k] + eps * v[k] for k in theta})
            minus = objective({k: theta[k] - eps * v[k] for k in theta})
        fd = float((plus - minus) / (2 * eps))
        analytic = float(sum((grads[k] * v[k]).sum() for k in theta))
        assert abs(analytic - fd) < 1e-7 * max(1.0, abs(fd))


def test_fused_batch_norm_refuses_vmap_and_auto_picks_the_loop() -> None:
    model = _conv("fused")
    theta = _theta(model)
    tasks = [_image_task(i) for i in range(3)]
    inner = InnerLoop(steps=2, lr=0.3)
    with pytest.raises(ValueError, match="MetaBatchNorm"):
        _one_chunk_mode(model, tasks, inner, "vmap")
    with pytest.raises(ValueError, match="MetaBatchNorm"):
        meta_batch(model, theta, tasks, inner, vectorize="vmap")
    assert _one_chunk_mode(model, tasks, inner, "auto") == "loop"
    # First order never takes the wrong mixed second derivative: vmap is allowed.
    assert _one_chunk_mode(model, tasks, InnerLoop(first_order=True), "vmap") == "vmap"

    # And the loop is right: the same net with MetaBatchNorm, vmapped, agrees.
    fused = meta_batch(model, theta, tasks, inner, vectorize="auto")
    assert fused.vectorized == 0
    reference = meta_batch(_conv("meta"), theta, tasks, inner, vectorize="vmap")
    _assert_close(_grads(fused.loss, theta), _grads(reference.loss, theta), atol=1e-10)


class _LayerNormNet(nn.Module):
    """Linear -> LayerNorm -> tanh -> head: the fused layer-norm kernel, affine by default."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6, elementwise_affine=affine)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.l1(x))))


def test_fused_layer_norm_refuses_vmap_and_the_loop_matches_finite_differences() -> None:
    """Measured (torch 2.13 CPU, float64): vmapped, this net's meta-gradient was 6e-4 off
    the loop (gradients up to 0.15) and its directional derivatives 3e-3 off finite
    differences, whenever ``norm.weight`` is adapted; F.batch_norm fails the same way.
    Without the affine weight, vmap and loop agree to 1e-16."""
    model = _LayerNormNet().to(F64)
    theta = _theta(model)
    tasks = [_vector_task(i) for i in range(3)]
    inner = InnerLoop(steps=2, lr=0.3)
    with pytest.raises(ValueError, match=r"layer_norm\(norm\.weight, norm\.bias\)"):
        _one_chunk_mode(model, tasks, inner, "vmap")
    assert _one_chunk_mode(model, tasks, inner, "auto") == "loop"
    plain = _LayerNormNet(affine=False).to(F64)
    assert _one_chunk_mode(plain, tasks, inner, "auto") == "vmap"

    def objective(p: Params) -> Tensor:
        return meta_batch(model, p, tasks, inner).loss

    grads = _grads(objective(theta), theta)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        v = {k: torch.randn(t.shape, generator=g, dtype=F64) for k, t in theta.items()}
        with torch.no_grad():
            plus = objective({k: theta[k] + 1e-5 * v[k] for k in theta})
            minus = objective({k: theta[k] - 1e-5 * v[k] for k in theta})
        fd = float((plus - minus) / 2e-5)
        assert abs(float(sum((grads[k] * v[k]).sum() for k in theta)) - fd) < 1e-8


# --------------------------------------------------------------------------- control flow


def test_per_task_steps_and_early_stopping_match_running_each_task_alone() -> None:
    model = _mlp()
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    tasks = [
        _vector_task(0, steps=1),
        _vector_task(1, steps=3),
        _vector_task(2, steps=5),
        _vector_task(3, steps=5, stop=lambda step, loss: step == 2),  # stops after 2 steps
        _vector_task(4),  # the meta-batch's default, 2 steps
    ]
    result = meta_batch(model, theta, tasks, inner)  # auto: the stop rule forces the loop
    assert result.vectorized == 0
    expected = _one_by_one(model, theta, tasks, inner)
    torch.testing.assert_close(result.loss, expected, rtol=0, atol=1e-12)
    _assert_close(_grads(result.loss, theta), _grads(expected, theta), atol=1e-12)
    # The stopped task is the 2-step task, not the 5-step one.
    two_steps = _one_by_one(model, theta, [_vector_task(3, steps=2)], inner)
    torch.testing.assert_close(result.task_losses[3], two_steps.detach(), rtol=0, atol=1e-12)


def test_per_task_steps_bucket_under_vmap() -> None:
    model = _mlp()
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    tasks = [_vector_task(i, steps=s) for i, s in enumerate([1, 3, 1, 5, 3])]
    result = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    assert result.vectorized == 4  # buckets {1: 2 tasks, 3: 2 tasks}; the 5-step task alone
    expected = _one_by_one(model, theta, tasks, inner)
    torch.testing.assert_close(result.loss, expected, rtol=0, atol=1e-12)
    _assert_close(_grads(result.loss, theta), _grads(expected, theta), atol=1e-10)


def test_tasks_of_different_ways_and_shots_bucket_by_shape() -> None:
    # One head of the largest ways (5); a 3-way task uses targets 0..2 of it.
    model = _mlp(out=5)
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    shapes = [(3, 1), (3, 2), (5, 1), (3, 1), (5, 1), (3, 2), (5, 2)]  # (ways, shots)
    tasks = [_vector_task(i, shots=s, ways=w) for i, (w, s) in enumerate(shapes)]
    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    looped = meta_batch(model, theta, tasks, inner, vectorize="loop")
    assert vmapped.vectorized == 6  # three buckets of two; (5, 2) alone runs in the loop
    torch.testing.assert_close(vmapped.task_losses, looped.task_losses, rtol=0, atol=1e-12)
    expected = _one_by_one(model, theta, tasks, inner)
    torch.testing.assert_close(vmapped.loss, expected, rtol=0, atol=1e-12)
    _assert_close(_grads(vmapped.loss, theta), _grads(looped.loss, theta), atol=1e-10)


class _Scaled(nn.Module):
    """An MLP whose input is scaled by a per-task tensor passed as a forward kwarg."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: Tensor, *, scale: Tensor) -> Tensor:
        return self.net(x * scale)


def test_tensor_kwargs_bucket_by_identity_not_by_their_rounded_repr() -> None:
    model = _Scaled()
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    # Both print as tensor(1.0000, dtype=torch.float64): keyed by repr they shared a bucket
    # and the second task silently ran with the first one's scale.
    a, b = torch.tensor(1.00001, dtype=F64), torch.tensor(1.00004, dtype=F64)
    tasks = [_vector_task(0, model_kwargs={"scale": s}) for s in (a, b, a)]
    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    assert vmapped.vectorized == 2  # the two tasks holding the same tensor
    expected = _one_by_one(model, theta, tasks, inner)
    torch.testing.assert_close(vmapped.loss, expected, rtol=0, atol=1e-12)
    assert vmapped.task_losses[0] != vmapped.task_losses[1]


class _InputPrecision(nn.Module):
    """A linear classifier that computes in its input's dtype (float64 weights cast to it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.linear.weight.to(x.dtype), self.linear.bias.to(x.dtype))


def test_tasks_of_different_dtypes_bucket_apart_and_each_runs_in_its_own() -> None:
    model = _InputPrecision()
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    tasks = [_vector_task(i) for i in range(4)]
    for i in (1, 3):  # float32 sets: stacked with the float64 ones they would be promoted
        (xs, ys), (xq, yq) = tasks[i].support, tasks[i].query
        tasks[i] = Task((xs.float(), ys), (xq.float(), yq))
    assert vmap_buckets(tasks, inner) == [[0, 2], [1, 3]]
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def recording(model: nn.Module, params: Params, call: TaskCall) -> TaskResult:
        result = task_loss(model, params, call)
        seen.append((call.support[0].dtype, result.loss.dtype))  # once per vmap call
        return result

    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap", task_fn=recording)
    looped = meta_batch(model, theta, tasks, inner, vectorize="loop")
    assert vmapped.vectorized == 4
    assert sorted(seen, key=str) == [(torch.float32, torch.float32), (F64, F64)]
    for i, rtol in [(0, 0.0), (2, 0.0), (1, 1e-6), (3, 1e-6)]:  # float32 rounds to ~1e-7
        torch.testing.assert_close(
            vmapped.task_losses[i], looped.task_losses[i], rtol=rtol, atol=1e-12
        )


# --------------------------------------------------------------------------- choosing a path


def test_one_chunk_mode_rule() -> None:
    model = _mlp()
    inner = InnerLoop()
    small = [_vector_task(i) for i in range(3)]  # 3 x 12 examples in all
    big = [_vector_task(i, shots=6) for i in range(30)]  # 30 x 36 = 1080 > 480 (the CPU limit)
    stopping = [*small, _vector_task(9, stop=lambda s, loss: False)]
    assert _one_chunk_mode(model, small, inner, "auto") == "vmap"
    assert _one_chunk_mode(model, small[:1], inner, "auto") == "loop"  # nothing to batch
    assert _one_chunk_mode(model, big, inner, "auto") == "loop"
    assert _one_chunk_mode(model, big, inner, "vmap") == "vmap"  # allowed, only slower
    assert _one_chunk_mode(model, stopping, inner, "auto") == "loop"
    assert _one_chunk_mode(model, small, InnerLoop(checkpoint=True), "auto") == "loop"
    assert _one_chunk_mode(model, small, inner, "loop") == "loop"
    with pytest.raises(ValueError, match="early-stopping"):
        _one_chunk_mode(model, stopping, inner, "vmap")
    with pytest.raises(ValueError, match="checkpoint"):
        _one_chunk_mode(model, small, InnerLoop(checkpoint=True), "vmap")
    with pytest.raises(ValueError, match="'vmap', 'loop' or 'auto'"):
        _one_chunk_mode(model, small, inner, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        meta_batch(model, _theta(model), [], inner)
