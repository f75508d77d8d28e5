"""ProtoNet, R2D2, MetaOptNet and MetaOptNet-LR against independent references, in float64.

Each reference (`protonet_reference`, `r2d2_reference`, `svm_reference`,
`metaoptnet_lr_reference`) is the paper's formula written out with plain torch ops on Conv4's
own feature stack (not the identity-head trick): squared distances by ``torch.cdist``; ridge
regression in its primal ``D x D`` form (not the Woodbury one the learner solves); the SVM's
dual as MetaOptNet's dense QP matrices, its solution on the optimal face by one dense KKT
solve that autograd differentiates (not CG on HVPs), checked by the QP's KKT conditions;
logistic regression by Newton's method with dense Hessians and its implicit gradient from
dense Jacobians (not CG on HVPs).
Each takes ``(learner, tasks)`` and returns the meta-gradient, name -> tensor, over the
learner's parameters that get one. Tasks mix 3- and 5-way (the model's head is 3-way), so
the per-task sizing is tested too; vmap against the loop; the adapted head against
evaluation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call

from metalearn.algorithms import R2D2, MetaOptNet, MetaOptNetLR, ProtoNet, make_learner
from metalearn.algorithms.compiled import CompiledMetaGradient
from metalearn.algorithms.heads import HeadLearner
from metalearn.algorithms.metaoptnet import solve_dual
from metalearn.engine import Task
from metalearn.models import Conv4
from tests.algorithms.test_svm_head import kkt_violation

F64 = torch.float64
EXACT = 1e-10
MODEL_WAYS, SHOTS, QUERIES = 3, 2, 2


def conv(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Conv4(in_channels=1, ways=MODEL_WAYS, hidden=4).double()


def tasks(ways: tuple[int, ...] = (3, 5, 3, 5), seed: int = 1) -> list[Task]:
    """Tasks of the given ways, each class with SHOTS support and QUERIES query examples."""
    g = torch.Generator().manual_seed(seed)

    def one(n: int) -> Task:
        ys, yq = torch.arange(n).repeat_interleave(SHOTS), torch.arange(n).repeat(QUERIES)
        xs = torch.randn(len(ys), 1, 8, 8, generator=g, dtype=F64)
        return Task((xs, ys), (torch.randn(len(yq), 1, 8, 8, generator=g, dtype=F64), yq))

    return [one(n) for n in ways]


def body(learner: HeadLearner) -> dict[str, Tensor]:
    """The backbone's parameters (the model's head is not used by the heads)."""
    return {k: v for k, v in learner.model.named_parameters() if not k.startswith("head.")}


def embed(learner: HeadLearner, x: Tensor) -> Tensor:
    """Conv4's features before its head, from its feature stack alone: ``[B, D]``."""
    stack = {k[len("features.") :]: v for k, v in body(learner).items()}
    return functional_call(learner.model.features, stack, (x,)).mean((-2, -1))


def meta_gradient(learner: HeadLearner, loss: Tensor, extra: dict[str, Tensor]) -> dict:
    """d loss / d (backbone, extra) by autograd, keyed by the learner's parameter names."""
    names = {f"model.{k}": v for k, v in body(learner).items()} | extra
    grads = torch.autograd.grad(loss, list(names.values()))
    return dict(zip(names, grads))


# --------------------------------------------------------------------------- references


def protonet_reference(learner: ProtoNet, tasks_: list[Task]) -> dict[str, Tensor]:
    """Snell et al. (2017), Eq. 1-2: prototypes as class means, logits -||f(x) - c_k||^2."""
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        fs, fq = embed(learner, xs), embed(learner, xq)
        protos = torch.stack([fs[ys == k].mean(0) for k in range(int(ys.max()) + 1)])
        total = total + F.cross_entropy(-(torch.cdist(fq, protos) ** 2), yq)
    return meta_gradient(learner, total / len(tasks_), {})


