"""Meta-SGD and MAML++ against independent references, in float64.

References: central finite differences for the learned learning rates and batch-norm copies;
MAML / FOMAML / ANIL where the extra machinery reduces to them; hand-computed MSL weights;
a sum of separately computed MAML losses for the multi-step loss; the loop path for vmap.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp, batch_norm_names, msl_weights
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.engine import Task
from metalearn.models import MLP, Conv4

WAYS, SHOTS = 3, 2
FD_EPS = 1e-6
FD_RTOL = 1e-6  # norm-wise relative error of autograd against central differences
EXACT = 1e-12  # the same computation reached two ways
VMAP_TOL = 1e-10


def conv(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Conv4(in_channels=1, ways=WAYS, hidden=2).double()


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(4, [3], WAYS, activation=nn.Tanh).double()


def tasks(shape: tuple[int, ...], n: int = 2, seed: int = 1) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(WAYS).repeat(SHOTS)

    def x() -> Tensor:
        return torch.randn(len(y), *shape, generator=g, dtype=torch.float64)

    return [Task((x(), y), (x(), y)) for _ in range(n)]


IMAGES, VECTORS = (1, 8, 8), (4,)


def grads(learner: nn.Module, tasks_: list[Task]) -> tuple[float, dict[str, Tensor]]:
    """Meta-loss and the gradient of every learner parameter (zeros where unused)."""
    learner.zero_grad(set_to_none=True)
    loss = learner.meta_loss(tasks_).loss
    loss.backward()
    named = learner.named_parameters()
    return float(loss.detach()), {
        n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in named
    }


def finite_differences(learner: nn.Module, tasks_: list[Task], entries: list[tuple[str, int]]):
    """Central differences of the meta-loss in the flat entries ``(param name, index)``."""
    params = dict(learner.named_parameters())
    out = []
    for name, index in entries:
        flat = params[name].data.view(-1)  # test-only perturbation of a leaf
        original = float(flat[index])
        values = []
        for value in (original + FD_EPS, original - FD_EPS):
            flat[index] = value
            with torch.no_grad():  # the inner loop's torch.func.grad still runs
                values.append(float(learner.meta_loss(tasks_).loss))
        flat[index] = original
        out.append((values[0] - values[1]) / (2 * FD_EPS))
    return torch.tensor(out, dtype=torch.float64)


def check_against_fd(learner: nn.Module, tasks_: list[Task], entries: list[tuple[str, int]]):
    _, g = grads(learner, tasks_)
    auto = torch.stack([g[name].view(-1)[i] for name, i in entries])
    fd = finite_differences(learner, tasks_, entries)
    error = float((auto - fd).norm() / fd.norm())
    assert error < FD_RTOL, f"relative error {error:.2e} against finite differences"
    return error


def all_entries(learner: nn.Module, prefix: str) -> list[tuple[str, int]]:
    return [
        (n, i) for n, p in learner.named_parameters() if n.startswith(prefix)
        for i in range(p.numel())
    ]  # fmt: skip


def assert_close(a: dict[str, Tensor], b: dict[str, Tensor], tol: float, keys=None) -> None:
    for k in keys or a:
        diff = float((a[k] - b[k]).abs().max())
        assert diff <= tol, f"{k}: max difference {diff:.2e} > {tol:.0e}"


def theta_grads(g: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k[len("model.") :]: v for k, v in g.items() if k.startswith("model.")}


# ------------------------------------------------------------------------------ Meta-SGD


def test_metasgd_rate_gradients_match_finite_differences():
    learner = MetaSGD(mlp(), inner_lr=0.3, inner_steps=2, vectorize="loop")
    with torch.no_grad():  # distinct rates per entry, so a mix-up of entries would show
        for p in learner.lrs.values():
            p.mul_(torch.linspace(0.5, 1.5, p.numel(), dtype=p.dtype).view_as(p))
    check_against_fd(learner, tasks(VECTORS, n=3), all_entries(learner, "lrs."))


def test_metasgd_rates_are_learner_parameters_of_the_parameters_shape():
    model = conv()
    learner = MetaSGD(model, inner_lr=0.2)
    shapes = {n.replace(".", "__"): p.shape for n, p in model.named_parameters()}
    # The norm layers stay out of the inner loop (no rate) unless adapt_norm.
    assert {k: v.shape for k, v in MetaSGD(model, adapt_norm=True).lrs.items()} == shapes
    shapes = {k: v for k, v in shapes.items() if "__norm__" not in k}
    assert {k: v.shape for k, v in learner.lrs.items()} == shapes
    assert all(torch.all(v == 0.2) for v in learner.lrs.values())
    assert any(n.startswith("lrs.") for n, _ in learner.named_parameters())
    before = {k: v.detach().clone() for k, v in learner.lrs.items()}
    opt = torch.optim.Adam(learner.parameters(), lr=1e-2)
    learner.backward(tasks(IMAGES))
    opt.step()
    # Conv biases feed batch norm, which removes them: their inner gradient, and so their
    # rates' meta-gradient, is exactly zero. Every other rate moves.
    moved = {k for k in before if not torch.equal(before[k], learner.lrs[k])}
    assert moved == {k for k in before if not k.endswith("conv__bias")}


def test_metasgd_with_equal_rates_is_maml():
    maml = MAML(conv(), inner_lr=0.3, inner_steps=2)
    metasgd = MetaSGD(copy.deepcopy(maml.model), inner_lr=0.3, inner_steps=2)
    ts = tasks(IMAGES)
    loss_maml, g_maml = grads(maml, ts)
    loss_sgd, g_sgd = grads(metasgd, ts)
    assert abs(loss_maml - loss_sgd) <= EXACT
    assert_close(g_maml, g_sgd, EXACT)


def test_metasgd_respects_adapt_keys():
    anil = ANIL(conv(), inner_lr=0.3, inner_steps=2)
    metasgd = MetaSGD(copy.deepcopy(anil.model), inner_lr=0.3, inner_steps=2,
                      adapt_keys=anil.adapt_keys)  # fmt: skip
    assert sorted(metasgd.lrs) == ["head__bias", "head__weight"]
    ts = tasks(IMAGES)
    loss_anil, g_anil = grads(anil, ts)
    loss_sgd, g_sgd = grads(metasgd, ts)
    assert abs(loss_anil - loss_sgd) <= EXACT
    assert_close(g_anil, g_sgd, EXACT)


def test_metasgd_vmap_and_loop_agree():
    ts = tasks(IMAGES, n=3)
    learner = MetaSGD(conv(), inner_lr=0.3, inner_steps=2)
    learner.vectorize = "loop"
    _, g_loop = grads(learner, ts)
    learner.vectorize = "vmap"
    assert learner.meta_loss(ts).vectorized == 3
    _, g_vmap = grads(learner, ts)
    assert_close(g_loop, g_vmap, VMAP_TOL)


# ------------------------------------------------------------------------------ MAML++


def mamlpp(model: nn.Module, **kwargs) -> MAMLpp:
    settings = dict(inner_lr=0.3, inner_steps=2, msl_steps=10, msl_epoch_length=1,
                    first_order_steps=0)  # fmt: skip
    return MAMLpp(model, **{**settings, **kwargs})


def perturbed(learner: MAMLpp) -> MAMLpp:
    """Give every step's rate and batch-norm copy a different value (nothing symmetric)."""
    with torch.no_grad():
        for group in (learner.lrs, learner.bn):
            for p in group.values():
                p.mul_(torch.linspace(0.7, 1.3, p.numel(), dtype=p.dtype).view_as(p))
                p.add_(0.05)
    return learner


