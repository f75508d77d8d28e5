"""The seam matrix: every registered algorithm x both experiments, a tiny run through the
experiment's own code, checked where the parts join.

For each cell:

(a) the run's record rebuilds the learner: the checkpoint's recipe is the one the arguments
    resolve to, and `metalearn.deploy.load_learner` builds from it a learner of the same
    class, arguments and parameter names and shapes, holding the checkpoint's weights;
(b) the meta-gradient of step 1, filled by the experiment's own `meta_step`
    on the loop's own task draw, equals a float64 reference written out here from the
    paper's update (a Conv4 forward written with ``F.conv2d``, unrolled autograd, the
    inner optimizers' updates, Meta-Curvature's transformed gradient as its authors'
    TensorFlow code computes it, the closed-form heads, iMAML's implicit gradient by a dense
    Hessian and a dense solve, MetaOptNet's SVM dual on its optimal face by a dense KKT
    solve certified by the QP's KKT conditions and differentiated by autograd, MetaOptNet-LR's
    head by Newton's method and its implicit gradient by a dense solve), not from the
    engine's functions;
(c) ``--curvature-every 1``'s ``curv/support_top_eig`` equals the mean top eigenvalue of
    dense float64 Hessians of the hand-written support loss where the algorithm's inner
    loop starts (Proto-MAML's prototype head, MAML++'s step-0 batch-norm copies, LoRA's
    adapters and head), on the loop's probe tasks, at the checkpoint's theta;
(d) the run's checkpoint through deploy (``scripts/transfer_check.py``: adapt, build the
    deployed network, predict) gives what `evaluate` gives on the same tasks, in the
    batch-norm reading the learner evaluates with (a learner scoring each query beside the
    support set alone, Reptile's default: also against a written-out loop,
    `deployed_beside_support`).

Beyond one cell per algorithm, `VARIANTS` runs MAML with other inner optimizers
(``--inner-optimizer``), and MAML and Meta-SGD with the norm layers adapted
(``--adapt-norm True``; by default they stay out of the inner loop, as in MAML's references),
and Proto-MAML as the Omniglot ``cpu`` preset trains it (second order, norm layers adapted;
its defaults are meta-dataset's first-order learner with the norm layers held),
and MAML++ on its presets' network (max-pool, leaky ReLU), and Reptile scoring its queries
in one batch (for (d)). Reptile's (b) runs in float64 (`Float64Tasks`). A new algorithm in
`metalearn.algorithms.registry.LEARNERS` without a row here fails
`test_every_registered_algorithm_has_a_row`. `test_seam_outer` runs the outer loop's settings
(MAML++'s meta-gradient clamp among them) against torch's optimizers, schedulers and
``clip_grad_value_``; `test_seam_ensemble` the test's ensemble of the best validations
(``--ensemble-top-k``) against the query logits written out.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metalearn.algorithms import HeadLearner, MetaLossLearner
from metalearn.algorithms.curvature import PROBE_SEED
from metalearn.algorithms.registry import LEARNERS
from metalearn.checkpoint import load_checkpoint
from metalearn.deploy import adapt_to_support, adapted_model, load_learner
from metalearn.runs.outer_loop import my_tasks
from metalearn.runs.run import load_samplers
from tests.algorithms.test_heads import svm_query_loss
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, script
from tests.helpers.ensemble_reference import ensemble_task_accuracies, run_test_tasks
from tests.helpers.image_set_fixtures import write_folder
from tests.helpers.reptile_batches import mini_batches
from tests.helpers.run_helpers import fs, make, om, recipe_of, seeded_learner

transfer_check = script("transfer_check")

F64 = torch.float64

pytestmark = pytest.mark.filterwarnings("ignore:.*published:UserWarning")

TINY = dict(
    iterations=1, meta_batch=2, query=1, eval_query=1, hidden=1, val_every=1, val_tasks=2,
    test_tasks=2, eval_inner_steps=1, track=False, device="cpu", vectorize="loop",
)  # fmt: skip
# Per algorithm: what its tiny run sets beyond TINY.
ROWS: dict[str, dict] = {
    "maml": {"inner_steps": 2}, "fomaml": {"inner_steps": 2}, "anil": {"inner_steps": 2},
    # MAML++ at its defaults: second order, MSL (the step-0 weights 1/2, 1/2), per-step BN.
    "metasgd": {"inner_steps": 1}, "mamlpp": {"inner_steps": 2},
    # iMAML at its own lr on both experiments (the few-shot one's open lr is MAML's 0.01,
    # at which hidden=1's CG bound is too loose to test against).
    "imaml": {"inner_steps": 2, "inner_lr": 0.1},
    # Proto-MAML at its defaults (meta-dataset's): 5 first-order steps at 0.01, norms held.
    "reptile": {}, "protomaml": {}, "lora": {"inner_steps": 1},
    "protonet": {}, "r2d2": {}, "metaoptnet": {}, "metaoptnet-lr": {}, "boil": {"inner_steps": 2},
    # Meta-Curvature at two steps (its default is one), 2 channels so a conv kernel's M_o is a
    # matrix (at hidden=1 it is 1x1: a transposed M_o passed, measured).
    "metacurvature": {"inner_steps": 2, "hidden": 2},
}  # fmt: skip
# Cells beyond one per algorithm: name -> (algorithm, what its tiny run sets beyond TINY).
# Adam's second-order step is ill-conditioned where an inner gradient entry is small: its
# derivative in g is about lr / max(|g|, eps), and at hidden=1 a batch-norm weight's
# gradient is ~1e-6, so at lr 0.4, eps 1e-8 float32 rounding of g is amplified ~1e5 times
# (measured: the float32 meta-gradient of a batch-norm bias was 590 against float64's
# 7900). lr 0.01 and eps 1e-3 bound that amplification by lr / eps = 10.
VARIANTS: dict[str, tuple[str, dict]] = {
    "maml+adam": (
        "maml",
        {"inner_steps": 2, "inner_optimizer": "adam", "inner_lr": 0.01, "inner_eps": 1e-3},
    ),
    "maml+momentum": ("maml", {"inner_steps": 2, "inner_optimizer": "momentum"}),
    # The norm layers in the inner loop (--adapt-norm True; the default keeps them out).
    "maml+adapt-norm": ("maml", {"inner_steps": 2, "adapt_norm": True}),
    "metasgd+adapt-norm": ("metasgd", {"inner_steps": 1, "adapt_norm": True}),
    # Proto-MAML as the Omniglot cpu preset trains it: second order, norm layers adapted.
    "protomaml+cpu": (
        "protomaml",
        {"inner_steps": 1, "inner_lr": 0.4, "first_order": False, "adapt_norm": True},
    ),  # fmt: skip
    # MAML++'s network (its presets'): stride-1 convs, max-pool, leaky ReLU.
    "mamlpp+network": ("mamlpp", {"inner_steps": 2, "pool": "max", "activation": "leaky_relu"}),
    # Reptile scoring the query set in one batch: the evaluation (d)'s deploy path measures
    # (its default scores each query beside the support set alone, which (d) cannot compare).
    "reptile+transductive": ("reptile", {"transductive": True}),
}
CELLS: dict[str, tuple[str, dict]] = {**{a: (a, r) for a, r in ROWS.items()}, **VARIANTS}
# (b)'s float32 tolerance, relative to the largest meta-gradient entry, where 1e-5 is too
# tight: the stride-1 network normalises 28x28 maps (7,840 positions a channel at hidden=1),
# and a conv bias before batch norm, whose true meta-gradient is 0, came out at 2.0e-6
# against entries of 0.16 (measured). Proto-MAML's queries normalised with the support set's
# moments: on the folder experiment its first conv bias, whose true meta-gradient is 0 (the
# support mean cancels it), came out at 1.16e-5 against entries of 1.14 (measured).
# Reptile's (b) runs in float64 (`Float64Tasks`): a conv bias feeding batch norm, whose true
# direction is 0, came out at 7.6e-11 against entries of 6.9e-3 (measured; 8e-12 on the
# mean loss), Adam's division by its root mean square scaling float64 rounding up as it does
# float32's, and the summed loss (the mini-batch's size times the mean's gradient) leaving
# Adam's epsilon less of that rounding to damp.
ATOL = {"mamlpp+network": 4e-5, "protomaml": 4e-5, "reptile": 1e-7, "reptile+transductive": 1e-7}
RTOL = {"reptile": 1e-9, "reptile+transductive": 1e-9}
EXPERIMENTS = ("omniglot", "folder")
# The global seed before (b)'s meta-step: Reptile's mini-batch shuffles. On the folder
# experiment (3 support examples, batches of 10) a batch spans shuffles, so the draw decides
# which examples count twice; on Omniglot's (5) a batch is two whole shuffles, the support
# twice, whatever the draw (checked: another seed fails the folder cell only).
DRAWS = 3


def test_every_registered_algorithm_has_a_row():
    assert set(ROWS) == set(LEARNERS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("seam") / "folder")


def arguments(experiment: str, cell: str, folder: Path, out: Path, **extra):
    """The experiment module and its tiny run's `Args`."""
    algorithm, row = CELLS[cell]
    flat = {**TINY, **row, "algorithm": algorithm, "out_dir": str(out), "run_name": "r",
            **extra}  # fmt: skip
    if LEARNERS[algorithm].head_sized_per_task or algorithm in ("imaml", "reptile"):
        flat.pop("vectorize")  # loop-only or no inner loop: the default
    if LEARNERS[algorithm].head_sized_per_task:
        flat.pop("inner_steps", None)
    if experiment == "omniglot":
        if not HAS_OMNIGLOT:
            pytest.skip(NO_OMNIGLOT)
        return om, make(om, **flat, data_root=str(OMNIGLOT))
    return fs, make(fs, **flat, dataset="folder", data_root=str(folder), image_size=16,
                    channels=1, ways=3)  # fmt: skip


