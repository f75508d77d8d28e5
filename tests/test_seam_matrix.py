"""The seam matrix: every registered algorithm x both experiments, a tiny run through the
experiment's own code, checked where the parts join.

For each cell:

(a) the run's record rebuilds the learner: the checkpoint's recipe is the one the arguments
    resolve to, and `metalearn.deploy.load_learner` builds from it a learner of the same
    class, arguments and parameter names and shapes, holding the checkpoint's weights;
(b) the meta-gradient of step 1, filled by the loop's own `metalearn.runs.loop.meta_step`
    on the loop's own task draw, equals a float64 reference written out here from the
    paper's update (a Conv4 forward written with ``F.conv2d``, unrolled autograd, the
    closed-form heads), not from the engine's functions;
(c) ``--curvature-every 1``'s ``curv/support_top_eig`` equals the mean top eigenvalue of
    dense float64 Hessians of the hand-written support loss where the algorithm's inner
    loop starts (Proto-MAML's prototype head, MAML++'s step-0 batch-norm copies, LoRA's
    adapters and head), on the loop's probe tasks, at the checkpoint's theta;
(d) the run's checkpoint through deploy (``scripts/transfer_check.py``: adapt, build the
    deployed network, predict) gives what `evaluate` gives on the same tasks.

A new algorithm in `metalearn.algorithms.registry.LEARNERS` without a row here fails
`test_every_registered_algorithm_has_a_row`.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from image_set_fixtures import write_folder
from run_helpers import fs, make, om, recipe_of

from metalearn.algorithms import HeadLearner, MetaLossLearner
from metalearn.algorithms.curvature import PROBE_SEED
from metalearn.algorithms.registry import LEARNERS
from metalearn.checkpoint import load_checkpoint
from metalearn.deploy import load_learner
from metalearn.runs import loop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import transfer_check  # noqa: E402

F64 = torch.float64
OMNIGLOT = Path(os.environ.get("METALEARN_DATA", ROOT.parent / "shared" / "data" / "omniglot"))
pytestmark = pytest.mark.filterwarnings("ignore:.*published:UserWarning")

TINY = dict(
    iterations=1, meta_batch=2, query=1, eval_query=1, hidden=1, val_every=1, val_tasks=2,
    test_tasks=2, eval_inner_steps=1, track=False, device="cpu", vectorize="loop",
)  # fmt: skip
# Per algorithm: what its tiny run sets beyond TINY.
ROWS: dict[str, dict] = {
    "maml": {"inner_steps": 2}, "fomaml": {"inner_steps": 2}, "anil": {"inner_steps": 2},
    "metasgd": {"inner_steps": 1}, "mamlpp": {"inner_steps": 1}, "imaml": {"inner_steps": 2},
    "reptile": {"inner_steps": 2}, "protomaml": {"inner_steps": 1}, "lora": {"inner_steps": 1},
    "protonet": {}, "r2d2": {}, "metaoptnet": {},
}  # fmt: skip
# Meta-gradient references not written yet (their cells check (a), (c) and (d) only).
NO_GRADIENT_REFERENCE = {"imaml", "lora", "metaoptnet"}
EXPERIMENTS = ("omniglot", "folder")


def test_every_registered_algorithm_has_a_row():
    assert set(ROWS) == set(LEARNERS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("seam") / "folder")


def arguments(experiment: str, algorithm: str, folder: Path, out: Path, **extra):
    """The experiment module and its tiny run's `Args`."""
    flat = {**TINY, **ROWS[algorithm], "algorithm": algorithm, "out_dir": str(out),
            "run_name": "r", **extra}  # fmt: skip
    if LEARNERS[algorithm].head_sized_per_task or algorithm in ("imaml", "reptile"):
        flat.pop("vectorize")  # loop-only or no inner loop: the default
    if algorithm in ("protonet", "r2d2", "metaoptnet"):
        flat.pop("inner_steps", None)
    if experiment == "omniglot":
        if not (OMNIGLOT / "images_background").is_dir():
            pytest.skip("full Omniglot not found: set METALEARN_DATA")
        return om, make(om, **flat, data_root=str(OMNIGLOT))
    return fs, make(fs, **flat, dataset="folder", data_root=str(folder), image_size=16,
                    channels=1, ways=3)  # fmt: skip


def measures_curvature(algorithm: str) -> bool:
    cls = LEARNERS[algorithm]
    return issubclass(cls, MetaLossLearner) and not issubclass(cls, HeadLearner)