def rrnet_logits(
    fs: Tensor,
    ys: Tensor,
    fq: Tensor,
    lam: float | Tensor,
    scale: float | Tensor,
    bias: float | Tensor = 0.0,
) -> Tensor:
    """Bertinetto et al. (2019), as ``RRNet`` computes it: ridge regression of ``X = [Z, 1] /
    sqrt(S)`` onto ``Y = onehot / sqrt(S)`` in the primal form
    ``[W; b] = (X^T X + lam I_{D+1})^{-1} X^T Y``, logits ``scale (Z_q W + b) + bias``.
    ``fs [S, D]``, ``ys [S]``, ``fq [Q, D]`` in float64; returns ``[Q, C]``."""
    n = fs.shape[0]
    x = torch.cat([fs, torch.ones(n, 1, dtype=F64)], 1) / math.sqrt(n)
    y = F.one_hot(ys).to(F64) / math.sqrt(n)
    wb = torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=F64), x.T @ y)
    return scale * (fq @ wb[:-1] + wb[-1]) + bias


def r2d2_reference(learner: R2D2, tasks_: list[Task]) -> dict[str, Tensor]:
    """`rrnet_logits` on Conv4's features, the mean query cross-entropy's meta-gradient."""
    lam, scale, bias = learner.lam, learner.scale, learner.bias
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        logits = rrnet_logits(embed(learner, xs), ys, embed(learner, xq), lam, scale, bias)
        total = total + F.cross_entropy(logits, yq)
    extra = {"lam": learner.lam, "scale": learner.scale, "bias": learner.bias}
    learned = {k: v for k, v in extra.items() if v.requires_grad}  # lam: unless learn_lambda
    return meta_gradient(learner, total / len(tasks_), learned)


def r2d2_plain_reference(learner: R2D2, tasks_: list[Task]) -> dict[str, Tensor]:
    """The ``plain`` head (MetaOptNet's ``R2D2Head`` formula): ridge regression onto one-hot
    targets in the primal form ``W = (X^T X + lam I_D)^{-1} X^T Y``, logits
    ``scale X_q W + bias``, with ``lam`` and ``scale`` log-parameterised."""
    lam, scale = learner.log_lam.exp(), learner.log_scale.exp()
    bias = learner.bias
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        fs, fq = embed(learner, xs), embed(learner, xq)
        y = F.one_hot(ys).to(F64)
        w = torch.linalg.solve(fs.T @ fs + lam * torch.eye(fs.shape[1], dtype=F64), fs.T @ y)
        total = total + F.cross_entropy(scale * fq @ w + bias, yq)
    extra = {"log_lam": learner.log_lam, "log_scale": learner.log_scale, "bias": learner.bias}
    return meta_gradient(learner, total / len(tasks_), extra)


def newton_dense(fs: Tensor, ys: Tensor, weight_decay: float, steps: int = 40) -> Tensor:
    """Lee et al.'s inner problem with a logistic-regression head, by plain Newton steps on
    the flattened ``W [C, D]`` with dense Hessians."""
    ways, dim = int(ys.max()) + 1, fs.shape[1]

    def objective(w: Tensor) -> Tensor:
        logits = fs @ w.view(ways, dim).T
        return F.cross_entropy(logits, ys) + 0.5 * weight_decay * (w**2).sum()

    w = torch.zeros(ways * dim, dtype=F64)
    for _ in range(steps):
        w = w - torch.linalg.solve(hessian(objective, w), jacobian(objective, w))
    return w.view(ways, dim)


def logistic_gradient(w: Tensor, x: Tensor, ys: Tensor, decay: float) -> Tensor:
    """grad_W of the inner objective at the flattened ``w``, differentiable (dense autograd)."""
    ways = int(ys.max()) + 1

    def objective(v: Tensor) -> Tensor:
        return F.cross_entropy(x @ v.view(ways, -1).T, ys) + 0.5 * decay * (v**2).sum()

    return jacobian(objective, w, create_graph=True)


def metaoptnet_lr_reference(learner: MetaOptNetLR, tasks_: list[Task]) -> dict[str, Tensor]:
    """The implicit gradient with dense matrices: ``dW*/dX = -H^{-1} d(grad_W f)/dX``, and the
    query loss ``CE(scale X_q W*^T)`` differentiated through it into the backbone."""
    scale, decay = learner.log_scale.exp(), learner.weight_decay
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        fs, fq = embed(learner, xs), embed(learner, xq)
        w = newton_dense(fs.detach(), ys, decay)
        flat, x0 = w.reshape(-1), fs.detach()
        h = jacobian(lambda v, x0=x0, ys=ys: logistic_gradient(v, x0, ys, decay), flat)
        mixed = jacobian(lambda x, flat=flat, ys=ys: logistic_gradient(flat, x, ys, decay), x0)
        dw_dx = -torch.linalg.solve(h, mixed.reshape(len(flat), -1))  # [C D, S D]
        w_const = w.clone().requires_grad_(True)
        loss = F.cross_entropy(scale * fq @ w_const.T, yq)
        (g_w,) = torch.autograd.grad(loss, w_const, retain_graph=True)
        g_fs = (dw_dx.T @ g_w.reshape(-1)).reshape(fs.shape)
        total = total + loss + (g_fs.detach() * fs).sum()  # the chain rule through W*(fs)
    return meta_gradient(learner, total / len(tasks_), {"log_scale": learner.log_scale})