def measures_curvature(algorithm: str) -> bool:
    cls = LEARNERS[algorithm]
    return issubclass(cls, MetaLossLearner) and not issubclass(cls, HeadLearner)


# --------------------------------------------------------------------------- by hand


def conv4(
    p: dict, x: torch.Tensor, model, *, body_only: bool = False, support_x=None
) -> torch.Tensor:
    """`metalearn.models.Conv4` written out: per block conv (plus LoRA's ``s B A``), batch
    norm over (N, H, W) with eps 1e-5, ReLU (or leaky ReLU, slope 0.01), pooling; then the
    head on the pooled features. With ``support_x``, each block's batch norm normalises
    ``x`` with the support images' moments at that block (Proto-MAML's reading, meta-dataset's
    ``transductive_batch_norm = False``), the support images run beside ``x``."""
    h, hs = x, support_x
    for i, block in enumerate(model.features):
        pre = f"features.{i}.conv"
        w = p[f"{pre}.weight"]
        if f"{pre}.lora_A" in p:
            w = w + block.conv.scaling * (p[f"{pre}.lora_B"] @ p[f"{pre}.lora_A"]).reshape(w.shape)
        h, hs = (None if z is None else
                 F.conv2d(z, w, p[f"{pre}.bias"], stride=block.conv.stride, padding=1)
                 for z in (h, hs))  # fmt: skip
        ref = h if hs is None else hs
        mean = ref.mean((0, 2, 3), keepdim=True)
        var = ((ref - mean) ** 2).mean((0, 2, 3), keepdim=True)
        gamma, beta = p[f"features.{i}.norm.weight"], p[f"features.{i}.norm.bias"]
        out = []
        for z in (h, hs):
            if z is not None:
                z = (z - mean) / torch.sqrt(var + 1e-5) * gamma[:, None, None] + beta[:, None, None]
                z = F.leaky_relu(z, 0.01) if block.activation == "leaky_relu" else torch.relu(z)
                if isinstance(block.pool, torch.nn.MaxPool2d):
                    z = F.max_pool2d(z, 2)
            out.append(z)
        h, hs = out
    h = h.flatten(1) if model.head_kind == "flatten" else h.mean((2, 3))
    return h if body_only else h @ p["head.weight"].T + p["head.bias"]