def test_msl_weights_follow_the_papers_schedule():
    # S = 5, 10 MSL epochs: decay 1/50 per epoch, floor 0.006, final cap 0.976.
    expected = {0: [0.2] * 5, 3: [0.14] * 4 + [0.44], 9: [0.02] * 4 + [0.92],
                10: [0.006] * 4 + [0.976], 40: [0.006] * 4 + [0.976]}  # fmt: skip
    for epoch, weights in expected.items():
        assert msl_weights(5, epoch, 10) == pytest.approx(weights, abs=1e-15)
    assert msl_weights(1, 7, 3) == [1.0]
    for steps in range(1, 7):
        for msl_steps in (1, 4, 15):
            for epoch in range(0, 40):
                weights = msl_weights(steps, epoch, msl_steps)
                assert abs(sum(weights) - 1.0) < 1e-12, (steps, msl_steps, epoch)
                assert min(weights) > 0


def test_learner_step_weights_switch_to_the_last_step_after_msl():
    learner = mamlpp(mlp(), inner_steps=3, msl_steps=4)
    for epoch in range(4):
        learner.schedule(epoch, 100)
        assert learner.step_weights() == msl_weights(3, epoch, 4)
    learner.schedule(4, 100)
    assert learner.step_weights() == [0.0, 0.0, 1.0]
    assert mamlpp(mlp(), inner_steps=3, msl_steps=0).step_weights() == [0.0, 0.0, 1.0]


