"""Backbones: shapes, parameter counts, batch norm against the fused kernel, and the
functional paths (functional_call, vmap over tasks, HVPs) against slow references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from metalearn.functional import flatten_tree, unflatten_like
from metalearn.models import MLP, Conv4, MetaBatchNorm, batch_norm
from metalearn.second_order import HVP_METHODS, hessian, hvp

F64 = torch.float64


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


# --------------------------------------------------------------------------- shapes, counts


@pytest.mark.parametrize("pool", ["stride", "max"])
def test_conv4_shape(pool: str) -> None:
    model = Conv4(ways=5, pool=pool)
    assert model(torch.randn(6, 1, 28, 28)).shape == (6, 5)
    assert Conv4(in_channels=3, ways=7, hidden=8, pool=pool)(torch.randn(2, 3, 28, 28)).shape == (
        2,
        7,
    )


def _conv4_count(in_channels: int, hidden: int, ways: int) -> int:
    conv = lambda c_in: c_in * hidden * 3 * 3 + hidden  # noqa: E731
    norm = 2 * hidden
    return conv(in_channels) + norm + 3 * (conv(hidden) + norm) + hidden * ways + ways


@pytest.mark.parametrize(("in_channels", "hidden", "ways"), [(1, 64, 5), (3, 32, 20), (1, 2, 3)])
def test_conv4_parameter_count(in_channels: int, hidden: int, ways: int) -> None:
    model = Conv4(in_channels=in_channels, ways=ways, hidden=hidden)
    expected = _conv4_count(in_channels, hidden, ways)
    assert sum(p.numel() for p in model.parameters()) == expected
    if (in_channels, hidden, ways) == (1, 64, 5):
        assert expected == 112_261  # MAML's Omniglot net, "about 112k"


def test_conv4_names_and_no_buffers() -> None:
    model = Conv4()
    names = [k for k, _ in model.named_parameters()]
    assert all(k.startswith(("features.", "head.")) for k in names)
    assert [k for k in names if k.startswith("head.")] == ["head.weight", "head.bias"]
    assert isinstance(model.head, nn.Linear)
    assert list(model.named_buffers()) == []


def test_mlp_shape_and_count() -> None:
    model = MLP(64, [100, 32], 5)
    assert model(torch.randn(7, 64)).shape == (7, 5)
    assert model(torch.randn(3, 7, 64)).shape == (3, 7, 5)
    assert sum(p.numel() for p in model.parameters()) == 64 * 100 + 100 + 100 * 32 + 32 + 32 * 5 + 5
    assert MLP(3, [], 2)(torch.randn(4, 3)).shape == (4, 2)
    assert isinstance(MLP(3, [4], 2, activation=nn.Tanh).features[1], nn.Tanh)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="pool"):
        Conv4(pool="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ways"):
        Conv4(ways=0)
    with pytest.raises(ValueError, match="layer sizes"):
        MLP(3, [0], 2)
    with pytest.raises(ValueError, match="unsqueeze"):
        Conv4()(torch.randn(2, 28, 28))
    with pytest.raises(ValueError, match="channel"):
        batch_norm(torch.randn(4, 3), torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="batch dimension"):
        batch_norm(torch.randn(4), torch.ones(4), torch.zeros(4))


# --------------------------------------------------------------------------- batch norm


@pytest.mark.parametrize("shape", [(9, 4), (5, 3, 7), (6, 3, 5, 4)])
def test_batch_norm_matches_fused_kernel(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape, generator=gen, dtype=F64) * 3 + 1).requires_grad_()
    w = torch.randn(c, generator=gen, dtype=F64).requires_grad_()
    b = torch.randn(c, generator=gen, dtype=F64).requires_grad_()
    probe = torch.randn(shape, generator=gen, dtype=F64)

    ours = batch_norm(x, w, b, eps=1e-3)
    ref = F.batch_norm(x, None, None, w, b, training=True, eps=1e-3)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    g_ours = torch.autograd.grad((ours * probe).sum(), (x, w, b))
    g_ref = torch.autograd.grad((ref * probe).sum(), (x, w, b))
    for a, r in zip(g_ours, g_ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(9, 4), (5, 3, 7), (6, 3, 5, 4)])
def test_batch_norm_with_stats_rows_normalises_by_the_first_rows(shape) -> None:
    """``stats_rows=k``: every row normalised with the first k rows' mean and biased
    variance, which torch's own batch norm computes on those rows alone; the first k rows'
    output is their own batch's, values and gradients."""
    gen = torch.Generator().manual_seed(1)
    c, k = shape[1], 3
    x = (torch.randn(shape, generator=gen, dtype=F64) * 2 - 1).requires_grad_()
    w = torch.randn(c, generator=gen, dtype=F64).requires_grad_()
    b = torch.randn(c, generator=gen, dtype=F64).requires_grad_()
    dims = (0, *range(2, len(shape)))
    mean, var = x[:k].mean(dims), x[:k].var(dims, unbiased=False)
    ref = F.batch_norm(x, mean.detach(), var.detach(), w, b, training=False, eps=1e-3)
    ours = batch_norm(x, w, b, eps=1e-3, stats_rows=k)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[:k], batch_norm(x[:k], w, b, eps=1e-3), rtol=0, atol=1e-12)
    # gradients reach x through the moments (here against the moments written out)
    probe = torch.randn(shape, generator=gen, dtype=F64)
    view = (1, c) + (1,) * (len(shape) - 2)
    hand = (x - mean.reshape(view)) / torch.sqrt(var.reshape(view) + 1e-3)
    hand = hand * w.reshape(view) + b.reshape(view)
    for a, r in zip(torch.autograd.grad((ours * probe).sum(), (x, w, b)),
                    torch.autograd.grad((hand * probe).sum(), (x, w, b))):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
    assert torch.equal(batch_norm(x, w, b, stats_rows=shape[0]), batch_norm(x, w, b))
    for bad in (0, shape[0] + 1):
        with pytest.raises(ValueError, match=f"stats_rows={bad} must be in 1..{shape[0]}"):
            batch_norm(x, w, b, stats_rows=bad)