def ce(p, data, model) -> torch.Tensor:
    return F.cross_entropy(conv4(p, data[0], model), data[1])


def prototypes(p, support, model, ways: int) -> dict:
    """Snell et al. (2017) Eq. 1 as a linear head: ``2 c_k``, ``-||c_k||^2``."""
    f, y = conv4(p, support[0], model, body_only=True), support[1]
    c = torch.stack([f[y == k].mean(0) for k in range(ways)])
    return {"head.weight": 2 * c, "head.bias": -(c**2).sum(1)}


def as64(task):
    return [(x.to(F64), y) for x, y in (task.support, task.query)]


def grad_of(loss, params: dict) -> dict:
    names = [k for k, v in params.items() if v.requires_grad]
    grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
    return {k: torch.zeros_like(params[k]) if g is None else g for k, g in zip(names, grads)}


def sgd(p, g, state, lr, t):
    """Finn et al. (2017) Eq. 1: ``p - lr g``."""
    return p - lr * g, state


def momentum(mu: float):
    """Heavy-ball momentum as ``torch.optim.SGD`` (no dampening): ``b = mu b + g``,
    ``p - lr b``, from ``b = 0``."""

    def step(p, g, b, lr, t):
        b = g if b is None else mu * b + g
        return p - lr * b, b

    return step


def adam(beta1: float, beta2: float, eps: float):
    """Kingma & Ba (2015) Alg. 1, ``eps`` added to ``sqrt(v_hat)`` as ``torch.optim.Adam``."""

    def step(p, g, state, lr, t):
        m, v = (torch.zeros_like(g), torch.zeros_like(g)) if state is None else state
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        return p - lr * m_hat / (torch.sqrt(v_hat) + eps), (m, v)

    return step


def reptile_task(theta: dict, support, model, learner, gen, slots):
    """Nichol et al. (2018) Alg. 2's inner loop as ``openai/supervised-reptile`` runs it:
    ``inner_steps`` steps of TensorFlow's ``AdamOptimizer(beta1=0)`` on mini-batches of
    ``inner_batch`` support examples (`mini_batches`), from Adam's state ``slots`` =
    ``(t, m, v)`` as the previous task left it (TensorFlow's slots are never restored
    between tasks), on the mini-batch's per-example losses summed (``models.py`` lines
    27-30: ``minimize`` of the loss vector, which ``tf.gradients`` sums). TF's Adam (Kingma
    & Ba 2015, Sec. 2's last paragraph): ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2)
    g^2``, ``p - lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``, ``eps`` outside the
    bias correction. Returns phi and the slots after."""
    b1, b2, eps = learner.adam
    lr, x, y = float(learner.inner_lr), support[0], support[1]
    t, m, v = slots
    p = {k: w.detach() for k, w in theta.items()}
    for rows in mini_batches(len(y), learner.inner_batch, learner.inner_steps, gen):
        q = {k: w.clone().requires_grad_() for k, w in p.items()}
        loss = F.cross_entropy(conv4(q, x[rows], model), y[rows], reduction="sum")
        g = dict(zip(q, torch.autograd.grad(loss, list(q.values()))))
        t += 1
        m = {k: b1 * m[k] + (1 - b1) * g[k] for k in p}
        v = {k: b2 * v[k] + (1 - b2) * g[k] ** 2 for k in p}
        rate = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p = {k: p[k] - rate * m[k] / (v[k].sqrt() + eps) for k in p}
    return p, (t, m, v)


def curvature_step(p, g, state, lr, t):
    """Park & Oliva (2019) Eq. 5, ``p - alpha M g``, with ``lr`` = ``(alpha, factors)`` and
    ``M g`` as the authors' ``transform_gradients`` (``silverbottlep/maml``, ``maml.py``)
    computes it in TensorFlow's layout (``[k_h, k_w, C_in, C_out]``, a linear weight
    ``[C_in, C_out]``): ``M_out`` from the right, ``M_f`` and ``M_in`` from the left."""
    alpha, factors = lr
    if g.dim() == 1:
        return p - alpha * factors[0] * g, state
    if g.dim() == 2:
        m_out, m_in = factors
        return p - alpha * (m_in @ g.T @ m_out).T, state
    m_out, m_in, m_f = factors
    c_out, c_in = g.shape[:2]
    tf = g.permute(2, 3, 1, 0)
    n_f = tf.shape[0] * tf.shape[1]
    temp = tf.reshape(-1, c_out) @ m_out
    temp = (m_f @ temp.reshape(n_f, -1)).reshape(n_f, c_in, c_out)
    temp = m_in @ temp.permute(1, 0, 2).reshape(c_in, -1)
    mg = temp.reshape(c_in, n_f, c_out).permute(1, 0, 2).reshape(tf.shape).permute(3, 2, 0, 1)
    return p - alpha * mg, state


def inner_descent(p, keys, lrs, support, model, steps: int, second_order: bool,
                  update=sgd) -> dict:  # fmt: skip
    """``steps`` inner steps on ``keys``: ``update`` (Finn et al. 2017, Eq. 1 by default) on
    grad L_s(phi)."""
    state = dict.fromkeys(keys)
    for t in range(1, steps + 1):
        if second_order:
            g = torch.autograd.grad(ce(p, support, model), [p[k] for k in keys], create_graph=True)
        else:  # first order: the inner gradient is a constant of theta
            q = {k: p[k].detach().requires_grad_() for k in keys}
            g = torch.autograd.grad(ce({**p, **q}, support, model), list(q.values()))
        new = dict(p)
        for k, gk in zip(keys, g):
            new[k], state[k] = update(p[k], gk, state[k], lrs[k], t)
        p = new
    return p


def flat_of(params: dict, keys: list) -> torch.Tensor:
    return torch.cat([params[k].flatten() for k in keys])


def unflat(flat: torch.Tensor, like: dict, keys: list) -> dict:
    sizes = [like[k].numel() for k in keys]
    return {k: v.view_as(like[k]) for k, v in zip(keys, flat.split(sizes))}