def test_msl_weights_move_once_an_epoch_as_the_reference():
    """The reference's weights at iteration i are those of epoch int(i / 500), with MSL
    while that epoch is below multi_step_loss_num_epochs (its default here: 10 of 500)."""
    learner = MAMLpp(mlp())
    assert (learner.msl_steps, learner.msl_epoch_length, learner.inner_steps) == (5000, 500, 5)

    def reference(i: int) -> list[float]:  # few_shot_learning_system.py, per epoch e < E
        e, steps, epochs = i // 500, 5, 10
        if e >= epochs:
            return [0.0] * 4 + [1.0]
        decay, floor = 1.0 / steps / epochs, 0.03 / steps
        return [max(1 / steps - e * decay, floor)] * 4 + [
            min(1 / steps + e * (steps - 1) * decay, 1 - (steps - 1) * floor)
        ]

    for i in (0, 1, 499, 500, 777, 999, 1000, 4499, 4500, 4999, 5000, 9000):
        learner.schedule(i, 50_000)
        assert learner.step_weights() == pytest.approx(reference(i), abs=1e-15), i


def test_mamlpp_with_last_step_loss_and_one_rate_is_maml():
    maml = MAML(conv(), inner_lr=0.3, inner_steps=2)
    learner = mamlpp(copy.deepcopy(maml.model), msl_steps=0, per_step_bn=False)
    ts = tasks(IMAGES)
    loss_maml, g_maml = grads(maml, ts)
    loss_pp, g_pp = grads(learner, ts)
    assert abs(loss_maml - loss_pp) <= EXACT
    assert_close(theta_grads(g_maml), theta_grads(g_pp), EXACT)