@pytest.mark.parametrize("name", ["conv4", "resnet12", "rrnet"])
def test_norm_rows_reads_the_support_rows_statistics_in_each_backbone(name) -> None:
    """``forward(cat([support, query]), norm_rows=S)``: the support rows are the support set's
    own forward exactly, and each query row is the same whatever other queries share the
    batch; a backbone with another norm layer refuses ``norm_rows`` in one line."""
    from metalearn.models import ResNet12
    from metalearn.models.r2d2net import R2D2Net

    torch.manual_seed(0)
    model, side = {
        "conv4": (lambda: Conv4(hidden=4), 28),
        "resnet12": (lambda: ResNet12(in_channels=1, widths=(4, 4, 4, 4)), 16),
        "rrnet": (lambda: R2D2Net(in_channels=1, image_size=28, widths=(4, 4, 4, 4)), 28),
    }[name]
    net = model().double()
    xs, xq = (torch.randn(n, 1, side, side, dtype=F64) for n in (5, 4))
    with torch.no_grad():
        out = net(torch.cat([xs, xq]), norm_rows=5)
        assert torch.equal(out[:5], net(xs))
        for i in range(4):
            alone = net(torch.cat([xs, xq[i : i + 1]]), norm_rows=5)[5]
            torch.testing.assert_close(alone, out[5 + i], rtol=0, atol=1e-12)
        assert (out[5:] - net(xq)).abs().max() > 1e-3  # not the query batch's own statistics
    fused = Conv4(hidden=4, norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False))
    with pytest.raises(ValueError, match="only MetaBatchNorm computes.*BatchNorm2d"):
        fused(torch.randn(3, 1, 28, 28), norm_rows=2)


def test_meta_batch_norm_module_matches_batchnorm2d() -> None:
    torch.manual_seed(0)
    ours = MetaBatchNorm(3).double()
    ref = nn.BatchNorm2d(3, track_running_stats=False).double()
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
            m.bias.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    x = torch.randn(4, 3, 5, 5, dtype=F64)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-12)
    ours.eval()  # transductive: evaluation also uses the batch's statistics
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-12)
    assert list(ours.buffers()) == []