def imaml_task(theta: dict, support, query, model, learner) -> tuple[dict, float]:
    """Rajeswaran et al. (2019): phi by ``inner_steps`` gradient steps on Eq. 4's proximal
    loss from theta, then Eq. 7 by a dense solve with the dense Hessian H of L_s at phi.

    The engine adds ``cg_damping d`` to ``I + H/lam`` (the run records d); the system here
    is the same ``(1 + d) I + H/lam``. Returns the task's meta-gradient and the bound on
    the 2-norm error of ``cg_steps`` CG iterations from 0, ``2 sqrt(k) r^m ||g||`` with
    ``r = (sqrt(k) - 1) / (sqrt(k) + 1)``, k the system's condition number, m the CG steps
    and g the solution: CG's classical bound ``2 r^m`` on the A-norm error relative to the
    start's, turned into the 2-norm by ``sqrt(k)``.
    """
    lam, lr, d = learner.lam, float(learner.inner_lr), learner.cg_damping
    keys = list(theta)
    anchor = {k: v.detach() for k, v in theta.items()}
    phi = dict(anchor)
    for _ in range(learner.inner_steps):  # Eq. 4 by gradient descent, no graph to theta
        q = {k: v.clone().requires_grad_() for k, v in phi.items()}
        prox = sum(((q[k] - anchor[k]) ** 2).sum() for k in keys)
        g = torch.autograd.grad(ce(q, support, model) + 0.5 * lam * prox, list(q.values()))
        phi = {k: (q[k] - lr * gk).detach() for k, gk in zip(keys, g)}
    x = flat_of(phi, keys).requires_grad_()
    g_query = torch.autograd.grad(ce(unflat(x, phi, keys), query, model), x)[0]
    hessian = torch.autograd.functional.hessian(
        lambda f: ce(unflat(f, phi, keys), support, model), x.detach()
    )
    system = (1 + d) * torch.eye(len(x), dtype=F64) + hessian / lam
    eig = torch.linalg.eigvalsh(system)
    assert eig[0] > 0, "(1 + d) I + H/lam is not positive definite: CG is undefined"
    root = float((eig[-1] / eig[0]).sqrt())
    grad = torch.linalg.solve(system, g_query)
    bound = 2 * root * ((root - 1) / (root + 1)) ** learner.cg_steps * float(grad.norm())
    return {f"model.{k}": v for k, v in unflat(grad, phi, keys).items()}, bound


def newton_logistic_head(f_s: torch.Tensor, y: torch.Tensor, ways: int, wd: float):
    """argmin_W (1/S) sum_i CE(W x_i, y_i) + wd/2 ||W||^2 by Newton's method on W [C, D]
    with a dense Hessian and backtracking (Armijo), run to the float64 gradient floor. f is
    wd-strongly convex, so W is within ||grad f(W)|| / wd of the minimiser."""
    x = f_s.detach()

    def objective(w):
        return F.cross_entropy(x @ w.view(ways, -1).T, y) + 0.5 * wd * (w**2).sum()

    w = torch.zeros(ways * x.shape[1], dtype=F64)
    for _ in range(100):
        g = torch.autograd.functional.jacobian(objective, w)
        if g.norm() < 1e-12:
            break
        step = torch.linalg.solve(torch.autograd.functional.hessian(objective, w), g)
        t, start = 1.0, float(objective(w))
        while float(objective(w - t * step)) > start - 1e-4 * t * float(g @ step) and t > 1e-8:
            t /= 2
        w = w - t * step
    assert torch.autograd.functional.jacobian(objective, w).norm() < 1e-9 * wd
    return w.view(ways, -1), objective


def metaoptnet_task(theta: dict, named: dict, support, query, model, wd: float):
    """Lee et al. (2019) with the logistic-regression head: W* solved here, then the IFT on
    grad_W f(W*, X_s) = 0 by a dense solve: dL/dtheta = dL/dtheta|_W* - v^T d2f/(dW dtheta)
    with v = (d2f/dW2)^{-1} dL/dW*. Returns a scalar whose gradient is that (its value is
    the query loss, the second term being 0 at the optimum)."""
    f_s = conv4(theta, support[0], model, body_only=True)
    f_q = conv4(theta, query[0], model, body_only=True)
    ways = int(support[1].max()) + 1
    w, objective = newton_logistic_head(f_s, support[1], ways, wd)
    w = w.detach().requires_grad_()
    loss = F.cross_entropy(named["log_scale"].exp() * f_q @ w.T, query[1])
    dl_dw = torch.autograd.grad(loss, w, retain_graph=True)[0].flatten()
    v = torch.linalg.solve(torch.autograd.functional.hessian(objective, w.detach().flatten()),
                           dl_dw)  # fmt: skip
    inner = F.cross_entropy(f_s @ w.T, support[1]) + 0.5 * wd * (w**2).sum()
    grad_w = torch.autograd.grad(inner, w, create_graph=True)[0].flatten()
    return loss - grad_w @ v


def mamlpp_task(theta: dict, named: dict, support, query, model, steps: int) -> torch.Tensor:
    """Antoniou et al. (2019): MSL, ``sum_s w_s L_q(phi_{s+1})`` with the step-0 weights
    ``1/S`` each; step s's support pass and the query after it use step s's batch-norm
    copies (BNWB), held out of the inner loop; step s moves each other weight by its own
    rate for step s (LSLR); exact second order (the reference's final configs)."""
    bn = {k: named[f"bn.{k.replace('.', '__')}"] for k in theta if ".norm." in k}
    keys = [k for k in theta if k not in bn]
    p, loss = {k: theta[k] * 1.0 for k in keys}, 0.0
    for s in range(steps):
        at = {k: v[s] for k, v in bn.items()}
        g = torch.autograd.grad(ce({**p, **at}, support, model), [p[k] for k in keys],
                                create_graph=True)  # fmt: skip
        p = {k: p[k] - named[f"lrs.{k.replace('.', '__')}"][s] * gk for k, gk in zip(keys, g)}
        loss = loss + ce({**p, **at}, query, model) / steps
    return loss