def svm_face_solution(fs: Tensor, ys: Tensor, c_reg: float, ridge: float, active: Tensor):
    """MetaOptNetHead_SVM_CS's QP (``G = K (x) I + ridge I``, ``e = -Y``, ``z <= c_reg Y``,
    ``(I (x) 1^T) z = 0``) with the ``active`` bounds as equalities, by one dense KKT solve:
    ``alpha [S, C]`` and ``(G, e, h, A)``, differentiable in ``fs``."""
    s, ways = len(fs), int(ys.max()) + 1
    y = F.one_hot(ys, ways).to(F64).reshape(-1)
    g = torch.kron(fs @ fs.T, torch.eye(ways, dtype=F64)) + ridge * torch.eye(s * ways, dtype=F64)
    a = torch.kron(torch.eye(s, dtype=F64), torch.ones(1, ways, dtype=F64))
    eq = torch.cat([a, torch.eye(s * ways, dtype=F64)[active]])
    rhs = torch.cat([y, torch.zeros(s, dtype=F64), c_reg * y[active]])
    k = len(eq)
    kkt = torch.cat([torch.cat([g, eq.T], 1), torch.cat([eq, torch.zeros(k, k, dtype=F64)], 1)])
    alpha = torch.linalg.solve(kkt, rhs)[: s * ways].reshape(s, ways)
    return alpha, (g, -y, c_reg * y, a)


def svm_query_loss(fs: Tensor, fq: Tensor, ys: Tensor, yq: Tensor, *, c_reg: float,
                   ridge: float, scale: Tensor, smoothing: float) -> Tensor:  # fmt: skip
    """Lee et al. (2019) with MetaOptNet's SVM-CS head: the dual's solution on its
    optimal face (the face read off `solve_dual`'s answer at a 1e-9 gap; the face's solution
    then certified by the QP's KKT conditions, so it is the unique optimum), ``W = alpha^T
    X``, logits ``scale X_q W^T``, the loss label-smoothed as MetaOptNet's train.py (``1 -
    eps`` on the label, ``eps / (C - 1)`` elsewhere)."""
    ways = int(ys.max()) + 1
    bound = c_reg * F.one_hot(ys, ways).to(F64).reshape(-1)
    face = solve_dual(fs.detach(), ys, ways, c_reg=c_reg, ridge=ridge).alpha
    alpha, qp = svm_face_solution(fs, ys, c_reg, ridge, (bound - face.reshape(-1)) < 1e-9)
    assert kkt_violation(alpha.detach().reshape(-1), *[t.detach() for t in qp]) < 1e-10
    assert bool(((bound - alpha.detach().reshape(-1)) < 1e-9).any())  # a real QP: bounds active
    logits = scale * fq @ (alpha.T @ fs).T
    onehot = F.one_hot(yq, ways).to(F64)
    target = onehot * (1 - smoothing) + (1 - onehot) * smoothing / (ways - 1)
    return -(target * torch.log_softmax(logits, 1)).sum(1).mean()


def svm_reference(learner: MetaOptNet, tasks_: list[Task]) -> dict[str, Tensor]:
    """The meta-gradient of `svm_query_loss` by autograd through the dense face solve."""
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        total = total + svm_query_loss(
            embed(learner, xs), embed(learner, xq), ys, yq, c_reg=learner.c_reg,
            ridge=learner.ridge, scale=learner.scale, smoothing=learner.label_smoothing,
        )  # fmt: skip
    return meta_gradient(learner, total / len(tasks_), {"scale": learner.scale})