# --------------------------------------------------------------------------- by hand


def conv4(p: dict, x: torch.Tensor, model, *, body_only: bool = False) -> torch.Tensor:
    """`metalearn.models.Conv4` written out: per block conv (plus LoRA's ``s B A``), batch
    norm over (N, H, W) with eps 1e-5, ReLU, pooling; then the head on the pooled features."""
    h = x
    for i, block in enumerate(model.features):
        pre = f"features.{i}.conv"
        w = p[f"{pre}.weight"]
        if f"{pre}.lora_A" in p:
            w = w + block.conv.scaling * (p[f"{pre}.lora_B"] @ p[f"{pre}.lora_A"]).reshape(w.shape)
        h = F.conv2d(h, w, p[f"{pre}.bias"], stride=block.conv.stride, padding=1)
        mean = h.mean((0, 2, 3), keepdim=True)
        var = ((h - mean) ** 2).mean((0, 2, 3), keepdim=True)
        gamma, beta = p[f"features.{i}.norm.weight"], p[f"features.{i}.norm.bias"]
        h = (h - mean) / torch.sqrt(var + 1e-5) * gamma[:, None, None] + beta[:, None, None]
        h = torch.relu(h)
        if isinstance(block.pool, torch.nn.MaxPool2d):
            h = F.max_pool2d(h, 2)
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


def inner_descent(p, keys, lrs, support, model, steps: int, second_order: bool) -> dict:
    """Finn et al. (2017) Eq. 1, ``steps`` times: phi <- phi - lr * grad L_s(phi) on ``keys``."""
    for _ in range(steps):
        if second_order:
            g = torch.autograd.grad(ce(p, support, model), [p[k] for k in keys], create_graph=True)
        else:  # first order: the inner gradient is a constant of theta
            q = {k: p[k].detach().requires_grad_() for k in keys}
            g = torch.autograd.grad(ce({**p, **q}, support, model), list(q.values()))
        p = {**p, **{k: p[k] - lrs[k] * gk for k, gk in zip(keys, g)}}
    return p


def reference_gradient(algorithm: str, learner, tasks) -> dict[str, torch.Tensor]:
    """The step's meta-gradient, name (as ``learner.named_parameters``) -> float64 tensor."""
    model = learner.model
    named = {k: v.detach().to(F64).requires_grad_() for k, v in learner.named_parameters()}
    theta = {k.removeprefix("model."): v for k, v in named.items() if k.startswith("model.")}
    steps, alpha = learner.inner_steps, float(learner.inner_lr)
    heads = ("head.weight", "head.bias")
    total = 0.0
    for task in tasks:
        support, query = as64(task)
        if algorithm == "reptile":  # Nichol et al. (2018) Alg. 2: the direction theta - phi
            phi = inner_descent(dict(theta), list(theta), dict.fromkeys(theta, alpha), support,
                                model, steps, False)  # fmt: skip
            direction = {f"model.{k}": (theta[k] - phi[k]).detach() / len(tasks) for k in theta}
            total = direction if isinstance(total, float) else \
                {k: total[k] + direction[k] for k in total}  # fmt: skip
            continue
        if algorithm in ("protonet", "r2d2"):
            f_s = conv4(theta, support[0], model, body_only=True)
            f_q = conv4(theta, query[0], model, body_only=True)
            ways = int(support[1].max()) + 1
            if algorithm == "protonet":  # Snell et al. (2017) Eq. 1-2
                c = torch.stack([f_s[support[1] == k].mean(0) for k in range(ways)])
                logits = -((f_q[:, None, :] - c[None]) ** 2).sum(-1)
            else:  # Bertinetto et al. (2019) Eq. 3: W = X'(XX' + lam I)^-1 Y
                lam, scale = named["log_lam"].exp(), named["log_scale"].exp()
                onehot = F.one_hot(support[1], ways).to(F64)
                w = (
                    f_s.T
                    @ torch.linalg.inv(f_s @ f_s.T + lam * torch.eye(len(f_s), dtype=F64))
                    @ onehot
                )
                logits = scale * f_q @ w + named["bias"]
            total = total + F.cross_entropy(logits, query[1]) / len(tasks)
            continue
        # The inner loop's variables are copies of theta, so each inner gradient is the
        # partial one (Proto-MAML's head depends on theta's body: a total derivative is wrong).
        start = {k: v * 1.0 for k, v in theta.items()}
        keys, lrs, fixed = list(theta), dict.fromkeys(theta, alpha), {}
        second = not learner.first_order
        if algorithm == "anil":
            keys = list(heads)
        if algorithm == "protomaml":  # Triantafillou et al. (2020) Sec. 4
            start.update(prototypes(theta, support, model, learner.model.head.out_features))
        if algorithm == "metasgd":  # Li et al. (2017) Eq. 3: alpha elementwise, learned
            lrs = {k: named[f"lrs.{k.replace('.', '__')}"] for k in keys}
        if algorithm == "mamlpp":  # Antoniou et al. (2019): LSLR rates, BNWB copies, DA
            fixed = {k: named[f"bn.{k.replace('.', '__')}"][0] for k in theta if ".norm." in k}
            keys = [k for k in theta if k not in fixed]
            lrs = {k: named[f"lrs.{k.replace('.', '__')}"][0] for k in keys}
            start.update(fixed)
            second = learner.second_order
        phi = inner_descent(start, keys, lrs, support, model, steps, second)
        total = total + ce(phi, query, model) / len(tasks)
    if isinstance(total, dict):
        return total
    return grad_of(total, named)