def norm_free(keys: list, learner) -> list:
    """``keys`` less the batch-norm weights unless the learner adapts them (adapt_norm)."""
    return keys if learner.adapt_norm else [k for k in keys if ".norm." not in k]


def inner_update(learner, arguments: dict):
    """The run's inner update, written out here, from the arguments it records."""
    name = arguments.get("inner_optimizer", "sgd")
    if name == "sgd":
        return sgd
    if name == "momentum":
        return momentum(arguments["inner_momentum"])
    if name == "adam":
        return adam(arguments["inner_beta1"], arguments["inner_beta2"], arguments["inner_eps"])
    raise AssertionError(f"no reference for inner optimizer {name!r}")


def rrnet_logits(f_s, f_q, labels, ways: int, learner, named: dict) -> torch.Tensor:
    """Bertinetto et al. (2019) Eq. 3 as the reference's ``RRNet`` (``bertinetto/r2d2``,
    ``fewshots/models/r2d2.py``) computes it: ``X = [Z_s, 1] / sqrt(S)``, ``Y = onehot /
    sqrt(S)``, ``[W; b] = X'(XX' + lam I)^-1 Y`` with lam fixed (a buffer, 50 by default),
    query scores ``scale (Z_q W + b) + bias`` with ``scale``, ``bias`` learned as they are.
    Written with an explicit inverse (the engine solves)."""
    assert learner.ridge_form == "rrnet" and "lam" not in named  # the default: lam fixed
    root = math.sqrt(len(f_s))
    x = torch.cat([f_s, torch.ones(len(f_s), 1, dtype=F64)], 1) / root
    y = F.one_hot(labels, ways).to(F64) / root
    lam = float(learner.lam)
    wb = x.T @ torch.linalg.inv(x @ x.T + lam * torch.eye(len(x), dtype=F64)) @ y
    return named["scale"] * (f_q @ wb[:-1] + wb[-1]) + named["bias"]


def reptile_premises(learner) -> tuple:
    """What `reptile_task` writes out, checked on the learner (its defaults): TF's Adam at
    beta1 0 on every parameter on the summed loss, its state carried across tasks from zero,
    mini-batches of the support set alone. Returns the starting slots ``(0, zeros, zeros)``,
    float64."""
    assert learner.inner_optimizer == "adam" and learner.inner_state == "carried"
    assert learner.inner_loss == "sum"
    assert learner.adam[0] == 0.0 and learner.inner_batch is not None
    assert learner.adapt_keys is None and not learner.train_on_query
    t, m, v = learner.adam_slots.read()
    assert t == 0 and all(float(w.abs().max()) == 0 for w in (*m.values(), *v.values()))
    zeros = {k: torch.zeros_like(w, dtype=F64) for k, w in m.items()}
    return 0, zeros, dict(zeros)


def reference_gradient(algorithm: str, learner, tasks, arguments: dict, draws=None):
    """The step's meta-gradient, name (as ``learner.named_parameters``) -> float64 tensor;
    the 2-norm error the run's own settings allow beyond rounding (iMAML's CG bound, the
    mean of the tasks'; 0 for the others); and Reptile's inner Adam state after the
    meta-batch (None for the others). ``draws``: the generator Reptile's mini-batch
    shuffles come from, in the run the global one, seeded alike."""
    model = learner.model
    named = {k: v.detach().to(F64).requires_grad_() for k, v in learner.named_parameters()}
    theta = {k.removeprefix("model."): v for k, v in named.items() if k.startswith("model.")}
    steps, alpha = learner.inner_steps, float(learner.inner_lr)
    heads = ("head.weight", "head.bias")
    total, bound = 0.0, 0.0
    slots = reptile_premises(learner) if algorithm == "reptile" else None
    for task in tasks:
        support, query = as64(task)
        if algorithm in ("reptile", "imaml"):
            if algorithm == "reptile":  # Nichol et al. (2018) Alg. 2: the direction theta - phi
                phi, slots = reptile_task(theta, support, model, learner, draws, slots)
                direction = {f"model.{k}": (theta[k] - phi[k]).detach() for k in theta}
            else:
                direction, task_bound = imaml_task(theta, support, query, model, learner)
                bound += task_bound / len(tasks)
            direction = {k: v / len(tasks) for k, v in direction.items()}
            total = direction if isinstance(total, float) else \
                {k: total[k] + direction[k] for k in total}  # fmt: skip
            continue
        if algorithm == "metaoptnet-lr":
            loss = metaoptnet_task(theta, named, support, query, model, learner.weight_decay)
            total = total + loss / len(tasks)
            continue
        if algorithm == "metaoptnet":  # Lee et al. (2019): MetaOptNetHead_SVM_CS
            f_s = conv4(theta, support[0], model, body_only=True)
            f_q = conv4(theta, query[0], model, body_only=True)
            loss = svm_query_loss(f_s, f_q, support[1], query[1], c_reg=learner.c_reg,
                                  ridge=learner.ridge, scale=named["scale"],
                                  smoothing=learner.label_smoothing)  # fmt: skip
            total = total + loss / len(tasks)
            continue
        if algorithm in ("protonet", "r2d2"):
            f_s = conv4(theta, support[0], model, body_only=True)
            f_q = conv4(theta, query[0], model, body_only=True)
            ways = int(support[1].max()) + 1
            if algorithm == "protonet":  # Snell et al. (2017) Eq. 1-2
                c = torch.stack([f_s[support[1] == k].mean(0) for k in range(ways)])
                logits = -((f_q[:, None, :] - c[None]) ** 2).sum(-1)
            else:  # Bertinetto et al. (2019) Eq. 3, W = X'(XX' + lam I)^-1 Y, as RRNet
                logits = rrnet_logits(f_s, f_q, support[1], ways, learner, named)
            total = total + F.cross_entropy(logits, query[1]) / len(tasks)
            continue
        # The inner loop's variables are copies of theta, so each inner gradient is the
        # partial one (Proto-MAML's head depends on theta's body: a total derivative is wrong).
        start = {k: v * 1.0 for k, v in theta.items()}
        keys, lrs = list(theta), dict.fromkeys(theta, alpha)
        second = not learner.first_order
        if algorithm == "anil":
            keys = list(heads)
        if algorithm == "boil":  # Oh et al. (2021): the body adapts, the head stays theta's
            keys = [k for k in theta if k not in heads]
        if algorithm in ("maml", "fomaml", "metasgd", "protomaml", "boil", "metacurvature"):
            keys = norm_free(keys, learner)  # batch norm held at theta's unless adapt_norm
        if algorithm == "protomaml":  # Triantafillou et al. (2020) Sec. 4
            start.update(prototypes(theta, support, model, learner.model.head.out_features))
        if algorithm == "metasgd":  # Li et al. (2017) Eq. 3: alpha elementwise, learned
            lrs = {k: named[f"lrs.{k.replace('.', '__')}"] for k in keys}
        if algorithm == "mamlpp":
            assert learner.second_order and learner.msl_steps > 0  # the row's premise
            total = total + mamlpp_task(theta, named, support, query, model, steps) / len(tasks)
            continue
        if algorithm == "lora":  # Hu et al. (2021) Eq. 3 adapters and the full head adapt
            keys = [k for k in theta if "lora_" in k or k.startswith("head.")]
        update = inner_update(learner, arguments)
        if algorithm == "metacurvature":  # Park & Oliva (2019) Eq. 5: the factors, learned
            prefix = {k: f"curvature.{k.replace('.', '__')}/" for k in keys}
            factors = {k: [v for n, v in named.items() if n.startswith(prefix[k])] for k in keys}
            lrs, update = {k: (alpha, factors[k]) for k in keys}, curvature_step
        phi = inner_descent(start, keys, lrs, support, model, steps, second, update)
        if learner.evaluation_norm == "support":  # Proto-MAML: the support set's moments
            logits = conv4(phi, query[0], model, support_x=support[0])
            total = total + F.cross_entropy(logits, query[1]) / len(tasks)
        else:
            total = total + ce(phi, query, model) / len(tasks)
    if isinstance(total, dict):
        return total, bound, slots
    return grad_of(total, named), bound, slots