REFERENCES = {"protonet": protonet_reference, "r2d2": r2d2_reference,
              "r2d2-plain": r2d2_plain_reference, "metaoptnet": svm_reference,
              "metaoptnet-lr": metaoptnet_lr_reference}  # fmt: skip
SETTINGS = {
    "protonet": {},
    # lambda learned here, so its meta-gradient is checked too (the default holds it fixed)
    "r2d2": {"lam": 0.5, "scale": 3.0, "bias": 0.2, "learn_lambda": True},
    "r2d2-plain": {
        "ridge_form": "plain",
        "lam": 0.5,
        "scale": 3.0,
        "bias": 0.2,
        "learn_lambda": True,
    },
    "metaoptnet": {"scale": 2.0, "c_reg": 0.5},
    "metaoptnet-lr": {"weight_decay": 0.5, "scale": 2.0, "tol": 1e-12, "cg_tol": 1e-13},
}


def learner_of(algorithm: str, **kwargs) -> HeadLearner:
    """The learner of ``algorithm`` (``r2d2-plain``: R2D2's plain ridge_form) at `SETTINGS`."""
    name = algorithm.removesuffix("-plain")
    return make_learner(name, conv(), {**SETTINGS[algorithm], **kwargs})


def grads_of(learner: HeadLearner) -> dict[str, Tensor]:
    return {k: p.grad for k, p in learner.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- meta-gradients


@pytest.mark.parametrize("algorithm", list(REFERENCES))
def test_meta_gradient_equals_the_papers_formula(algorithm: str) -> None:
    learner = learner_of(algorithm)
    batch = tasks()
    expected = REFERENCES[algorithm](learner, batch)
    metrics = learner.backward(batch)
    got = grads_of(learner)
    assert set(got) == set(expected)  # the model's own head gets no gradient
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=EXACT, msg=name)
    assert metrics.vectorized == (0 if algorithm.startswith("metaoptnet") else len(batch))


@pytest.mark.parametrize("algorithm", ["protonet", "r2d2", "r2d2-plain"])
def test_vmap_equals_the_loop(algorithm: str) -> None:
    batch = tasks((5, 5, 5, 3, 3))
    results = {}
    for mode in ("vmap", "loop"):
        learner = learner_of(algorithm, vectorize=mode)
        metrics = learner.backward(batch)
        results[mode] = (grads_of(learner), metrics, learner.evaluate(batch))
        assert metrics.vectorized == (5 if mode == "vmap" else 0)
    (gv, mv, ev), (gl, ml, el) = results["vmap"], results["loop"]
    for name in gl:
        torch.testing.assert_close(gv[name], gl[name], rtol=0, atol=EXACT, msg=name)
    assert mv.loss == pytest.approx(ml.loss, abs=1e-12)
    torch.testing.assert_close(ev, el, rtol=0, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["r2d2", "r2d2-plain"])
def test_r2d2_bias_cancels_in_the_softmax(algorithm: str) -> None:
    learner = learner_of(algorithm)
    learner.backward(tasks())
    assert abs(float(learner.bias.grad)) < 1e-14
    lam, scale = ("lam", "scale") if algorithm == "r2d2" else ("log_lam", "log_scale")
    for name in (lam, scale):
        assert float(learner.get_parameter(name).grad.abs()) > 1e-6, name


def test_r2d2_defaults_are_the_references_and_hold_lambda_fixed() -> None:
    """``bertinetto/r2d2``: ``init_lambda: 50``, ``learn_lambda: False`` (fewshots.yaml), the
    Omniglot scripts' ``--base_learner.init_adj_scale 10``, ``AdjustLayer``'s bias 0."""
    learner = R2D2(conv())
    values = [float(v.detach()) for v in (learner.lam, learner.scale, learner.bias)]
    assert (learner.ridge_form, *values) == (
        "rrnet", 50.0, 10.0, 0.0)  # fmt: skip
    assert "lam" not in dict(learner.named_parameters())  # a buffer: no meta-gradient
    learner.backward(tasks())
    assert float(learner.scale.grad.abs()) > 1e-6
    expected = r2d2_reference(learner, tasks())
    for name, p in learner.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=EXACT, msg=name)


# --------------------------------------------------------------------------- adapt, evaluate