def test_msl_loss_is_the_weighted_sum_of_maml_losses_after_each_step():
    model = mlp()
    learner = mamlpp(model, inner_steps=3, msl_steps=10, per_step_bn=False)
    learner.schedule(4, 100)
    weights = learner.step_weights()
    assert len(set(weights)) == 2
    ts = tasks(VECTORS, n=3)
    loss_pp, g_pp = grads(learner, ts)
    loss_ref, g_ref = 0.0, {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for s, w in enumerate(weights):
        loss_s, g_s = grads(MAML(model, inner_lr=0.3, inner_steps=s + 1), ts)
        loss_ref += w * loss_s
        g_ref = {n: g_ref[n] + w * g_s[f"model.{n}"] for n in g_ref}
    assert abs(loss_pp - loss_ref) <= EXACT
    assert_close(g_ref, theta_grads(g_pp), EXACT)


def test_bnwb_at_initialisation_is_maml_without_adapting_batch_norm():
    model = conv()
    bn = batch_norm_names(model)
    assert len(bn) == 8
    maml = MAML(model, inner_lr=0.3, inner_steps=2,
                adapt_keys=[n for n, _ in model.named_parameters() if n not in bn])  # fmt: skip
    learner = mamlpp(copy.deepcopy(model), msl_steps=0)
    assert learner.bn["features__0__norm__weight"].shape == (2, 2)  # [steps, channels]
    ts = tasks(IMAGES)
    loss_maml, g_maml = grads(maml, ts)
    loss_pp, g_pp = grads(learner, ts)
    assert abs(loss_maml - loss_pp) <= EXACT
    theta, theta_maml = theta_grads(g_pp), theta_grads(g_maml)
    assert_close(theta_maml, theta, EXACT, keys=[k for k in theta_maml if k not in bn])
    # The model's own batch-norm parameters are unused; the copies take their gradient,
    # split over steps: the sum over steps is MAML's gradient for the shared parameter.
    for name in bn:
        assert float(theta[name].abs().max()) == 0.0
        per_step = g_pp["bn." + name.replace(".", "__")]
        diff = float((per_step.sum(0) - theta_maml[name]).abs().max())
        assert diff <= EXACT, name


def test_mamlpp_gradients_match_finite_differences():
    """LSLR rates, per-step batch-norm copies and some theta entries, with MSL on."""
    learner = perturbed(mamlpp(conv(), msl_steps=10))
    learner.schedule(3, 100)
    entries = all_entries(learner, "lrs.") + all_entries(learner, "bn.")[::2]
    entries += [("model.head.weight", i) for i in range(6)]
    entries += [("model.features.0.conv.weight", i) for i in range(0, 18, 3)]
    check_against_fd(learner, tasks(IMAGES), entries)


def test_derivative_order_annealing_switches_from_fomaml_to_maml():
    model = conv()
    ts = tasks(IMAGES)
    _, g_fo = grads(FOMAML(model, inner_lr=0.3, inner_steps=2), ts)
    _, g_so = grads(MAML(model, inner_lr=0.3, inner_steps=2), ts)
    gap = max(float((g_fo[k] - g_so[k]).abs().max()) for k in g_fo)
    assert gap > 1e-4, "first and second order should differ on this problem"
    learner = mamlpp(model, msl_steps=0, first_order_steps=2, per_step_bn=False)
    for epoch, reference in ((0, g_fo), (1, g_fo), (2, g_so), (7, g_so)):
        learner.schedule(epoch, 100)
        _, g = grads(learner, ts)
        assert_close(theta_grads(reference), theta_grads(g), EXACT)


def test_mamlpp_vmap_and_loop_agree():
    ts = tasks(IMAGES, n=3)
    learner = perturbed(mamlpp(conv(), msl_steps=10))
    learner.schedule(2, 100)
    learner.vectorize = "loop"
    loss_loop, g_loop = grads(learner, ts)
    learner.vectorize = "vmap"
    assert learner.meta_loss(ts).vectorized == 3
    loss_vmap, g_vmap = grads(learner, ts)
    assert abs(loss_loop - loss_vmap) <= VMAP_TOL
    assert_close(g_loop, g_vmap, VMAP_TOL)


def test_early_stop_gives_the_remaining_weight_to_the_last_adapted_weights():
    model = mlp()
    learner = mamlpp(model, inner_steps=3, msl_steps=10, per_step_bn=False)
    learner.schedule(2, 100)
    w = learner.step_weights()
    ts = tasks(VECTORS, n=2)
    stopped = [Task(t.support, t.query, stop=lambda step, _: step >= 2) for t in ts]
    after = [grads(MAML(model, inner_lr=0.3, inner_steps=s), ts)[0] for s in (1, 2)]
    expected = w[0] * after[0] + (w[1] + w[2]) * after[1]
    result = learner.meta_loss(stopped)
    assert abs(float(result.loss.detach()) - expected) <= EXACT


def test_adapt_and_evaluate_use_the_learned_rates_and_final_batch_norm():
    learner = perturbed(mamlpp(conv(), msl_steps=10))
    ts = tasks(IMAGES, n=2)
    losses, accs = learner.evaluate(ts)
    for task, loss in zip(ts, losses):
        fast = learner.adapt(task)
        out = functional_call(learner.model, fast, (task.query[0],))
        assert abs(float(F.cross_entropy(out, task.query[1])) - float(loss)) <= EXACT
    learner.schedule(10, 100)  # MSL over: the meta-loss is the final step's loss, as evaluated
    assert float((learner.meta_loss(ts).task_losses - losses).abs().max()) <= EXACT
    assert accs.shape == (2,)


def test_bad_settings_raise_with_the_fix():
    with pytest.raises(ValueError, match="first_order_steps"):
        MAMLpp(conv(), first_order=True)
    with pytest.raises(ValueError, match="inner_steps >= 1"):
        MAMLpp(conv(), inner_steps=0)
    with pytest.raises(ValueError, match=">= 0"):
        MAMLpp(conv(), msl_steps=-1)
    with pytest.raises(ValueError, match="per_step_bn=False"):
        MAMLpp(conv(), adapt_keys=["features.0.norm.weight", "head.weight"], adapt_norm=True)
    with pytest.raises(ValueError, match="adapt_norm=True"):  # read at the first task
        held = MAMLpp(conv(), adapt_keys=["features.0.norm.weight", "head.weight"],
                      per_step_bn=False)  # fmt: skip
        held.meta_loss(tasks((1, 8, 8)))
    with pytest.raises(ValueError, match="msl_epoch_length=0 must be >= 1"):
        MAMLpp(conv(), msl_epoch_length=0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        MAMLpp(conv()).schedule(-1, 100)
    with pytest.raises(ValueError, match="msl_steps >= 1"):
        msl_weights(3, 0, 0)
    learner = MAMLpp(mlp(), inner_steps=2, msl_steps=5)
    odd = tasks(VECTORS, n=1)[0]
    with pytest.raises(ValueError, match="one weight per step"):
        learner.meta_loss([Task(odd.support, odd.query, steps=3)])
    with pytest.raises(ValueError, match="inner_lr must be a number"):
        MetaSGD(mlp(), inner_lr=torch.tensor(0.1))


def test_mamlpp_checkpointed_inner_steps_give_the_same_gradients():
    learner = perturbed(mamlpp(conv(), msl_steps=10))
    learner.schedule(2, 100)
    checkpointed = copy.deepcopy(learner)
    checkpointed.gradient_checkpointing = True
    ts = tasks(IMAGES)
    loss, g = grads(learner, ts)
    loss_ck, g_ck = grads(checkpointed, ts)
    assert abs(loss - loss_ck) <= EXACT
    assert_close(g, g_ck, EXACT)