def dense_support_top(algorithm: str, learner, task) -> float:
    """Top eigenvalue of the dense Hessian of L_s where the inner loop starts (float64)."""
    model = learner.model
    theta = {k: v.detach().to(F64) for k, v in model.named_parameters()}
    support = (task.support[0].to(F64), task.support[1])
    start, keys = dict(theta), list(theta)
    if algorithm == "anil":
        keys = ["head.weight", "head.bias"]
    if algorithm == "boil":
        keys = [k for k in theta if not k.startswith("head.")]
    if algorithm in ("maml", "fomaml", "metasgd", "protomaml", "boil", "metacurvature"):
        keys = norm_free(keys, learner)
    if algorithm == "protomaml":
        start.update(prototypes(theta, support, model, model.head.out_features))
    if algorithm == "mamlpp":
        bn = {
            k: learner.bn[k.replace(".", "__")][0].detach().to(F64) for k in theta if ".norm." in k
        }
        start.update(bn)
        keys = [k for k in theta if k not in bn]
    if algorithm == "lora":
        keys = [k for k in theta if "lora_" in k or k.startswith("head.")]
    sizes = [start[k].numel() for k in keys]

    def loss(flat):
        parts = {k: v.view_as(start[k]) for k, v in zip(keys, flat.split(sizes))}
        return ce({**start, **parts}, support, model)

    flat = torch.cat([start[k].flatten() for k in keys])
    return float(torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))[-1])


class Float64Tasks:
    """A sampler whose tasks carry float64 inputs: Reptile's (b) runs the experiment's
    `meta_step` on a float64 learner. In float32 its default inner Adam cannot be compared:
    Adam divides each gradient by its running root mean square, and at hidden=1 some support
    gradients are at float32's rounding level (a conv bias feeding batch norm has a true
    gradient of exactly 0, a batch-norm weight's is ~1e-6), so their steps are rounding
    noise scaled to about lr (measured: ``features.0.conv.bias``'s direction 2.7e-3 in
    float32 against 8e-13 in float64, ``features.0.norm.weight`` 2.5% off)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def draw(self, gen: torch.Generator, count: int):
        return self.sampler.draw(gen, count)

    def tasks_from_indices(self, *indices) -> list:
        return [replace(task, support=(task.support[0].to(F64), task.support[1]),
                        query=(task.query[0].to(F64), task.query[1]))
                for task in self.sampler.tasks_from_indices(*indices)]  # fmt: skip


def check_slots(learner, slots: tuple) -> None:
    """The (float64) learner's carried inner Adam state equals the reference's
    ``(t, m, v)``, to float64 rounding relative to each moment's largest entry."""
    t, m, v = learner.adam_slots.read()
    assert t == slots[0]
    for got, want in ((m, slots[1]), (v, slots[2])):
        top = max(float(w.abs().max()) for w in want.values())
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12 * top,
                                       msg=lambda msg, k=k: f"{k}: {msg}")  # fmt: skip


