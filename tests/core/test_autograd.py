"""Safe autograd Functions against independent references: torch's own ops where both are
finite, closed-form derivatives, finite differences (gradcheck), and loops for vmap."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, jvp, vmap

from metalearn.autograd import (
    clip_grad,
    safe_cross_entropy,
    safe_log,
    safe_log_softmax,
    safe_sigmoid,
)
from metalearn.second_order import hvp

# torch's forward-mode AD loads its decompositions through torch.jit.script, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

F64 = torch.float64
DTYPES = [torch.float32, torch.float64]
# "max" stands for torch.finfo(dtype).max, the largest finite number of the dtype.
MAGNITUDES = [1e4, 1e30, "max"]
# gradcheck everything: reverse and forward mode, and both batched (vmap) variants.
FULL = dict(check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


def _uniform(lo: float, hi: float, *shape: int, seed: int = 0) -> Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=_gen(seed), dtype=F64)


def _extremes(magnitude: float | str, dtype: torch.dtype) -> Tensor:
    v = torch.finfo(dtype).max if magnitude == "max" else magnitude
    return torch.tensor([-v, v, 0.0, -1.0, 2.0], dtype=dtype)


def _vjp(f: Callable[[Tensor], Tensor], x: Tensor, g: Tensor) -> Tensor:
    x = x.detach().requires_grad_(True)
    return torch.autograd.grad(f(x), x, g)[0]


def _sig_prime(x: Tensor) -> Tensor:
    # s(x)(1 - s(x)) = s(x) s(-x); torch.sigmoid(-x) keeps full relative accuracy in the tail
    # where 1 - s(x) rounds to 0.
    return torch.sigmoid(x) * torch.sigmoid(-x)


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: safe_sigmoid(x, grad_clip=-1.0), "grad_clip=None"),
        (lambda x: safe_sigmoid(x, grad_clip=0.0), "grad_clip must be a positive"),
        (lambda x: safe_sigmoid(x, grad_clip=math.nan), "grad_clip must be a positive"),
        (lambda x: clip_grad(x, -1.0), "largest gradient norm"),
        (lambda x: clip_grad(x, 0.0), "max_norm must be a positive finite"),
        (lambda x: clip_grad(x, math.inf), "do not wrap x in clip_grad"),
        (lambda x: safe_log(x, eps=-1e-3), "small positive floor"),
        (lambda x: safe_log(x.float(), eps=1e-40), "pass eps >= "),
        (lambda x: safe_cross_entropy(x[None], torch.tensor([0, 1])), "expected \\(1,\\)"),
        (lambda x: safe_cross_entropy(x[None], x[None, :2]), "one probability per logit"),
        (lambda x: safe_cross_entropy(x[None], torch.tensor([0]), label_smoothing=1.5), "0, 1"),
        (lambda x: safe_cross_entropy(x[None], torch.tensor([0]), reduction="avg"), "'mean'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_fix(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(torch.ones(3, dtype=F64))


# --------------------------------------------------------------------------- safe_sigmoid


def test_safe_sigmoid_values_equal_torch_sigmoid() -> None:
    x = torch.cat([torch.linspace(-40, 40, 801, dtype=F64), 5 * _randn(100)])
    torch.testing.assert_close(safe_sigmoid(x), torch.sigmoid(x), rtol=1e-15, atol=1e-300)


def test_safe_sigmoid_gradient_is_exact_in_the_tails() -> None:
    # torch.sigmoid's own gradient s(1 - s) rounds to 0 here; the true value is ~exp(-|x|).
    x = torch.tensor([-700.0, -50.0, -3.0, 0.0, 3.0, 40.0, 50.0, 700.0], dtype=F64)
    g = _vjp(lambda t: safe_sigmoid(t, grad_clip=None), x, torch.ones_like(x))
    torch.testing.assert_close(g, _sig_prime(x), rtol=1e-14, atol=0.0)
    assert (g > 0).all()


def test_safe_sigmoid_gradcheck_and_gradgradcheck_where_the_clip_is_inactive() -> None:
    x = (3 * _randn(6)).requires_grad_(True)
    # |g * s(1 - s)| <= 2 / 4 < grad_clip = 1 for every grad_output below.
    g = _uniform(-2.0, 2.0, 6, seed=1)
    fn = lambda t: safe_sigmoid(t, grad_clip=1.0)  # noqa: E731
    assert gradcheck(fn, (x,), **FULL)
    assert gradgradcheck(fn, (x,), (g,), check_fwd_over_rev=True, check_batched_grad=True)


def test_safe_sigmoid_gradgradcheck_where_the_clip_is_active() -> None:
    # The clipped gradient is the constant ±grad_clip, so its derivatives are 0, and finite
    # differences agree (every |g * s(1 - s)| is far from the kink at grad_clip).
    x = _uniform(-0.5, 0.5, 5).requires_grad_(True)
    g = torch.tensor([20.0, -20.0, 30.0, -40.0, 50.0], dtype=F64)
    fn = lambda t: safe_sigmoid(t, grad_clip=1.0)  # noqa: E731
    assert gradgradcheck(fn, (x,), (g,), check_fwd_over_rev=True)


def test_safe_sigmoid_clips_the_product_of_incoming_gradient_and_local_derivative() -> None:
    x = torch.tensor([-1.0, 0.0, 0.5, 3.0, 0.2], dtype=F64)
    g = torch.tensor([100.0, -100.0, 0.1, 10.0, 3.9], dtype=F64)
    unclipped = g * _sig_prime(x)
    assert (unclipped.abs() > 1.0).sum() == 2  # the clip matters for exactly two entries
    got = _vjp(lambda t: safe_sigmoid(t, grad_clip=1.0), x, g)
    clipped = unclipped.abs() > 1.0
    assert torch.equal(got[clipped], torch.tensor([1.0, -1.0], dtype=F64))
    torch.testing.assert_close(got[~clipped], unclipped[~clipped], rtol=1e-15, atol=0.0)
    # grad_clip=None lets the full product through.
    torch.testing.assert_close(
        _vjp(lambda t: safe_sigmoid(t, grad_clip=None), x, g), unclipped, rtol=1e-15, atol=0.0
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_safe_sigmoid_finite_at_extremes(dtype: torch.dtype, magnitude) -> None:
    x = _extremes(magnitude, dtype).requires_grad_(True)
    y = safe_sigmoid(x)
    assert torch.equal(y[:3], torch.tensor([0.0, 1.0, 0.5], dtype=dtype))
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.isfinite(y).all() and torch.isfinite(g).all() and torch.isfinite(gg).all()


def test_forward_over_reverse_hvp_is_the_jacobian_of_the_clipped_gradient() -> None:
    # The first two entries are clipped (|2 w s s'| ~ 4.5 > 1), the last two are not.
    x = torch.tensor([-0.2, 0.1, 3.0, -4.0], dtype=F64)
    w = torch.tensor([20.0, 20.0, 1.0, 1.0], dtype=F64)
    v = torch.tensor([0.3, -0.7, 0.5, 1.1], dtype=F64)

    def f(t: Tensor) -> Tensor:
        return (w * safe_sigmoid(t, grad_clip=1.0) ** 2).sum()

    clipped_grad = grad(f)
    assert torch.equal(clipped_grad(x)[:2], torch.ones(2, dtype=F64))
    fd = (clipped_grad(x + 1e-6 * v) - clipped_grad(x - 1e-6 * v)) / 2e-6
    fwd_rev = hvp(f, x, v)
    assert torch.equal(fwd_rev[:2], torch.zeros(2, dtype=F64))
    torch.testing.assert_close(fwd_rev, fd, rtol=1e-7, atol=1e-9)
    # Here the double backward's second pass does not clip, so it agrees too.
    torch.testing.assert_close(hvp(f, x, v, method="double-backward"), fwd_rev)


# --------------------------------------------------------------------------- clip_grad


def test_clip_grad_gradcheck_and_gradgradcheck() -> None:
    x = _randn(2, 3).requires_grad_(True)
    fn = lambda t: clip_grad(t, max_norm=1.0)  # noqa: E731
    assert gradcheck(fn, (x,), **FULL)
    # Inactive (||g|| < 1) and active (||g|| ~ 4.9 > 1, far from the kink) regions: the
    # rescaling map g -> g min(1, m / ||g||) is smooth in each.
    small = 0.1 * _randn(2, 3, seed=1)
    large = 2.0 * _randn(2, 3, seed=1)
    assert torch.linalg.vector_norm(small) < 0.9 and torch.linalg.vector_norm(large) > 1.5
    for g in (small, large):
        assert gradgradcheck(fn, (x,), (g,), check_fwd_over_rev=True, check_batched_grad=True)


def test_clip_grad_rescales_only_gradients_above_max_norm() -> None:
    x = torch.zeros(2, dtype=F64)
    fn = lambda t: clip_grad(t, max_norm=1.0)  # noqa: E731
    g = torch.tensor([3.0, 4.0], dtype=F64)  # norm 5
    torch.testing.assert_close(_vjp(fn, x, g), torch.tensor([0.6, 0.8], dtype=F64))
    small = torch.tensor([0.3, -0.4], dtype=F64)  # norm 0.5: passes bit for bit
    assert torch.equal(_vjp(fn, x, small), small)
    assert torch.equal(_vjp(fn, x, torch.zeros(2, dtype=F64)), torch.zeros(2, dtype=F64))
    # The norm is over the whole tensor, not per row.
    G = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(_vjp(fn, torch.zeros(2, 2, dtype=F64), G), G / 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_clip_grad_finite_at_extremes(dtype: torch.dtype, magnitude) -> None:
    # Incoming gradients as large as the values: the squared norm overflows, the result must
    # not (it keeps the direction, with norm max_norm).
    x = _extremes(magnitude, dtype)
    got = _vjp(lambda t: clip_grad(t, max_norm=2.0), x, x)
    a = x.abs().max()
    expected = (x / a) * (2.0 / torch.linalg.vector_norm(x / a))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=4 * torch.finfo(dtype).eps, atol=0.0)
    assert torch.equal(clip_grad(x, 2.0), x)


def test_clip_grad_under_vmap_clips_each_example() -> None:
    X, W = _randn(4, 3), _randn(4, 3, seed=1) * torch.tensor([[0.1], [1.0], [3.0], [10.0]])

    def loss(x: Tensor, w: Tensor) -> Tensor:
        return (clip_grad(x, max_norm=1.0) * w).sum()

    batched = vmap(grad(loss))(X, W)
    looped = torch.stack([grad(loss)(x, w) for x, w in zip(X, W)])
    torch.testing.assert_close(batched, looped, rtol=1e-15, atol=0.0)
    norms = W.norm(dim=1, keepdim=True)
    torch.testing.assert_close(batched, W / norms.clamp_min(1.0), rtol=1e-15, atol=1e-17)
    # A vmapped forward differentiated by plain autograd also clips per example.
    outside = _vjp(lambda x: vmap(lambda r: clip_grad(r, max_norm=1.0))(x), X, W)
    torch.testing.assert_close(outside, batched, rtol=1e-15, atol=0.0)


# --------------------------------------------------------------------------- safe_log


def test_safe_log_equals_log_above_eps_and_keeps_a_gradient_below() -> None:
    x = torch.cat([_uniform(1e-6, 10.0, 50), torch.tensor([1e-12, 1.0, 1e300], dtype=F64)])
    torch.testing.assert_close(safe_log(x), torch.log(x), rtol=1e-15, atol=0.0)
    torch.testing.assert_close(_vjp(safe_log, x, torch.ones_like(x)), 1 / x, rtol=1e-15, atol=0)
    below = torch.tensor([0.0, -1.0, 1e-20, -0.0], dtype=F64)
    assert torch.equal(safe_log(below, eps=1e-8), torch.full((4,), math.log(1e-8), dtype=F64))
    g = _vjp(lambda t: safe_log(t, eps=1e-8), below, torch.full((4,), 2.0, dtype=F64))
    assert torch.equal(g, torch.full((4,), 2.0 / 1e-8, dtype=F64))


def test_safe_log_gradcheck_and_gradgradcheck_above_eps() -> None:
    x = _uniform(0.5, 2.0, 6).requires_grad_(True)
    fn = lambda t: safe_log(t, eps=1e-3)  # noqa: E731
    assert gradcheck(fn, (x,), **FULL)
    assert gradgradcheck(fn, (x,), (_randn(6, seed=1),), check_fwd_over_rev=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_safe_log_finite_at_extremes(dtype: torch.dtype, magnitude) -> None:
    x = _extremes(magnitude, dtype).requires_grad_(True)
    y = safe_log(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.isfinite(y).all() and torch.isfinite(g).all() and torch.isfinite(gg).all()


# --------------------------------------------------------------------------- log-softmax, CE


@pytest.mark.parametrize("dim", [-1, 0])
def test_safe_log_softmax_gradcheck_and_gradgradcheck(dim: int) -> None:
    z = (3 * _randn(3, 4)).requires_grad_(True)
    fn = lambda t: safe_log_softmax(t, dim=dim)  # noqa: E731
    torch.testing.assert_close(fn(z), torch.log_softmax(z, dim), rtol=1e-14, atol=1e-14)
    assert gradcheck(fn, (z,), **FULL)
    assert gradgradcheck(fn, (z,), (_randn(3, 4, seed=1),), check_fwd_over_rev=True)


def test_safe_log_softmax_at_a_masked_logit_is_finite_with_torch_gradient() -> None:
    z = torch.tensor([[0.5, -math.inf, 1.0, -2.0]], dtype=F64)
    g = _randn(1, 4, seed=1)
    out = safe_log_softmax(z)
    assert out[0, 1] == -torch.finfo(F64).max
    keep = [0, 2, 3]
    torch.testing.assert_close(out[:, keep], torch.log_softmax(z[:, keep], -1), rtol=0, atol=0)
    # torch's gradient is finite here (only its value is -inf): ours must equal it.
    torch.testing.assert_close(
        _vjp(safe_log_softmax, z, g), _vjp(lambda t: torch.log_softmax(t, -1), z, g)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_log_softmax_and_cross_entropy_finite_at_extremes(dtype: torch.dtype, magnitude) -> None:
    z = torch.stack([_extremes(magnitude, dtype), -_extremes(magnitude, dtype)])
    z.requires_grad_(True)
    log_p = safe_log_softmax(z)
    (g,) = torch.autograd.grad(log_p.sum(), z)
    targets = torch.tensor([0, 2])  # the most negative logit of row 0: the largest loss
    soft = torch.softmax(_randn(2, 5, seed=1, dtype=dtype), -1)
    for tgt, smoothing in [(targets, 0.0), (targets, 0.1), (soft, 0.0)]:
        loss = safe_cross_entropy(z, tgt, label_smoothing=smoothing)
        (g_ce,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(loss) and torch.isfinite(g_ce).all()
    assert torch.isfinite(log_p).all() and torch.isfinite(g).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_safe_cross_entropy_equals_torch_where_finite(reduction: str, smoothing: float) -> None:
    z = (4 * _randn(6, 5)).requires_grad_(True)
    hard = torch.tensor([0, 4, 2, 2, 1, 3])
    soft = torch.softmax(_randn(6, 5, seed=1), -1)
    for targets in (hard, soft):
        ours = safe_cross_entropy(z, targets, label_smoothing=smoothing, reduction=reduction)
        ref = F.cross_entropy(z, targets, label_smoothing=smoothing, reduction=reduction)
        torch.testing.assert_close(ours, ref, rtol=1e-14, atol=1e-14)
        w = torch.ones_like(ours)
        torch.testing.assert_close(
            torch.autograd.grad(ours, z, w)[0], torch.autograd.grad(ref, z, w)[0]
        )


def test_safe_cross_entropy_zero_target_on_masked_logit_is_the_unpadded_loss() -> None:
    # Two 3-way tasks padded to 4 classes: a -inf logit and zero target mass on the padding.
    z = torch.tensor([[0.3, -1.0, 2.0, -math.inf], [1.0, 0.0, -0.5, -math.inf]], dtype=F64)
    q = torch.tensor([[0.1, 0.1, 0.8, 0.0], [0.9, 0.05, 0.05, 0.0]], dtype=F64)
    z.requires_grad_(True)
    loss = safe_cross_entropy(z, q)
    ref = F.cross_entropy(z[:, :3], q[:, :3])
    torch.testing.assert_close(loss, ref, rtol=1e-15, atol=0.0)
    (g,) = torch.autograd.grad(loss, z)
    expected = (torch.softmax(z, -1) - q) / 2  # exact CE gradient (sum(q) = 1), mean of 2
    torch.testing.assert_close(g, expected.detach(), rtol=1e-14, atol=1e-16)


def test_safe_cross_entropy_saturates_where_the_true_loss_is_infinite() -> None:
    # Label smoothing puts mass on the masked class: the true loss is +inf.
    z = torch.tensor([[0.3, -1.0, -math.inf]], dtype=F64, requires_grad=True)
    loss = safe_cross_entropy(z, torch.tensor([0]), label_smoothing=0.3)
    assert torch.isfinite(loss) and loss > 1e300
    (g,) = torch.autograd.grad(loss, z)
    q = torch.tensor([[0.8, 0.1, 0.1]], dtype=F64)
    torch.testing.assert_close(g, torch.softmax(z, -1).detach() - q, rtol=1e-14, atol=1e-16)
    # A batch mean of losses at float max would overflow in the sum; it saturates instead.
    m = torch.finfo(torch.float32).max
    big = torch.tensor([[m, -m]] * 3, requires_grad=True)
    loss = safe_cross_entropy(big, torch.tensor([1, 1, 1]))
    assert loss == m
    (g,) = torch.autograd.grad(loss, big)
    torch.testing.assert_close(g, torch.tensor([[1.0, -1.0]] * 3) / 3)


def test_safe_cross_entropy_gradcheck_and_gradgradcheck_in_logits_and_soft_targets() -> None:
    z = (2 * _randn(2, 3)).requires_grad_(True)
    q = torch.softmax(_randn(2, 3, seed=1), -1).requires_grad_(True)
    fn = lambda a, b: safe_cross_entropy(a, b, label_smoothing=0.1)  # noqa: E731
    assert gradcheck(fn, (z, q), **FULL)
    assert gradgradcheck(fn, (z, q), check_fwd_over_rev=True)


# --------------------------------------------------------------------------- torch.func


def _soft_targets(z: Tensor) -> Tensor:
    return torch.softmax(torch.arange(z.shape[-1], dtype=z.dtype), -1).expand_as(z)


FUNCTIONS = {
    # Each at a point where its clip/floor is inactive, so every reference is exact.
    "safe_sigmoid": (lambda t: safe_sigmoid(t, grad_clip=1.0), torch.sigmoid),
    "clip_grad": (lambda t: clip_grad(t, max_norm=100.0), lambda t: t),
    "safe_log": (lambda t: safe_log(t.exp()), lambda t: t),
    "safe_log_softmax": (safe_log_softmax, lambda t: torch.log_softmax(t, -1)),
    "safe_cross_entropy": (
        lambda z: safe_cross_entropy(z, _soft_targets(z), label_smoothing=0.1),
        lambda z: F.cross_entropy(z, _soft_targets(z), label_smoothing=0.1),
    ),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_vmap_equals_loop_and_func_grad_equals_autograd(name: str) -> None:
    f, _ = FUNCTIONS[name]
    X, W = _randn(4, 5), _randn(4, 5, seed=1)

    def loss(x: Tensor, w: Tensor) -> Tensor:
        return (f(x) * w.sum(-1, keepdim=True)).sum() + (f(x * w) ** 2).sum()

    torch.testing.assert_close(vmap(f)(X), torch.stack([f(x) for x in X]), rtol=0, atol=0)
    batched = vmap(grad(loss))(X, W)
    looped = torch.stack([_vjp(lambda x, w=w: loss(x, w), x, torch.ones(())) for x, w in zip(X, W)])
    torch.testing.assert_close(batched, looped, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_jvp_equals_reference_jvp(name: str) -> None:
    f, reference = FUNCTIONS[name]
    x, t = _randn(3, 5), _randn(3, 5, seed=1)
    value, tangent = jvp(f, (x,), (t,))
    ref_value, ref_tangent = jvp(reference, (x,), (t,))
    torch.testing.assert_close(value, ref_value, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(tangent, ref_tangent, rtol=1e-13, atol=1e-14)
    # And a central finite difference of the forward (float64, step 1e-6: error ~1e-10).
    fd = (f(x + 1e-6 * t) - f(x - 1e-6 * t)) / 2e-6
    torch.testing.assert_close(tangent, fd, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_forward_over_reverse_hvp_equals_double_backward(name: str) -> None:
    f, reference = FUNCTIONS[name]
    A = _randn(5, 5, seed=2) / 3

    def loss(p: Tensor, fn: Callable[[Tensor], Tensor] = f) -> Tensor:
        y = fn(A @ p)
        return (y * y).sum() + y.sum()

    p, v = _randn(5), _randn(5, seed=1)
    fwd_rev = hvp(loss, p, v, method="forward-over-reverse")
    double = hvp(loss, p, v, method="double-backward")
    ref = hvp(lambda q: loss(q, reference), p, v, method="double-backward")
    torch.testing.assert_close(fwd_rev, double, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(fwd_rev, ref, rtol=1e-12, atol=1e-13)


def test_safe_sigmoid_hvp_equals_closed_form_hessian() -> None:
    # f(p) = sum(a * s(Wp)) + sum(s(Wp)^2) / 2, z = Wp: H = W' diag(s'^2 + (a + s) s'') W.
    W, a = _randn(6, 4, seed=2), _uniform(-1.0, 1.0, 6, seed=3)
    p, v = 0.5 * _randn(4), _randn(4, seed=1)

    def f(q: Tensor) -> Tensor:
        s = safe_sigmoid(W @ q)  # gradient reaching Wq: |(a + s) s'| <= 2 / 4 < grad_clip
        return (a * s).sum() + (s * s).sum() / 2

    s = torch.sigmoid(W @ p)
    s1 = s * (1 - s)
    s2 = s1 * (1 - 2 * s)
    H = W.T @ torch.diag(s1 * s1 + (a + s) * s2) @ W
    for method in ("forward-over-reverse", "double-backward"):
        torch.testing.assert_close(hvp(f, p, v, method=method), H @ v, rtol=1e-12, atol=1e-14)