def dense_support_top(algorithm: str, learner, task) -> float:
    """Top eigenvalue of the dense Hessian of L_s where the inner loop starts (float64)."""
    model = learner.model
    theta = {k: v.detach().to(F64) for k, v in model.named_parameters()}
    support = (task.support[0].to(F64), task.support[1])
    start, keys = dict(theta), list(theta)
    if algorithm == "anil":
        keys = ["head.weight", "head.bias"]
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


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("algorithm", list(ROWS))
def test_seam(algorithm, experiment, folder, tmp_path, capsys):
    curvature = measures_curvature(algorithm)
    exp, args = arguments(experiment, algorithm, folder, tmp_path,
                          curvature_every=1 if curvature else 0, curvature_tasks=2)  # fmt: skip
    recipe = recipe_of(exp, args)

    # (b) step 1's meta-gradient, through the loop's meta_step on the loop's task draw.
    if algorithm not in NO_GRADIENT_REFERENCE:
        learner = loop.make_learner(recipe, "cpu")
        samplers = loop.make_samplers(recipe, "cpu")
        t = recipe.training
        tasks = loop._my_tasks(samplers["train"], t.meta_batch,
                               torch.Generator().manual_seed(t.seed))  # fmt: skip
        expected = reference_gradient(algorithm, learner, tasks)
        opt = torch.optim.SGD(learner.parameters(), lr=0.0)  # .grad is what is checked
        loop.meta_step(recipe, learner, opt, samplers["train"],
                       torch.Generator().manual_seed(t.seed), step=0)  # fmt: skip
        # float32 run against float64: entries whose true value is 0 (a conv bias before
        # batch norm) come out at rounding level, so atol is relative to the largest entry.
        scale = max(float(g.abs().max()) for g in expected.values())
        for name, p in learner.named_parameters():
            got = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(
                got.to(F64), expected[name], rtol=1e-4, atol=1e-5 * scale,
                msg=lambda m, name=name: f"{name}: {m}",
            )  # fmt: skip

    exp.main(args)
    path = tmp_path / "r" / "checkpoint.pt"
    saved = load_checkpoint(path)

    # (a) the record rebuilds the learner.
    assert saved["recipe"] == recipe.to_dict()
    rebuilt, _ = load_learner(path, which="last")
    fresh = loop.make_learner(recipe, "cpu")
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
        probe = loop.make_samplers(recipe, "cpu")["train"].batch(
            recipe.training.curvature_tasks, torch.Generator().manual_seed(PROBE_SEED)
        )
        tops = [dense_support_top(algorithm, rebuilt, task) for task in probe]
        # Lanczos at the loop's budget (20 HVPs, tol 1e-3) on float32 weights.
        assert row["curv/support_top_eig"] == pytest.approx(sum(tops) / len(tops), rel=2e-3)
        assert math.isfinite(row["curv/meta_top_eig"])

    # (d) deploy equals evaluate on the same tasks.
    capsys.readouterr()
    code = transfer_check.cli(["--checkpoint", str(path), "--tasks", "2", "--seed", "5"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == "deploy_matches_evaluate: true"
    assert code == 0