def deployed_beside_support(learner, recipe) -> None:
    """(d) for a learner scoring each query as the last row of a batch of the support set
    and that query (Reptile's default, the reference's ``_test_predictions``): the deployed
    network in that reading (`adapted_model`'s default for it, ``norm="beside_support"``)
    gives the logits of a loop written out here (one transductive forward of the support
    set plus each query) and `evaluate`'s query loss and accuracy on two test tasks."""
    steps = recipe.training.eval_inner_steps
    tasks = load_samplers(recipe, "cpu")["test"].batch(2, torch.Generator().manual_seed(5))
    losses, accs = learner.evaluate(tasks, steps=steps)
    for task, loss, acc in zip(tasks, losses, accs):
        (xs, ys), (xq, yq) = task.support, task.query
        params = adapt_to_support(learner, xs, ys, steps=steps)
        net = adapted_model(learner, params, support_x=xs)
        batch = adapted_model(learner, params, norm="transductive")
        with torch.no_grad():
            logits = net(xq)
            loop = torch.stack([batch(torch.cat([xs, q[None]]))[-1] for q in xq])
        torch.testing.assert_close(logits, loop, rtol=1e-5, atol=1e-5)
        assert float(F.cross_entropy(logits, yq)) == pytest.approx(float(loss), rel=1e-5)
        assert float((logits.argmax(1) == yq).double().mean()) == pytest.approx(float(acc))


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("cell", list(CELLS))
def test_seam(cell, experiment, folder, tmp_path, capsys):
    algorithm = CELLS[cell][0]
    curvature = measures_curvature(algorithm)
    exp, args = arguments(experiment, cell, folder, tmp_path,
                          curvature_every=1 if curvature else 0, curvature_tasks=2)  # fmt: skip
    recipe = recipe_of(exp, args)

    # (b) step 1's meta-gradient, through the loop's meta_step on the loop's task draw.
    checked = recipe
    if algorithm == "metaoptnet-lr":
        # The float32 default accepts the head at ||grad_W f|| <= 1e-4 (its Newton solver
        # stops at 1e-5), which leaves the meta-gradient ~4e-5 of its largest entry off
        # (measured); (b) checks the maths with the learner argument tol = 1e-6, edited into
        # the recipe (its solver then stops at 1e-7, float32's floor).
        arguments_b = {**recipe.learner.arguments, "tol": 1e-6}
        checked = replace(recipe, learner=replace(recipe.learner, arguments=arguments_b))
    learner = seeded_learner(checked)
    samplers = load_samplers(checked, "cpu")
    if algorithm == "reptile":  # in float64 (`Float64Tasks`), compared to float64 rounding
        learner, samplers = learner.double(), {"train": Float64Tasks(samplers["train"])}
    t = checked.training
    tasks = my_tasks(samplers["train"], t.meta_batch, torch.Generator().manual_seed(t.seed))
    # Reptile's mini-batches are shuffled on torch's global stream: the reference shuffles on
    # a generator seeded as the global one is before the step.
    expected, bound, slots = reference_gradient(algorithm, learner, tasks,
                                                checked.learner.arguments,
                                                torch.Generator().manual_seed(DRAWS))  # fmt: skip
    opt = torch.optim.SGD(learner.parameters(), lr=0.0)  # .grad is what is checked
    torch.manual_seed(DRAWS)
    exp.meta_step(checked, learner, opt, samplers["train"],
                  torch.Generator().manual_seed(t.seed), step=0)  # fmt: skip
    # float32 run against float64: entries whose true value is 0 (a conv bias before batch
    # norm) come out at rounding level, so atol is relative to the largest entry. iMAML's
    # CG stops at the run's cg_steps: its error bound (`imaml_task`) widens atol.
    scale = max(float(g.abs().max()) for g in expected.values())
    assert bound < 1e-4 * scale, f"CG's error bound {bound:.2e} is too loose to test against"
    # A scalar output bias (R2-D2's) shifts every logit alike: its true gradient
    # is 0, a sum of C softmax terms (p_c - y_c) of size ~1, so float32 leaves ~C eps_32
    # per query (measured: R2-D2's 3.7e-8 against entries of 3.3e-3, 1.1e-5 of the largest).
    ways = int(tasks[0].support[1].max()) + 1
    floor = {"bias": ways * torch.finfo(torch.float32).eps}
    for name, p in learner.named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(
            got.to(F64), expected[name], rtol=RTOL.get(cell, 1e-4),
            atol=ATOL.get(cell, 1e-5) * scale + bound + floor.get(name, 0.0),
            msg=lambda m, name=name: f"{name}: {m}",
        )  # fmt: skip

    if slots is not None:  # Reptile: the Adam state carried out of the meta-batch
        check_slots(learner, slots)

    exp.main(args)
    path = tmp_path / "r" / "checkpoint.pt"
    saved = load_checkpoint(path)

    # (a) the record rebuilds the learner.
    assert saved["recipe"] == recipe.to_dict()
    rebuilt, _ = load_learner(path, which="last")
    fresh = seeded_learner(recipe)
    assert type(rebuilt) is type(fresh) is LEARNERS[algorithm]
    for argument in recipe.learner.arguments:  # kept as attributes; parameters: below
        value = getattr(fresh, argument, None)
        if value is not None and not isinstance(value, torch.Tensor):
            assert getattr(rebuilt, argument) == value, argument
    state = rebuilt.state_dict()
    assert list(state) == list(fresh.state_dict()) == list(saved["learner"])
    for k, v in saved["learner"].items():
        assert torch.equal(state[k], v), k

    # (c) curvature where the inner loop starts.
    if curvature:
        row = next(r for r in saved["history"] if "curv/support_top_eig" in r)
        probe = load_samplers(recipe, "cpu")["train"].batch(
            recipe.training.curvature_tasks, torch.Generator().manual_seed(PROBE_SEED)
        )
        tops = [dense_support_top(algorithm, rebuilt, task) for task in probe]
        # Lanczos at the loop's budget (20 HVPs, tol 1e-3) on float32 weights.
        assert row["curv/support_top_eig"] == pytest.approx(sum(tops) / len(tops), rel=2e-3)
        assert math.isfinite(row["curv/meta_top_eig"])

    # (d) deploy equals evaluate on the same tasks: transfer_check compares the deployed
    # model in the reading the learner evaluates with (all at once, or each query beside the
    # support set: Reptile's default) with `evaluate`; the latter also against a loop.
    if rebuilt.evaluation_norm == "beside_support":
        deployed_beside_support(rebuilt, recipe)
    capsys.readouterr()
    code = transfer_check.cli(["--checkpoint", str(path), "--tasks", "2", "--seed", "5"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == "deploy_matches_evaluate: true"
    assert code == 0


# --------------------------------------------------------------------------- the outer loop

# Outer-loop settings (`metalearn.runs.outer_loop`), each run end to end on MAML: the
# references' optimizers and schedules (MetaOptNet's SGD with Nesterov momentum and weight
# decay; MAML++'s cosine to a minimum, stepped per epoch, and its meta-gradient clamp
# against torch's clip_grad_value_; ProtoNet's StepLR).
OUTER_CELLS: dict[str, dict] = {
    "sgd-nesterov+cosine": dict(outer_optimizer="sgd", outer_momentum=0.9, nesterov=True,
                                weight_decay=5e-4, outer_lr=0.1, lr_schedule="cosine",
                                eta_min=1e-3, schedule_every=2),
    "adam+step": dict(weight_decay=1e-3, lr_schedule="step", step_size=1, gamma=0.5,
                      schedule_every=2),
    # MAML++'s meta-gradient clamp (its mini-ImageNet meta_update), bounding most entries
    "sgd+grad-clamp": dict(outer_optimizer="sgd", outer_lr=0.1, lr_schedule="cosine",
                           eta_min=1e-3, schedule_every=2, grad_clamp=1e-3),
}  # fmt: skip


def torch_outer(learner, t) -> tuple[torch.optim.Optimizer, object]:
    """torch's own optimizer and scheduler for the recipe's outer settings."""
    if t.outer_optimizer == "sgd":
        opt = torch.optim.SGD(learner.parameters(), lr=t.outer_lr, momentum=t.outer_momentum,
                              nesterov=t.nesterov, weight_decay=t.weight_decay)  # fmt: skip
    else:
        opt = torch.optim.Adam(learner.parameters(), lr=t.outer_lr, weight_decay=t.weight_decay)
    epochs = t.iterations // t.schedule_every
    if t.lr_schedule == "cosine":
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs, eta_min=t.eta_min)
    return opt, torch.optim.lr_scheduler.StepLR(opt, t.step_size, gamma=t.gamma)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("cell", list(OUTER_CELLS))
def test_seam_outer(cell, experiment, folder, tmp_path):
    """The run's recorded step sizes are torch's scheduler's, and its weights are those of a
    loop written with torch's optimizer and scheduler objects on the same task draws."""
    outer = {**OUTER_CELLS[cell], "iterations": 4, "val_every": 4}  # best = last weights
    exp, args = arguments(experiment, "maml", folder, tmp_path, **outer)
    recipe = recipe_of(exp, args)
    t = recipe.training
    for name, value in outer.items():
        assert getattr(t, name) == value, name

    learner = seeded_learner(recipe)
    sampler = load_samplers(recipe, "cpu")["train"]
    gen = torch.Generator().manual_seed(t.seed)
    opt, sched = torch_outer(learner, t)
    lrs, clamped = [], 0
    for step in range(t.iterations):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        learner.backward(my_tasks(sampler, t.meta_batch, gen))
        if t.grad_clamp is not None:  # the network's weights (MAML: the model's)
            clamped += sum(int((p.grad.abs() > t.grad_clamp).sum()) for p in learner.parameters())
            torch.nn.utils.clip_grad_value_(learner.model.parameters(), t.grad_clamp)
        opt.step()
        if (step + 1) % t.schedule_every == 0:
            sched.step()

    exp.main(args)
    saved = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert saved["recipe"] == recipe.to_dict() and saved["args"]["lr_schedule"] == t.lr_schedule
    recorded = [row["train/outer_lr"] for row in saved["history"] if "train/outer_lr" in row]
    assert recorded == pytest.approx(lrs, rel=1e-12)
    assert len(set(recorded)) > 1
    assert clamped > 0 or t.grad_clamp is None  # the clamp bound something
    # torch's cosine is a recurrence, metalearn's the closed form: lrs equal to float64
    # rounding, so the weights to float32's.
    for name, p in learner.named_parameters():
        torch.testing.assert_close(saved["learner"][name], p.detach(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


# --------------------------------------------------------------------------- the test's ensemble


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_seam_ensemble(experiment, folder, tmp_path):
    """``--ensemble-top-k 2`` from the command line's arguments to the recorded test
    accuracy: the record keeps the 2 best validations, and the run's test accuracy is the
    one of the 2 models' query logits, each written out here (MAML's inner steps by
    autograd on the hand-written Conv4, float64), averaged and argmaxed as MAML++'s
    reference (experiment_builder.py, evaluated_test_set_using_the_best_models). On
    Omniglot the two models' ensemble and the best alone score these tasks differently (a
    test of the best alone fails this cell); on the tiny folder they agree."""
    exp, args = arguments(experiment, "maml", folder, tmp_path, iterations=3, ensemble_top_k=2,
                          eval_inner_steps=2, test_tasks=3)  # fmt: skip
    results = exp.main(args)
    saved = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    recipe = recipe_of(exp, args)
    assert saved["recipe"] == recipe.to_dict() and recipe.training.ensemble_top_k == 2
    vals = [(row["step"], row["val/acc"]) for row in saved["history"] if "val/acc" in row]
    kept = sorted(vals, key=lambda v: (-v[1], v[0]))[:2]
    assert [(e["iteration"], e["val"]) for e in saved["top"]] == kept

    learner = seeded_learner(recipe)
    t = recipe.training
    tasks = run_test_tasks(recipe)
    per_model = []
    for entry in saved["top"]:
        theta = {k.removeprefix("model."): v.to(F64) for k, v in entry["learner"].items()
                 if k.startswith("model.")}  # fmt: skip
        keys = norm_free(list(theta), learner)  # MAML: batch norm held at theta's
        logits = []
        for task in tasks:
            support, query = as64(task)
            p = {k: v.clone().requires_grad_(k in keys) for k, v in theta.items()}
            fast = inner_descent(p, keys, dict.fromkeys(keys, float(learner.inner_lr)),
                                 support, learner.model, t.eval_inner_steps, False)  # fmt: skip
            logits.append(conv4(fast, query[0], learner.model).detach().numpy())
        per_model.append(logits)
    accuracy = ensemble_task_accuracies(per_model, tasks).mean()
    assert results["test/acc"] == pytest.approx(accuracy, abs=1e-7)