@pytest.mark.parametrize("algorithm", list(REFERENCES))
def test_the_adapted_head_scores_as_evaluate_does(algorithm: str) -> None:
    """adapt() puts the solved head into the model's own (3-way) head: the plain model with
    those weights gives evaluate's loss and accuracy (ProtoNet's up to the -||f||^2 term,
    which the softmax ignores)."""
    learner = learner_of(algorithm)
    task = tasks((3,))[0]
    fast = learner.adapt(task)
    assert set(fast) == set(dict(learner.model.named_parameters()))
    with torch.no_grad():
        logits = functional_call(learner.model, fast, (task.query[0],))
    losses, accuracies = learner.evaluate([task])
    torch.testing.assert_close(F.cross_entropy(logits, task.query[1]), losses[0], rtol=0,
                               atol=1e-12)  # fmt: skip
    assert (logits.argmax(1) == task.query[1]).float().mean() == accuracies[0]
    with pytest.raises(ValueError, match="labels must be 0..2, each with an example"):
        learner.adapt(tasks((5,))[0])


def test_evaluate_ignores_the_steps_and_matches_backward() -> None:
    learner = learner_of("protonet")
    batch = tasks()
    metrics = learner.backward(batch)
    losses, accuracies = learner.evaluate(batch, steps=7)
    assert metrics.loss == pytest.approx(float(losses.mean()), abs=1e-12)
    assert metrics.accuracy == pytest.approx(float(accuracies.mean()), abs=1e-12)


# --------------------------------------------------------------------------- refusals


def test_heads_refuse_inner_loop_settings_and_a_model_without_a_linear_head() -> None:
    with pytest.raises(ValueError, match="ProtoNet has no inner loop; drop inner_lr"):
        ProtoNet(conv(), inner_lr=0.4)
    with pytest.raises(ValueError, match="has no 2-d 'classifier.weight'"):
        R2D2(conv(), head="classifier")
    with pytest.raises(ValueError, match="vectorize='vmap' is not supported"):
        MetaOptNet(conv(), vectorize="vmap")
    with pytest.raises(ValueError, match="lam and scale must be > 0"):
        R2D2(conv(), lam=0.0)
    with pytest.raises(ValueError, match="ridge_form 'ridge'; choose one of rrnet, plain"):
        R2D2(conv(), ridge_form="ridge")


def test_metaoptnet_lr_names_an_inner_solve_that_did_not_converge() -> None:
    learner = learner_of("metaoptnet-lr", newton_steps=1)
    with pytest.raises(ValueError, match=r"inner solver did not converge: \|\|F\(x\*, theta\)"):
        learner.backward(tasks((3,)))


@pytest.mark.parametrize("algorithm", ["metaoptnet", "metaoptnet-lr"])
def test_metaoptnet_solves_each_task_to_its_tolerance(algorithm: str) -> None:
    """float32, the default tolerances: every task of a Conv4 meta-batch converges."""
    torch.manual_seed(0)
    learner = make_learner(algorithm, Conv4(in_channels=1, ways=5, hidden=16), {})
    batch = [Task((t.support[0].float(), t.support[1]), (t.query[0].float(), t.query[1]))
             for t in tasks((5, 5, 5, 5), seed=2)]  # fmt: skip
    metrics = learner.backward(batch)
    assert math.isfinite(metrics.loss) and metrics.skipped == 0
    for name, p in learner.named_parameters():
        if not name.startswith("model.head."):
            assert p.grad is not None and p.grad.isfinite().all(), name


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["protonet", "r2d2"])
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_compiled_meta_gradient_equals_eager(algorithm: str) -> None:
    """--compile runs a closed-form head's vmapped chunk as one compiled graph, with the
    eager meta-gradient; MetaOptNet's data-dependent solver is refused in one line."""
    batch = tasks((3, 3, 3))
    eager = learner_of(algorithm)
    eager.backward(batch)
    compiled = learner_of(algorithm)
    runner = CompiledMetaGradient(compiled)
    runner(batch)
    assert runner.runner.whole and runner.runner.break_reason is None
    expected = grads_of(eager)
    for name, grad in grads_of(compiled).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="MetaOptNetLR: its Newton solver .* run MetaOptNetLR "):
        CompiledMetaGradient(learner_of("metaoptnet-lr"))
    with pytest.raises(ValueError, match="MetaOptNet: its interior-point .* run MetaOptNet "):
        CompiledMetaGradient(learner_of("metaoptnet"))