# --------------------------------------------------------------------------- functional paths


def test_functional_call_uses_given_params() -> None:
    torch.manual_seed(0)
    model = Conv4(hidden=8).double()
    x = torch.randn(4, 1, 28, 28, dtype=F64)
    params = _params(model)
    torch.testing.assert_close(functional_call(model, params, (x,)), model(x))
    shifted = {k: v + 0.1 if k == "head.bias" else v for k, v in params.items()}
    diff = functional_call(model, shifted, (x,)) - model(x)
    torch.testing.assert_close(diff, torch.full_like(diff, 0.1))
    # Only the head (ANIL): the rest falls back to the module's own parameters.
    head_only = {k: v for k, v in shifted.items() if k.startswith("head.")}
    out = functional_call(model, head_only, (x,), strict=False)
    torch.testing.assert_close(out, model(x) + 0.1)


def _task_loss(model: nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    return loss


@pytest.mark.parametrize("pool", ["stride", "max"])
def test_vmap_over_tasks_equals_loop(pool: str) -> None:
    torch.manual_seed(0)
    tasks, ways, batch = 3, 5, 8
    model = Conv4(ways=ways, hidden=4, pool=pool).double()
    base = _params(model)
    # Per-task parameters (as after different inner steps) and per-task data.
    params = {k: v + 0.05 * torch.randn(tasks, *v.shape, dtype=F64) for k, v in base.items()}
    x = torch.randn(tasks, batch, 1, 16, 16, dtype=F64)
    y = torch.randint(0, ways, (tasks, batch))
    loss = _task_loss(model)

    def forward(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi,))

    out = vmap(forward)(params, x)
    grads = vmap(grad(loss))(params, x, y)
    for t in range(tasks):
        p_t = {k: v[t] for k, v in params.items()}
        torch.testing.assert_close(out[t], forward(p_t, x[t]), rtol=0, atol=1e-10)
        g_t = grad(loss)(p_t, x[t], y[t])
        for k in g_t:
            torch.testing.assert_close(grads[k][t], g_t[k], rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- second order


def _tiny_conv4() -> tuple[Conv4, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=2).double()  # 159 parameters
    params = {k: v + 0.1 * torch.randn_like(v) for k, v in _params(model).items()}
    x = torch.randn(6, 1, 8, 8, dtype=F64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    return model, params, x, y


@pytest.fixture(scope="module")
def tiny_hessian() -> tuple[Conv4, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    model, params, x, y = _tiny_conv4()
    loss = _task_loss(model)
    H = hessian(lambda p: loss(p, x, y), params, method="rows")
    return model, params, x, y, H


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_through_conv4_equals_dense_hessian(method: str, tiny_hessian) -> None:
    model, params, x, y, H = tiny_hessian
    loss = _task_loss(model)
    f = lambda p: loss(p, x, y)  # noqa: E731
    n = H.shape[0]
    assert n == _conv4_count(1, 2, 3)
    torch.testing.assert_close(H, H.T, rtol=0, atol=1e-10)
    assert H.abs().max() > 1e-3  # a real curvature, not an all-zero pass
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(n, generator=gen, dtype=F64)
    hv = flatten_tree(hvp(f, params, unflatten_like(v, params), method=method))
    torch.testing.assert_close(hv, H @ v, rtol=0, atol=1e-10)
    # Basis vectors give single rows, including the batch-norm x conv mixed block.
    for i in (0, 20, 22, n - 1):
        e = torch.zeros(n, dtype=F64)
        e[i] = 1.0
        row = flatten_tree(hvp(f, params, unflatten_like(e, params), method=method))
        torch.testing.assert_close(row, H[i], rtol=0, atol=1e-10)


def test_vmapped_second_order_equals_loop_with_batch_norm() -> None:
    """HVPs of several tasks batched with vmap equal the per-task loop (batch norm inside)."""
    model, params, _, _ = _tiny_conv4()
    loss = _task_loss(model)
    tasks = 3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tasks, 6, 1, 8, 8, generator=gen, dtype=F64)
    y = torch.randint(0, 3, (tasks, 6), generator=gen)
    v = {k: torch.randn(tasks, *p.shape, generator=gen, dtype=F64) for k, p in params.items()}

    def task_hvp(vi, xi, yi):
        # torch.func's reverse-over-reverse: autograd's double backward cannot run under vmap
        return hvp(lambda p: loss(p, xi, yi), params, vi, method="reverse-over-reverse")

    batched = vmap(task_hvp)(v, x, y)
    for t in range(tasks):
        one = task_hvp({k: u[t] for k, u in v.items()}, x[t], y[t])
        for k in one:
            torch.testing.assert_close(batched[k][t], one[k], rtol=0, atol=1e-10)


def test_vmapped_hessian_through_batch_norm_equals_rows(tiny_hessian) -> None:
    """jacfwd-of-jacrev (batched tangents) through `batch_norm` equals the row-by-row
    reference. With the fused ``F.batch_norm`` (``nn.BatchNorm2d``) in place of
    `MetaBatchNorm` this comparison is off by about 0.15 (of 0.6) on torch 2.13, which is
    why the models use the hand-written batch norm."""
    model, params, x, y, H = tiny_hessian
    loss = _task_loss(model)
    H_vmap = hessian(lambda p: loss(p, x, y), params, method="vmap")
    torch.testing.assert_close(H_vmap, H, rtol=0, atol=1e-10)


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def _tasks_and_theta(model: nn.Module) -> tuple[list, dict[str, torch.Tensor]]:
    from metalearn.engine import Task

    theta = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    tasks = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(12, 1, 8, 8, generator=g, dtype=F64)
        y = torch.arange(12) % 3
        tasks.append(Task((x[:6], y[:6]), (x[6:], y[6:])))
    return tasks, theta


def test_batch_norm_is_elementary_in_the_loop_and_under_vmap() -> None:
    """One form of batch norm everywhere: neither mode reaches the fused kernel, and their
    meta-gradients agree."""
    from metalearn.engine import InnerLoop, meta_batch

    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=3).to(F64)
    tasks, theta = _tasks_and_theta(model)
    inner = InnerLoop(steps=2)
    looped = meta_batch(model, theta, tasks, inner, vectorize="loop")
    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    for result in (looped, vmapped):
        assert not any("NativeBatchNorm" in n for n in _graph_nodes(result.loss))
    for a, b in zip(
        torch.autograd.grad(looped.loss, list(theta.values())),
        torch.autograd.grad(vmapped.loss, list(theta.values())),
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_fused_kernels_vmapped_second_order_is_wrong_and_batch_norms_is_right() -> None:
    """Why `batch_norm` never takes ``F.batch_norm``: vmapped and differentiated through the
    inner gradient, the fused kernel's meta-gradient misses finite differences (float64,
    torch 2.13: 10%, 72% and 11% off along these three directions), while `MetaBatchNorm`'s
    and the fused kernel's in the loop agree to 1e-7. ``run_meta_batch`` is given the mode,
    so it skips the planner's refusal of fused norms under vmap."""
    from metalearn.engine import ChunkCall, InnerLoop, run_meta_batch

    inner = InnerLoop(steps=2, lr=0.3)

    def relative_errors(norm, mode: str) -> list[float]:
        torch.manual_seed(0)
        model = Conv4(ways=3, hidden=3, norm_layer=norm).to(F64)
        tasks, theta = _tasks_and_theta(model)

        def objective(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return run_meta_batch(model, p, ChunkCall(tasks, inner, mode)).loss

        grads = torch.autograd.grad(objective(theta), list(theta.values()))
        g = torch.Generator().manual_seed(0)
        errors = []
        for _ in range(3):
            v = {k: torch.randn(t.shape, generator=g, dtype=F64) for k, t in theta.items()}
            with torch.no_grad():
                plus = objective({k: theta[k] + 1e-6 * v[k] for k in theta})
                minus = objective({k: theta[k] - 1e-6 * v[k] for k in theta})
            fd = float((plus - minus) / 2e-6)
            analytic = float(sum((gk * v[k]).sum() for gk, k in zip(grads, theta)))
            errors.append(abs(analytic - fd) / abs(fd))
        return errors

    def fused(c: int) -> nn.Module:
        return nn.BatchNorm2d(c, track_running_stats=False)

    assert max(relative_errors(MetaBatchNorm, "vmap")) < 1e-7
    assert max(relative_errors(fused, "loop")) < 1e-7
    assert min(relative_errors(fused, "vmap")) > 0.05


def test_batch_norm_compiles_without_graph_breaks() -> None:
    # fullgraph=True raises on any graph break.
    x = torch.randn(4, 3, 5, 5)
    w, b = torch.ones(3), torch.zeros(3)
    compiled = torch.compile(batch_norm, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), batch_norm(x, w, b))


# --------------------------------------------------------------------------- meta-gradients
# Shared with tests/models/test_resnet12.py: the vmapped meta-gradient against the loop's, and the
# second-order meta-gradient against central finite differences, both in float64.


def image_tasks(channels: int, size: int, ways: int, n_tasks: int = 3) -> list:
    """``n_tasks`` float64 tasks of ``channels x size x size`` images, 1 shot, 2 query."""
    from metalearn.engine import Task

    tasks = []
    for i in range(n_tasks):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(3 * ways, channels, size, size, generator=g, dtype=F64)
        y = torch.arange(3 * ways) % ways
        tasks.append(Task((x[:ways], y[:ways]), (x[ways:], y[ways:])))
    return tasks


# MAML's inner learning rate on mini-ImageNet. It also keeps the finite differences honest:
# with ReLU and max-pool the inner gradient jumps where a unit crosses its kink, so the
# meta-loss is only piecewise smooth, with jumps proportional to the inner learning rate; a
# difference step that straddles one reads as an O(1) error (seen at 0.1 with step 1e-5).
INNER_LR = 0.01
FD_STEP = 1e-7


def meta_gradients_agree_across_modes(model: nn.Module, tasks: list) -> None:
    """The vmapped second-order MAML meta-gradient equals the per-task loop's."""
    from metalearn.engine import ChunkCall, InnerLoop, run_meta_batch

    theta = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    inner = InnerLoop(steps=2, lr=INNER_LR)
    grads = {}
    for mode in ("loop", "vmap"):
        loss = run_meta_batch(model, theta, ChunkCall(tasks, inner, mode)).loss
        grads[mode] = torch.autograd.grad(loss, list(theta.values()))
    scale = max(float(g.abs().max()) for g in grads["loop"])
    assert scale > 1e-4  # a real gradient, not an all-zero pass
    for name, a, b in zip(theta, grads["loop"], grads["vmap"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10 * scale, msg=name)


def meta_gradient_errors_against_fd(model: nn.Module, tasks: list, directions: int = 2):
    """Relative error of the vmapped second-order meta-gradient along random directions,
    against central differences of the meta-loss (step `FD_STEP`, float64)."""
    from metalearn.engine import ChunkCall, InnerLoop, run_meta_batch

    theta = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    inner = InnerLoop(steps=2, lr=INNER_LR)

    def objective(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return run_meta_batch(model, p, ChunkCall(tasks, inner, "vmap")).loss

    grads = torch.autograd.grad(objective(theta), list(theta.values()))
    g = torch.Generator().manual_seed(0)
    errors = []
    for _ in range(directions):
        v = {k: torch.randn(t.shape, generator=g, dtype=F64) for k, t in theta.items()}
        with torch.no_grad():
            plus = objective({k: theta[k] + FD_STEP * v[k] for k in theta})
            minus = objective({k: theta[k] - FD_STEP * v[k] for k in theta})
        fd = float((plus - minus) / (2 * FD_STEP))
        analytic = float(sum((gk * v[k]).sum() for gk, k in zip(grads, theta)))
        errors.append(abs(analytic - fd) / abs(fd))
    return errors


# --------------------------------------------------------------------------- flattened head


def test_conv4_flatten_is_mamls_mini_imagenet_net() -> None:
    model = Conv4(in_channels=3, ways=5, hidden=32, pool="max", head="flatten", image_size=84)
    x = torch.randn(2, 3, 84, 84)
    assert model.features(x).shape == (2, 32, 5, 5)  # 84 -> 42 -> 21 -> 10 -> 5
    assert model(x).shape == (2, 5)
    assert model.head.in_features == 800
    n_conv = _conv4_count(3, 32, 5) - (32 * 5 + 5)  # everything but the head
    expected = n_conv + 800 * 5 + 5
    assert sum(p.numel() for p in model.parameters()) == expected == 32_901
    assert list(model.named_buffers()) == []


@pytest.mark.parametrize(
    ("size", "pool"), [(84, "max"), (84, "stride"), (28, "stride"), (28, "max"), ((20, 33), "max")]
)
def test_conv4_output_size_matches_the_features(size, pool: str) -> None:
    from metalearn.models.conv4 import conv4_output_size

    h, w = (size, size) if isinstance(size, int) else size
    features = Conv4(hidden=2, pool=pool).features(torch.randn(1, 1, h, w))
    assert conv4_output_size(size, pool) == tuple(features.shape[-2:])
    model = Conv4(hidden=2, pool=pool, head="flatten", image_size=size)
    assert model.head.in_features == 2 * features.shape[-2] * features.shape[-1]
    assert model(torch.randn(3, 1, h, w)).shape == (3, 5)


def test_conv4_flatten_head_is_flattened_features() -> None:
    torch.manual_seed(0)
    model = Conv4(hidden=3, pool="max", head="flatten", image_size=32).double()
    x = torch.randn(4, 1, 32, 32, dtype=F64)
    features = model.features(x)  # [4, 3, 2, 2]
    expected = features.reshape(4, -1) @ model.head.weight.T + model.head.bias
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-12)


def test_conv4_mean_head_keeps_omniglot_names_and_loads_their_checkpoints() -> None:
    old = Conv4()  # today's Omniglot defaults
    new = Conv4(head="mean", image_size=28)
    assert [k for k, _ in new.named_parameters()] == [k for k, _ in old.named_parameters()]
    new.load_state_dict(old.state_dict())
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(new(x), old(x))


def test_conv4_head_and_image_size_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="pass image_size"):
        Conv4(head="flatten")
    with pytest.raises(ValueError, match="head must be 'mean' or 'flatten'"):
        Conv4(head="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 16x16"):
        Conv4(pool="max", head="flatten", image_size=15)
    with pytest.raises(ValueError, match="at least 16x16"):
        Conv4(pool="max", image_size=(84, 12))  # checked for the mean head too
    with pytest.raises(ValueError, match="pool must be"):
        Conv4(pool="avg", head="flatten", image_size=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int or"):
        Conv4(head="flatten", image_size=(84, 84, 3))  # type: ignore[arg-type]
    model = Conv4(in_channels=3, hidden=4, pool="max", head="flatten", image_size=84)
    with pytest.raises(ValueError, match="built for 84x84 images, got 80x80"):
        model(torch.randn(2, 3, 80, 80))


# 20x20 with stride 2 and 32x32 with max-pool both leave 2x2 positions (4 x 4 features).
FLATTEN_CASES = [("stride", 20), ("max", 32)]


@pytest.mark.parametrize(("pool", "size"), FLATTEN_CASES)
def test_conv4_flatten_vmapped_meta_gradient_equals_loop(pool: str, size: int) -> None:
    torch.manual_seed(0)
    model = Conv4(in_channels=3, ways=3, hidden=4, pool=pool, head="flatten", image_size=size)
    assert model.head.in_features == 4 * 2 * 2
    meta_gradients_agree_across_modes(model.to(F64), image_tasks(3, size, ways=3))


@pytest.mark.parametrize(("pool", "size"), FLATTEN_CASES)
def test_conv4_flatten_second_order_meta_gradient_equals_finite_differences(
    pool: str, size: int
) -> None:
    torch.manual_seed(0)
    model = Conv4(in_channels=3, ways=3, hidden=4, pool=pool, head="flatten", image_size=size)
    errors = meta_gradient_errors_against_fd(model.to(F64), image_tasks(3, size, ways=3))
    assert max(errors) < 1e-6, errors
