"""LoRA on convolutions (`metalearn.models.lora.LoRAConv2d`) and LoRA-MAML (`metalearn.algorithms.
LoRAMAML`): the layer against a convolution written as loops, the meta-gradient against a
hand-written second-order MAML over the same adapted set and against finite differences
(float64), the experiment's record rebuilding the learner, and bad ranks refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms import LoRAMAML
from metalearn.checkpoint import save_checkpoint
from metalearn.deploy import load_learner
from metalearn.engine import Task, adapt
from metalearn.models import Conv4
from metalearn.models.lora import LoRAConv2d, LoRALinear, add_lora, lora_keys
from metalearn.runs.cli import flatten
from metalearn.runs.lifecycle import UserError
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.run_helpers import checkpoint_of, make, om, recipe_of

F64 = torch.float64
DATA = OMNIGLOT
Params = dict[str, Tensor]


# --------------------------------------------------------------------------- LoRAConv2d


def _slow_conv2d(x: Tensor, kernel: Tensor, bias: Tensor | None, stride: int, padding: int,
                 dilation: int, groups: int) -> Tensor:  # fmt: skip
    """A 2-d convolution as its definition: every output entry a sum over its patch."""
    n, c_in, h, w = x.shape
    c_out, c_per_group, kh, kw = kernel.shape
    xp = F.pad(x, (padding,) * 4)
    out_h = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    out_w = (w + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    out = torch.zeros(n, c_out, out_h, out_w, dtype=x.dtype)
    per_group_out = c_out // groups
    for o in range(c_out):
        first = (o // per_group_out) * c_per_group
        for i in range(out_h):
            for j in range(out_w):
                total = torch.zeros(n, dtype=x.dtype)
                for c in range(c_per_group):
                    for u in range(kh):
                        for v in range(kw):
                            pixel = xp[:, first + c, i * stride + u * dilation,
                                       j * stride + v * dilation]  # fmt: skip
                            total = total + pixel * kernel[o, c, u, v]
                out[:, o, i, j] = total + (0 if bias is None else bias[o])
    return out


@pytest.mark.parametrize(
    ("c_in", "c_out", "k", "stride", "padding", "dilation", "groups", "bias"),
    [(3, 4, 3, 2, 1, 1, 1, True), (4, 6, 3, 1, 2, 2, 2, False), (2, 3, 1, 1, 0, 1, 1, True)],
)
def test_lora_conv2d_is_a_low_rank_kernel_update(c_in, c_out, k, stride, padding, dilation,
                                                 groups, bias) -> None:  # fmt: skip
    torch.manual_seed(0)
    base = nn.Conv2d(c_in, c_out, k, stride, padding, dilation, groups, bias).to(F64)
    layer = LoRAConv2d(base, rank=2, alpha=6.0)
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.lora_A.shape == (2, c_in // groups * k * k) and layer.lora_B.shape == (c_out, 2)
    x = torch.randn(2, c_in, 6, 5, dtype=F64)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # B = 0 at the start

    b = torch.randn(c_out, 2, dtype=F64)
    params = {**dict(layer.named_parameters()), "lora_B": b}
    # The kernel as the [out, in/groups * kh * kw] matrix of im2col, plus (alpha / r) B A.
    kernel = base.weight + (6.0 / 2) * (b @ layer.lora_A).reshape(base.weight.shape)
    expected = _slow_conv2d(x, kernel, base.bias, stride, padding, dilation, groups)
    torch.testing.assert_close(functional_call(layer, params, (x,)), expected, rtol=0, atol=1e-12)
    assert torch.linalg.matrix_rank((kernel - base.weight).reshape(c_out, -1)) <= 2


def test_lora_conv2d_refuses_what_it_cannot_wrap() -> None:
    with pytest.raises(ValueError, match="wraps an nn.Conv2d, got Linear"):
        LoRAConv2d(nn.Linear(3, 2), rank=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="padding_mode='zeros', got 'reflect'"):
        LoRAConv2d(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), rank=1)
    for rank in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"rank must be an int >= 1, got {rank!r}"):
            LoRAConv2d(nn.Conv2d(1, 2, 3), rank=rank)  # type: ignore[arg-type]


def test_add_lora_adapts_convolutions_when_asked() -> None:
    torch.manual_seed(0)
    model = Conv4(hidden=3).to(F64)
    convs = [f"features.{i}.conv" for i in range(4)]
    adapted = add_lora(model, 2, layers=(nn.Linear, nn.Conv2d))
    assert lora_keys(adapted) == [
        f"{n}.{p}" for n in [*convs, "head"] for p in ("lora_A", "lora_B")
    ]
    assert all(isinstance(adapted.get_submodule(n), LoRAConv2d) for n in convs)
    assert isinstance(adapted.head, LoRALinear)
    x = torch.randn(4, 1, 8, 8, dtype=F64)
    torch.testing.assert_close(adapted(x), model(x), rtol=0, atol=0)
    # Linear layers only by default; names and rules choose among the chosen kinds.
    assert lora_keys(add_lora(model, 1)) == ["head.lora_A", "head.lora_B"]
    only = add_lora(model, 1, target=["features.2.conv"], layers=(nn.Conv2d,))
    assert lora_keys(only) == ["features.2.conv.lora_A", "features.2.conv.lora_B"]
    with pytest.raises(ValueError, match=r"not nn.Linear layers of the model"):
        add_lora(model, 1, target=["features.0.conv"])
    with pytest.raises(ValueError, match=r"cannot be adapted; pass a non-empty subset"):
        add_lora(model, 1, layers=(nn.BatchNorm2d,))
    with pytest.raises(ValueError, match=r"cannot be adapted"):
        add_lora(model, 1, layers=())


# --------------------------------------------------------------------------- LoRA-MAML


def _tasks(count: int, ways: int = 3, seed: int = 0) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for _ in range(count):
        x = torch.randn(4 * ways, 1, 8, 8, generator=g, dtype=F64)
        y = torch.arange(4 * ways) % ways
        tasks.append(Task((x[: 2 * ways], y[: 2 * ways]), (x[2 * ways :], y[2 * ways :])))
    return tasks


def _learner(rank: int = 2, **kwargs) -> LoRAMAML:
    """A float64 LoRA-MAML on a tiny Conv4 with the adapters moved off B = 0 (as training
    would), so both A and B carry the meta-gradient from the first inner step."""
    torch.manual_seed(0)
    learner = LoRAMAML(Conv4(hidden=3, ways=3).to(F64), lora_rank=rank, inner_lr=0.3, **kwargs)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if name.endswith("lora_B") else None
    return learner


def _reference_meta_loss(theta: Params, tasks: list[Task], steps: int, lr: float,
                         scale: float) -> Tensor:  # fmt: skip
    """Second-order MAML written out on Conv4's layers (F.conv2d with the merged kernel,
    the fused batch norm, torch.autograd.grad with create_graph), adapting only the
    adapters and the head: no LoRA module, functional_call or torch.func involved."""

    def forward(p: Params, x: Tensor) -> Tensor:
        for i in range(4):
            w = p[f"features.{i}.conv.weight"]
            delta = p[f"features.{i}.conv.lora_B"] @ p[f"features.{i}.conv.lora_A"]
            x = F.conv2d(x, w + scale * delta.reshape(w.shape), p[f"features.{i}.conv.bias"],
                         stride=2, padding=1)  # fmt: skip
            x = F.batch_norm(x, None, None, p[f"features.{i}.norm.weight"],
                             p[f"features.{i}.norm.bias"], training=True)  # fmt: skip
            x = torch.relu(x)
        return F.linear(x.mean((-2, -1)), p["head.weight"], p["head.bias"])

    fast_names = [k for k in theta if "lora_" in k or k.startswith("head.")]
    losses = []
    for task in tasks:
        p = dict(theta)
        for _ in range(steps):
            loss = F.cross_entropy(forward(p, task.support[0]), task.support[1])
            grads = torch.autograd.grad(loss, [p[k] for k in fast_names], create_graph=True)
            p = {**p, **{k: p[k] - lr * g for k, g in zip(fast_names, grads)}}
        losses.append(F.cross_entropy(forward(p, task.query[0]), task.query[1]))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("vectorize", ["vmap", "loop"])
def test_lora_maml_meta_gradient_matches_hand_written_maml(vectorize) -> None:
    learner = _learner(inner_steps=2, vectorize=vectorize, chunk_size=None)
    tasks = _tasks(3)
    theta = {k: v.detach().clone().requires_grad_() for k, v in learner.named_parameters()}
    names = {k.removeprefix("model."): v for k, v in theta.items()}
    reference = _reference_meta_loss(names, tasks, steps=2, lr=0.3, scale=1.0)
    expected = dict(zip(theta, torch.autograd.grad(reference, list(theta.values()))))

    metrics = learner.backward(tasks)
    assert metrics.loss == pytest.approx(float(reference.detach()), abs=1e-12)
    for name, p in learner.named_parameters():
        if not name.endswith("conv.bias"):  # batch norm cancels a conv bias: zero gradient
            assert expected[name].abs().max() > 1e-5, name  # the rest is all meta-learned
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-10)


def test_lora_maml_meta_gradient_matches_finite_differences() -> None:
    learner = _learner(inner_steps=2)
    tasks = _tasks(2, seed=1)
    learner.backward(tasks)
    params = dict(learner.named_parameters())
    start = {k: p.detach().clone() for k, p in params.items()}
    g = torch.Generator().manual_seed(5)
    eps = 1e-6
    for _ in range(3):
        v = {k: torch.randn(p.shape, generator=g, dtype=F64) for k, p in start.items()}
        losses = []
        for sign in (1, -1):
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(start[k] + sign * eps * v[k])
                losses.append(float(learner.meta_loss(tasks).loss))
        fd = (losses[0] - losses[1]) / (2 * eps)
        analytic = float(sum((params[k].grad * v[k]).sum() for k in params))
        assert abs(analytic - fd) < 1e-7 * max(1.0, abs(fd))


def test_lora_maml_adapts_the_adapters_and_the_head_only() -> None:
    torch.manual_seed(0)
    model = Conv4(hidden=3, ways=3).to(F64)
    learner = LoRAMAML(model, lora_rank=2, inner_lr=0.3, inner_steps=1)
    assert not any(isinstance(m, (LoRAConv2d, LoRALinear)) for m in model.modules())
    convs = [f"features.{i}.conv" for i in range(4)]
    assert learner.adapt_keys == [
        *(f"{n}.{p}" for n in convs for p in ("lora_A", "lora_B")),
        "head.weight",
        "head.bias",
    ]
    assert isinstance(learner.model.head, nn.Linear) and learner.alpha == 2.0
    theta = {k: v.detach() for k, v in learner.model.named_parameters()}
    task = _tasks(1)[0]
    x = task.query[0]
    torch.testing.assert_close(learner.model(x), model(x), rtol=0, atol=0)
    fast = adapt(learner.model, theta, task.support, lr=0.3, adapt_keys=learner.adapt_keys)
    # From B = 0 the gradient of A is zero (Hu et al., 2021, Sec. 4.1): B and the head move.
    moved = [k for k in theta if not torch.equal(fast[k], theta[k])]
    assert moved == [*(f"{n}.lora_B" for n in convs), "head.weight", "head.bias"]

    only_adapters = LoRAMAML(model, lora_rank=1, head=None)
    assert only_adapters.adapt_keys == lora_keys(only_adapters.model)
    assert isinstance(only_adapters.model.head, LoRALinear)


def test_lora_maml_refuses_bad_arguments_in_one_line() -> None:
    model = Conv4(hidden=3)
    for rank in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"lora_rank=.*: the adapters. rank must be an int"):
            LoRAMAML(model, lora_rank=rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop adapt_keys"):
        LoRAMAML(model, adapt_keys=["head.weight"])
    with pytest.raises(ValueError, match="pass head= the prefix"):
        LoRAMAML(model, head="classifier")


# --------------------------------------------------------------------------- the record


def _args(**overrides) -> om.Args:
    return om.resolve_args(make(om, hidden=8, device="cpu", **overrides))


def test_the_record_rebuilds_the_learner(tmp_path) -> None:
    args = _args(algorithm="lora", lora_rank=2)
    flat = flatten(args)
    assert flat["lora_rank"] == 2 and (flat["inner_lr"], flat["inner_steps"]) == (0.4, 1)
    assert recipe_of(om, args).learner.arguments["lora_rank"] == 2
    assert flatten(_args(algorithm="lora"))["lora_rank"] == 4  # the learner's default
    assert flatten(_args(algorithm="maml"))["lora_rank"] is None  # recorded as doing nothing

    path = checkpoint_of(tmp_path, om, args)
    saved = torch.load(path, weights_only=True)
    best = {k: v + 1 for k, v in saved["learner"].items()}
    save_checkpoint(path, {**saved, "best_learner": best})
    for which, weights in (("best", best), ("last", saved["learner"])):
        learner, recipe = load_learner(path, which=which)
        assert type(learner) is LoRAMAML and learner.rank == 2
        assert recipe.learner.arguments["lora_rank"] == 2
        assert learner.state_dict().keys() == weights.keys()
        assert all(torch.equal(learner.state_dict()[k], weights[k]) for k in weights)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"algorithm": "lora", "lora_rank": 0}, "--lora-rank 0: must be at least 1"),
     ({"algorithm": "lora", "lora_rank": -3}, "--lora-rank -3: must be at least 1"),
     ({"algorithm": "maml", "lora_rank": 2}, "--lora-rank is a setting of lora; drop it for maml"),
     ({"algorithm": "lora", "cg_damping": 1.0}, "--cg-damping is a setting of imaml")],
)  # fmt: skip
def test_bad_ranks_are_refused_in_one_line_before_anything_runs(tmp_path, overrides, message):
    args = make(om, hidden=8, device="cpu", out_dir=str(tmp_path), **overrides)
    with pytest.raises(UserError, match=message) as err:
        om.main(args)
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written


@needs_omniglot
def test_a_tiny_lora_run_trains_tests_and_records_its_rank(tmp_path) -> None:
    args = make(om, algorithm="lora", lora_rank=3, iterations=2, meta_batch=2, query=1,
                eval_query=2, hidden=8, val_every=1, val_tasks=3, test_tasks=4,
                eval_inner_steps=2, data_root=str(DATA), track=False, device="cpu",
                out_dir=str(tmp_path), run_name="lora")  # fmt: skip
    results = om.main(args)
    assert 0.0 <= results["test/acc"] <= 1.0
    learner, recipe = load_learner(tmp_path / "lora" / "checkpoint.pt", which="last")
    assert recipe.learner.arguments["lora_rank"] == 3 and learner.rank == 3
    assert learner.model.features[0].conv.lora_A.shape == (3, 9)
