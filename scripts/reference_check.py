"""One meta-step of metalearn beside the authors' own PyTorch code, in float64.

What: the reference is a checkout the user fetched (the git URL and commit of each are in
docs/algorithms.md, "Equality with the authors' code"); its modules are imported from
``--reference`` at run time, by file path, and run as their authors wrote them. Both sides
start from the same float64 weights and see the same task tensors; the script prints, per
case, the relative difference ``||a - b|| / ||b||`` (``b`` the reference's) of every compared
tensor: the meta-gradient of each parameter for the MAML family, the logits (as
log-probabilities where a head's logits differ by a per-query constant the softmax ignores)
and the gradient of the query loss w.r.t. the support and query embeddings for the solved
heads. The last line is ``max_relative_difference: X``; the exit status is 1 when X is above
``--tolerance``.

Algorithms and references:

* ``mamlpp``, ``maml``: ``AntreasAntoniou/HowToTrainYourMAMLPytorch``
  (``few_shot_learning_system.MAMLFewShotClassifier``, its ``VGGReLUNormNetwork``, settings
  from its Omniglot 5-way 1-shot configuration files). metalearn runs `MAMLpp` and `MAML` on
  `VGGReLUNorm` below, the same network written with `metalearn.models.MetaBatchNorm`. Plain
  MAML adapts the convolutions and the linear layer only, as the reference (its batch-norm
  parameters stay out of the inner loop: `MAML`'s default ``adapt_norm=False``), the keys
  passed as ``adapt_keys``.
* ``protonet``, ``r2d2``, ``metaoptnet``: ``kjunelee/MetaOptNet``
  (``models/classification_heads.py``: ``ProtoNetHead``, ``R2D2Head``,
  ``MetaOptNetHead_SVM_CS``) against `prototype_classifier`, the `R2D2` learner's head and the
  `MetaOptNet` learner's head, on the same random embeddings. ``metaoptnet`` needs ``qpth``
  (which pins numpy < 2: run this script from an environment that has it).
* ``r2d2-bertinetto``: ``bertinetto/r2d2`` (``fewshots/models/r2d2.RRNet.loss``) with a
  table of embeddings as its encoder, against `R2D2`'s default ``"rrnet"`` head (a column
  of ones, X and Y divided by ``sqrt(N K)``, lambda 50); the control is the ``"plain"`` head
  at lambda ``50 N K`` without the ones column.
* ``imaml``: ``aravindr93/imaml_dev`` (``implicit_maml``'s ``Learner``, ``cg_solve`` and
  ``make_conv_network``, called as ``examples/omniglot_implicit_maml.py`` calls them per
  task) against `IMAML` on a copy of the same network (needs scipy and matplotlib, which
  ``implicit_maml/utils.py`` imports).

Adapted around the references (never their maths): float64 as torch's default dtype while
they build and run (their ``torch.Tensor(...)``/``torch.ones(...)`` then make float64;
``.float()`` casts inside MetaOptNet's heads and Bertinetto's layers are made float64);
``.cuda()`` calls are the identity and CUDA is hidden (CPU); APIs removed from torch since
(``torch.gesv(B, A)``, ``.data[0]`` of a 0-dim loss) are given their current equivalents
(``torch.linalg.solve(A, B)``; the loss is read from the loss module's output); their
printing is silenced. Each reference's initial state (batch-norm weights and biases,
per-step learning rates) is moved off its constant start by a seeded draw, so that a
mix-up between inner steps or layers shows, and that state is what both sides start from.

Command (a reference checked out at the commit given in docs/algorithms.md)::

    python scripts/reference_check.py --reference ../HowToTrainYourMAMLPytorch --algorithm mamlpp
    python scripts/reference_check.py --reference ../HowToTrainYourMAMLPytorch --algorithm maml
    python scripts/reference_check.py --reference ../MetaOptNet --algorithm protonet
    python scripts/reference_check.py --reference ../MetaOptNet --algorithm r2d2
    python scripts/reference_check.py --reference ../MetaOptNet --algorithm metaoptnet
    python scripts/reference_check.py --reference ../r2d2 --algorithm r2d2-bertinetto
    python scripts/reference_check.py --reference ../imaml_dev --algorithm imaml

Expected: a markdown table, then ``max_relative_difference: X`` (1e-16 to 1e-13 where
metalearn computes the reference's function: the MAML family's five second-order steps
gather the most rounding); rows marked ``(control)`` set metalearn up differently from the
reference on purpose and show that the comparison sees it. The measured values are in
docs/algorithms.md.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Literal

import torch
import torch.nn.functional as F
from benchtools import markdown_table, parse_args_as, usage_error
from torch import Tensor, nn

from metalearn.algorithms import IMAML, MAML, R2D2, MAMLpp, MetaOptNet, ProtoNet
from metalearn.engine import Task
from metalearn.models import MetaBatchNorm

Algorithm = Literal["mamlpp", "maml", "protonet", "r2d2", "metaoptnet", "r2d2-bertinetto", "imaml"]

MARKER = {
    "mamlpp": ("few_shot_learning_system.py", "AntreasAntoniou/HowToTrainYourMAMLPytorch"),
    "maml": ("few_shot_learning_system.py", "AntreasAntoniou/HowToTrainYourMAMLPytorch"),
    "protonet": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "r2d2": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "metaoptnet": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "r2d2-bertinetto": ("fewshots/models/r2d2.py", "bertinetto/r2d2"),
    "imaml": ("implicit_maml/learner_model.py", "aravindr93/imaml_dev"),
}
"""Per algorithm: a file its reference checkout has, and the repository to fetch."""


@dataclass
class Args:
    """Arguments of reference_check.py (each is a --flag; see --help)."""

    reference: str | None = None
    """A checkout of the algorithm's reference repository (see docs/algorithms.md)."""
    algorithm: Algorithm = "mamlpp"
    """Which comparison to run."""
    tolerance: float = 1e-10
    """The largest relative difference accepted (float64 rounding is about 1e-15)."""
    seed: int = 0
    """Seeds the weights' perturbation and the task tensors."""
    threads: int = 1
    """Torch CPU threads."""


# ---------------------------------------------------------------------------- loading


def load_module(name: str, path: Path) -> ModuleType:
    """The module (or package, for a folder) at ``path``, imported under ``name`` and
    registered in ``sys.modules``, so that the reference's own imports of it find it."""
    if name in sys.modules:
        return sys.modules[name]
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def reference_environment() -> Iterator[None]:
    """What the references need from a 2018 PyTorch on a CUDA machine, around their calls:
    ``.cuda()`` as the identity, ``torch.gesv(B, A)`` as ``torch.linalg.solve(A, B)``,
    ``narrow(dimension=...)`` as ``narrow(dim, ...)``, and ``.float()`` keeping float64
    (float64 is the point of the check). Their prints and warnings are silenced."""
    saved = torch.Tensor.cuda, torch.Tensor.float, getattr(torch, "gesv", None)
    narrow = torch.Tensor.narrow
    torch.Tensor.narrow = lambda self, *a, dimension=None, **k: (  # type: ignore[method-assign]
        narrow(self, *a, **k) if dimension is None else narrow(self, dimension, *a, **k)
    )
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.get_default_dtype())  # type: ignore[method-assign]
    torch.gesv = lambda b, a: (torch.linalg.solve(a, b), None)  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # their zero_grad reads .grad of non-leaves
            yield
    finally:
        torch.Tensor.cuda, torch.Tensor.float = saved[0], saved[1]  # type: ignore[method-assign]
        torch.Tensor.narrow = narrow  # type: ignore[method-assign]
        if saved[2] is None:
            del torch.gesv  # type: ignore[attr-defined]
        else:
            torch.gesv = saved[2]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- comparing


def relative(a: Tensor | None, b: Tensor | None, whole: float = 0.0) -> float:
    """``||a - b|| / ||b||`` (a missing gradient counts as zeros).

    Where ``||b||`` is below ``1e-12 * whole`` (``whole``: the norm of everything compared
    with it, e.g. the whole meta-gradient), ``b`` is zero up to rounding (a convolution's
    bias ahead of batch norm, which subtracts it again) and the difference is taken
    relative to ``whole`` instead: two rounding errors have no relative difference.
    """
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a.detach()
    b = torch.zeros_like(a) if b is None else b.detach()
    diff, scale = float((a - b).norm()), float(b.norm())
    if scale <= 1e-12 * whole:
        scale = whole
    return diff / scale if scale > 0 else diff


def norm_of(tensors: Sequence[Tensor | None]) -> float:
    """The norm of all ``tensors`` together (None: zeros)."""
    return math.sqrt(sum(float(t.detach().norm()) ** 2 for t in tensors if t is not None))


@dataclass
class Row:
    case: str
    quantity: str
    difference: float
    counted: bool = True
    """False for a control: a setting known to differ from the reference, shown to prove
    that the comparison sees a difference; not held to ``--tolerance``."""
    bound: float | None = None
    """The row's own bound in place of ``--tolerance``, where the reference itself is only
    that accurate (qpth's gradient); the reason is in the row's ``quantity``."""


# ---------------------------------------------------------------------------- MAML, MAML++


class VGGReLUNorm(nn.Module):
    """MAML++'s network (HowToTrainYourMAMLPytorch's ``VGGReLUNormNetwork`` with max-pooling
    and padding): ``stages`` blocks of 3x3 conv (padding 1) -> batch norm -> leaky ReLU
    (slope 0.01) -> 2x2 max-pool, then a linear layer on the flattened features.

    Shape: ``[B, channels, 28, 28] -> [B, ways]`` (Omniglot: 28 -> 14 -> 7 -> 3 -> 1).
    """

    def __init__(self, channels: int, ways: int, filters: int, stages: int, size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for i in range(stages):
            block = nn.Module()
            block.conv = nn.Conv2d(channels if i == 0 else filters, filters, 3, padding=1)
            block.norm = MetaBatchNorm(filters)
            self.blocks.append(block)
            size //= 2
        self.head = nn.Linear(filters * size * size, ways)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = F.max_pool2d(F.leaky_relu(block.norm(block.conv(x))), 2)
        return self.head(x.flatten(1))


def metalearn_name(reference_name: str) -> str:
    """The `VGGReLUNorm` parameter of a ``VGGReLUNormNetwork`` parameter."""
    parts = reference_name.split(".")  # layer_dict.conv0.conv.weight, layer_dict.linear.weights
    if parts[1] == "linear":
        return "head." + ("weight" if parts[2] == "weights" else parts[2])
    block = int(parts[1].removeprefix("conv"))
    layer = {"conv": "conv", "norm_layer": "norm"}[parts[2]]
    return f"blocks.{block}.{layer}.{parts[3]}"


@dataclass
class MamlCase:
    name: str
    per_step: bool
    """MAML++ (LSLR, per-step batch norm, MSL) or plain MAML."""
    second_order: bool
    epoch: int
    """The reference's epoch: MSL runs while it is below the config's 10."""
    adapt_norm: bool = False
    """metalearn adapts the batch-norm parameters too (a control: the reference never does)."""


MAMLPP_CASES = [
    MamlCase("5 steps, second order, MSL at epoch 3 of 10", True, True, 3),
    MamlCase("5 steps, first order, MSL at epoch 3 of 10", True, False, 3),
    MamlCase("5 steps, second order, after MSL (epoch 10)", True, True, 10),
]
MAML_CASES = [
    MamlCase("5 steps, second order", False, True, 0),
    MamlCase("5 steps, first order", False, False, 0),
    MamlCase("control: metalearn adapts batch norm too", False, True, 0, adapt_norm=True),
]


def maml_reference(root: Path, case: MamlCase, seed: int) -> tuple[nn.Module, SimpleNamespace]:
    """The reference's ``MAMLFewShotClassifier`` for ``case``, settings from its Omniglot
    5-way 1-shot configuration (MAML++'s or MAML's file), with its initial state moved off
    its constants by a draw seeded with ``seed``."""
    kind = "maml++" if case.per_step else "maml"
    config = json.loads((root / f"experiment_config/omniglot_{kind}-omniglot_1_8_0.1_64_5_0.json")
                        .read_text())  # fmt: skip
    args = SimpleNamespace(**config)
    args.task_learning_rate = 0.1  # the reference parser's default (the JSON's is unread)
    args.seed, args.use_cuda = seed, False
    args.second_order = case.second_order
    load_module("meta_neural_network_architectures", root / "meta_neural_network_architectures.py")
    load_module("inner_loop_optimizers", root / "inner_loop_optimizers.py")
    system = load_module("few_shot_learning_system", root / "few_shot_learning_system.py")
    shape = (2, args.image_channels, args.image_height, args.image_width)
    model = system.MAMLFewShotClassifier(im_shape=shape, device=torch.device("cpu"), args=args)
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=draw)
            if "norm_layer.weight" in name:
                p.add_(0.2 * noise)
            elif name.endswith("bias"):
                p.add_(0.05 * noise)
            elif "learning_rates" in name:
                p.mul_(1 + 0.3 * torch.rand(p.shape, generator=draw))
    return model, args


def maml_tasks(args: SimpleNamespace, tasks: int, seed: int) -> tuple[Tensor, ...]:
    """The reference's data batch ``(x_support [T, N, K, C, H, W], x_target [T, N, Q, ...],
    y_support [T, N, K], y_target [T, N, Q])``, random images, classes in order."""
    draw = torch.Generator().manual_seed(seed + 1)
    n, k, q = args.num_classes_per_set, args.num_samples_per_class, args.num_target_samples
    image = (args.image_channels, args.image_height, args.image_width)
    xs = torch.randn((tasks, n, k, *image), generator=draw)
    xq = torch.randn((tasks, n, q, *image), generator=draw)
    ys = torch.arange(n)[None, :, None].expand(tasks, n, k).contiguous()
    yq = torch.arange(n)[None, :, None].expand(tasks, n, q).contiguous()
    return xs, xq, ys, yq


def maml_metalearn(
    reference: nn.Module, args: SimpleNamespace, case: MamlCase
) -> tuple[nn.Module, VGGReLUNorm]:
    """metalearn's learner on `VGGReLUNorm`, with the reference's weights (and, for MAML++,
    its per-step batch norm and learning rates) copied in."""
    steps = args.number_of_training_steps_per_iter
    net = VGGReLUNorm(args.image_channels, args.num_classes_per_set, args.cnn_num_filters,
                      args.num_stages, args.image_height)  # fmt: skip
    ref = {n: p for n, p in reference.classifier.named_parameters() if p.requires_grad}
    own = dict(net.named_parameters())
    with torch.no_grad():
        for name, p in ref.items():
            target = own[metalearn_name(name)]
            target.copy_(p[0] if p.dim() == target.dim() + 1 else p)  # per-step: row 0
    if not case.per_step:  # the reference never adapts batch norm in the inner loop
        keys = None if case.adapt_norm else [n for n in own if ".norm." not in n]
        learner = MAML(net, inner_lr=args.task_learning_rate, inner_steps=steps,
                       first_order=not case.second_order, adapt_keys=keys,
                       adapt_norm=case.adapt_norm)  # fmt: skip
        return learner, net
    learner = MAMLpp(
        net, inner_lr=args.task_learning_rate, inner_steps=steps,
        msl_steps=args.multi_step_loss_num_epochs if args.use_multi_step_loss_optimization else 0,
        first_order_steps=0 if case.second_order else 10**9, per_step_bn=True,
        msl_epoch_length=1,  # one meta-step per epoch here: the schedule is set by epoch
    )  # fmt: skip
    learner.schedule(case.epoch, 10**9)  # MSL's weights at the reference's epoch
    rates = dict(reference.inner_loop_optimizer.names_learning_rates_dict.items())
    with torch.no_grad():
        for name, p in ref.items():
            ml = metalearn_name(name).replace(".", "__")
            if ".norm." in metalearn_name(name):
                learner.bn[ml].copy_(p)
            else:
                learner.lrs[ml].copy_(rates[name.replace(".", "-")][:steps])
    return learner, net


def compare_maml(root: Path, cases: Sequence[MamlCase], seed: int) -> list[Row]:
    rows = []
    for case in cases:
        with reference_environment():
            reference, args = maml_reference(root, case, seed)
            batch = maml_tasks(args, tasks=4, seed=seed)
            reference.current_epoch = case.epoch  # what its run_train_iter sets
            reference.train()
            losses, _ = reference.train_forward_prop(data_batch=batch, epoch=case.epoch)
            losses["loss"].backward()
        learner, net = maml_metalearn(reference, args, case)
        xs, xq, ys, yq = batch
        tasks = [Task((a.flatten(0, 1), b.flatten()), (c.flatten(0, 1), d.flatten()))
                 for a, c, b, d in zip(xs, xq, ys, yq)]  # fmt: skip
        metrics = learner.backward(tasks)
        loss = float(losses["loss"].detach())
        found = [Row(case.name, "meta-loss", abs(metrics.loss / loss - 1))]
        found += maml_gradients(reference, learner, net, case, args, case.name)
        rows += [replace(row, counted=not case.adapt_norm) for row in found]
    return rows


def maml_gradients(
    reference: nn.Module,
    learner: nn.Module,
    net: nn.Module,
    case: MamlCase,
    args: SimpleNamespace,
    label: str,
) -> list[Row]:
    """One row per parameter kind: the largest relative difference of its meta-gradients."""
    steps = args.number_of_training_steps_per_iter
    own = dict(net.named_parameters())
    worst: dict[str, float] = {}
    whole = norm_of([p.grad for p in reference.parameters()])

    def note(kind: str, value: float) -> None:
        worst[kind] = max(worst.get(kind, 0.0), value)

    for name, p in reference.classifier.named_parameters():
        if not p.requires_grad:
            continue
        ml = metalearn_name(name)
        kind = ".".join(ml.split(".")[-2:])
        if case.per_step and ".norm." in ml:
            note(
                f"per-step {kind}", relative(learner.bn[ml.replace(".", "__")].grad, p.grad, whole)
            )
        else:
            note(kind, relative(own[ml].grad, p.grad, whole))
    if case.per_step:
        for key, rate in reference.inner_loop_optimizer.names_learning_rates_dict.items():
            ml = metalearn_name(key.replace("-", ".")).replace(".", "__")
            kind = ".".join(ml.split("__")[-2:])
            note(f"rates of {kind}", relative(learner.lrs[ml].grad, rate.grad[:steps], whole))
            note("unused last rate (zero)", float(rate.grad[steps:].abs().max()))
    return [Row(label, f"meta-gradient: {kind}", value) for kind, value in worst.items()]


# ---------------------------------------------------------------------------- solved heads


class Embedded(nn.Module):
    """A model whose backbone is the identity on ``dim`` features, for a learner's ``head``:
    the solved-head learners then score the embeddings they are given."""

    def __init__(self, dim: int, ways: int) -> None:
        super().__init__()
        self.head = nn.Linear(dim, ways)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x)


@dataclass
class HeadCase:
    name: str
    ways: int
    shots: int
    queries: int
    dim: int


HEAD_CASES = [
    HeadCase("5-way 1-shot, D 64", 5, 1, 3, 64),
    HeadCase("5-way 5-shot, D 32", 5, 5, 3, 32),
]
TASKS = 2


def embeddings(case: HeadCase, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(support [T, N K, D], labels [T, N K], query [T, N Q, D], query labels [T, N Q])``:
    random embeddings (leaky-ReLU-like: mostly positive), classes in order."""
    draw = torch.Generator().manual_seed(seed + 2)
    n, k, q = case.ways, case.shots, case.queries
    support = F.leaky_relu(torch.randn((TASKS, n * k, case.dim), generator=draw) + 0.3, 0.1)
    query = F.leaky_relu(torch.randn((TASKS, n * q, case.dim), generator=draw) + 0.3, 0.1)
    ys = torch.arange(n).repeat_interleave(k).expand(TASKS, -1).contiguous()
    yq = torch.arange(n).repeat_interleave(q).expand(TASKS, -1).contiguous()
    return support, ys, query, yq


def head_rows(
    case: HeadCase,
    seed: int,
    reference: Callable[[Tensor, Tensor, Tensor], Tensor],
    ours: Callable[[Tensor, Tensor, Tensor], Tensor],
    label: str,
    extra: Callable[[], list[tuple[str, Tensor | None, Tensor | None]]] | None = None,
) -> list[Row]:
    """Both heads on the same embeddings: the query log-probabilities (the softmax of the
    logits: a per-query constant the softmax ignores may differ) and the gradients of the
    mean query cross-entropy w.r.t. the support and query embeddings.

    ``reference(query [T, Q, D], support [T, S, D], labels [T, S]) -> logits [T, Q, N]``;
    ``ours(support [S, D], labels [S], query [Q, D]) -> logits [Q, N]`` for one task.
    ``extra()`` gives further (name, ours, reference) gradients to compare after both ran.
    """
    support, ys, query, yq = embeddings(case, seed)
    leaves = [t.clone().requires_grad_() for t in (support, query, support, query)]
    with reference_environment():
        ref_logits = reference(leaves[1], leaves[0], ys)
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, case.ways), yq.reshape(-1))
        ref_loss.backward()
    own_logits = torch.stack([ours(leaves[2][t], ys[t], leaves[3][t]) for t in range(TASKS)])
    own_loss = F.cross_entropy(own_logits.reshape(-1, case.ways), yq.reshape(-1))
    own_loss.backward()
    pairs = [
        ("log-probabilities", own_logits.log_softmax(-1), ref_logits.log_softmax(-1)),
        ("query loss", own_loss, ref_loss),
        ("gradient: support embeddings", leaves[2].grad, leaves[0].grad),
        ("gradient: query embeddings", leaves[3].grad, leaves[1].grad),
        *(extra() if extra else []),
    ]
    whole = norm_of([b for _, _, b in pairs[2:]])
    name = f"{label}, {case.name}"
    return [Row(name, what, relative(a, b, whole)) for what, a, b in pairs]


def metaoptnet_heads(root: Path) -> ModuleType:
    """MetaOptNet's ``models/classification_heads.py`` (it imports ``qpth``)."""
    try:
        import qpth  # noqa: F401
    except ImportError:
        usage_error("MetaOptNet's classification_heads.py imports qpth, which this environment "
                    "lacks: run from one with `pip install qpth \"numpy<2\"`")  # fmt: skip
    return load_module("metaoptnet_classification_heads", root / "models/classification_heads.py")


def compare_protonet(root: Path, seed: int) -> list[Row]:
    heads = metaoptnet_heads(root)
    return [row for case in HEAD_CASES for row in protonet_case(heads, case, seed)]


def protonet_case(heads: ModuleType, case: HeadCase, seed: int) -> list[Row]:
    """``ProtoNetHead`` without and with its default division by D (which is metalearn's
    head on embeddings divided by sqrt(D)) against `ProtoNet`'s head."""
    n, k, root_d = case.ways, case.shots, math.sqrt(case.dim)
    learner = ProtoNet(Embedded(case.dim, n))

    def plain(q: Tensor, s: Tensor, y: Tensor) -> Tensor:
        return heads.ProtoNetHead(q, s, y, n, k, normalize=False)

    def default(q: Tensor, s: Tensor, y: Tensor) -> Tensor:  # ClassificationHead's call
        return heads.ProtoNetHead(q, s, y, n, k)

    def ours(s: Tensor, y: Tensor, q: Tensor) -> Tensor:
        return learner.solve(s, y, n).logits(q)

    def scaled(s: Tensor, y: Tensor, q: Tensor) -> Tensor:  # -||q - c||^2 / D
        return learner.solve(s / root_d, y, n).logits(q / root_d)

    return [
        *head_rows(case, seed, plain, ours, "ProtoNetHead(normalize=False)"),
        *head_rows(case, seed, default, scaled,
                   "ProtoNetHead (its default: / D), ours on embeddings / sqrt(D)"),
    ]  # fmt: skip


def compare_r2d2(root: Path, seed: int) -> list[Row]:
    heads = metaoptnet_heads(root)
    return [row for case in HEAD_CASES for row in r2d2_case(heads, case, seed)]


def r2d2_case(heads: ModuleType, case: HeadCase, seed: int) -> list[Row]:
    """``ClassificationHead("R2D2")`` (``R2D2Head``, lambda 50, its learned scale set to
    1.7) against `R2D2` with lambda 50, scale 1.7 and bias 0."""
    n, k, scale = case.ways, case.shots, 1.7
    with reference_environment():
        reference = heads.ClassificationHead(base_learner="R2D2", enable_scale=True).double()
    with torch.no_grad():
        reference.scale.fill_(scale)
    learner = R2D2(Embedded(case.dim, n), ridge_form="plain", lam=50.0, scale=scale, bias=0.0)

    def ref(q: Tensor, s: Tensor, y: Tensor) -> Tensor:
        return reference(q, s, y, n, k)

    def ours(s: Tensor, y: Tensor, q: Tensor) -> Tensor:
        return learner.solve(s, y, n).logits(q)

    def extra() -> list[tuple[str, Tensor | None, Tensor | None]]:
        d_scale = learner.log_scale.grad / learner.log_scale.exp()  # d/d scale
        return [("gradient: scale", d_scale, reference.scale.grad[0])]

    return head_rows(case, seed, ref, ours, "R2D2Head (lambda 50, scale 1.7)", extra=extra)


QPTH_BOUND = 1e-5
"""The bound on the SVM's support-embedding gradient: qpth differentiates the KKT system at
its interior point, where complementarity holds only to its tolerance, so its gradient is
not the exact solution's (central differences agree with metalearn's; see the rows)."""


def compare_metaoptnet(root: Path, seed: int) -> list[Row]:
    heads = metaoptnet_heads(root)
    return [row for case in HEAD_CASES for row in metaoptnet_case(heads, case, seed)]


def metaoptnet_case(heads: ModuleType, case: HeadCase, seed: int) -> list[Row]:
    """``ClassificationHead("SVM-CS")`` (``MetaOptNetHead_SVM_CS``, C 0.1, maxIter 15, its
    scale set to 1.7) against `MetaOptNet`'s head (15 interior-point iterations, then the
    exact solution on the face they identify), and both gradients w.r.t. the support
    embeddings against central differences of the query loss (step 1e-5, four random
    directions)."""
    n, k, scale = case.ways, case.shots, 1.7
    with reference_environment():
        reference = heads.ClassificationHead(base_learner="SVM-CS", enable_scale=True).double()
    with torch.no_grad():
        reference.scale.fill_(scale)
    learner = MetaOptNet(Embedded(case.dim, n), scale=scale)

    grads = {}

    def ref(q: Tensor, s: Tensor, y: Tensor) -> Tensor:
        s.register_hook(lambda g: grads.update(reference=g[0]))
        return reference(q, s, y, n, k)

    def ours(s: Tensor, y: Tensor, q: Tensor) -> Tensor:
        return learner.solve(s, y, n).logits(q)

    def extra() -> list[tuple[str, Tensor | None, Tensor | None]]:
        return [("gradient: scale", learner.scale.grad, reference.scale.grad[0])]

    label = "MetaOptNetHead_SVM_CS (C 0.1, maxIter 15, scale 1.7)"
    rows = head_rows(case, seed, ref, ours, label, extra=extra)
    support, ys, query, yq = (t[0] for t in embeddings(case, seed))

    def loss(s: Tensor) -> Tensor:
        return F.cross_entropy(ours(s, ys, query), yq) / TASKS  # task 0's part of the mean

    leaf = support.clone().requires_grad_()
    loss(leaf).backward()
    draw = torch.Generator().manual_seed(seed + 3)
    directions = [d / d.norm() for d in torch.randn((4, *support.shape), generator=draw)]
    with torch.no_grad():
        fd = torch.stack([(loss(support + 1e-5 * d) - loss(support - 1e-5 * d)) / 2e-5
                          for d in directions])  # fmt: skip
    for who, grad in (("metalearn", leaf.grad), ("reference", grads["reference"])):
        along = torch.stack([(grad * d).sum() for d in directions])
        what = f"{who}'s support gradient vs central differences (step 1e-5)"
        rows.append(Row(f"{label}, {case.name}", what, relative(along, fd)))
    for row in rows:
        if row.quantity == "gradient: support embeddings":
            row.bound = QPTH_BOUND
            row.quantity += f" (qpth's: bound {QPTH_BOUND:g})"
        elif row.quantity.startswith("metalearn's support gradient"):
            row.bound = 1e-7  # the differences' truncation and rounding
        elif row.quantity.startswith("reference's"):
            row.counted = False
    return rows


def rrnet(root: Path) -> ModuleType:
    """bertinetto/r2d2's ``fewshots/models/r2d2.py`` and the three modules it imports, by
    path (the packages' ``__init__`` files, which import the data loaders, are skipped)."""
    for package in ("fewshots", "fewshots.models", "fewshots.data"):
        if package not in sys.modules:
            module = ModuleType(package)
            module.__path__ = [str(root / package.replace(".", "/"))]
            sys.modules[package] = module
    for name in ("fewshots.models.utils", "fewshots.labels_r2d2", "fewshots.models.adjust",
                 "fewshots.data.queries"):  # fmt: skip
        load_module(name, root / (name.replace(".", "/") + ".py"))
    module = load_module("fewshots.models.r2d2", root / "fewshots/models/r2d2.py")
    make = sys.modules["fewshots.labels_r2d2"].make_float_label  # torch.FloatTensor: float32
    module.make_float_label = lambda n, m: make(n, m).to(torch.get_default_dtype())
    return module


class Lookup(nn.Module):
    """Bertinetto's encoder replaced by a table of embeddings: its input images are the
    rows' indices ``[B, 1, 1, 1]`` (RRNet detaches its input with ``Variable``, so the
    gradient reaches the embeddings through the table), and it keeps the indices it saw
    (the queries come shuffled)."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: Tensor) -> Tensor:
        self.seen = x.flatten().long()
        return self.table[self.seen]


def compare_r2d2_bertinetto(root: Path, seed: int) -> list[Row]:
    with reference_environment():  # r2d2.py imports torch.gesv
        r2d2 = rrnet(root)
    rows = []
    primal = HeadCase("20-way 5-shot, D 32 (its primal solve: N K > D + 1)", 20, 5, 2, 32)
    for case in [*HEAD_CASES, primal]:
        n, k, q = case.ways, case.shots, case.queries
        for ones in (True, False):
            rows += bertinetto_case(r2d2, case, seed, n, k, q, ones)
    return rows


def bertinetto_case(
    r2d2: ModuleType, case: HeadCase, seed: int, n: int, k: int, q: int, ones: bool
) -> list[Row]:
    """RRNet.loss (lambda 50 fixed, output scale 10 and bias 0.3, its Omniglot script's
    ``init_adj_scale``) against metalearn's `R2D2` with lambda ``50 N K`` on the embeddings
    with a column of ones appended (``ones``; without it: a control)."""
    support, _, query, yq = embeddings(case, seed)
    support, query = support[0], query[0]
    with reference_environment():
        table = torch.cat([support, query]).requires_grad_()
        net = r2d2.RRNet(Lookup(table), False, case.dim, False, 50.0, 10.0, 1, 1, 1, False)
        net = net.double()
        net.lambda_rr.l = net.lambda_rr.l.double()
        with torch.no_grad():
            net.adjust.bias.fill_(0.3)
        ids = torch.arange(n * (k + q), dtype=torch.float64).reshape(-1, 1, 1, 1)
        xs, xq = ids[: n * k].reshape(n, k, 1, 1, 1), ids[n * k :].reshape(n, q, 1, 1, 1)
        captured = {}
        net.L.register_forward_hook(lambda m, i, out: captured.update(loss=out, logits=i[0]))
        torch.manual_seed(seed)  # its query shuffle (torch.randperm)
        with contextlib.suppress(IndexError):  # `.data[0]` of the 0-dim loss, after the maths
            net.loss({"xs": xs, "xq": xq})
        captured["loss"].backward()
    # the reference's head is R2D2's own "rrnet" form (ones column, sqrt(NK) scaling, lambda
    # 50); the control is the "plain" form at the same effective penalty, without the ones
    if ones:
        learner = R2D2(Embedded(case.dim, n), ridge_form="rrnet", lam=50.0, scale=10.0, bias=0.3)
    else:
        learner = R2D2(Embedded(case.dim, n), ridge_form="plain", lam=50.0 * n * k, scale=10.0,
                       bias=0.3)  # fmt: skip
    ws, wq = support.clone().requires_grad_(), query.clone().requires_grad_()
    order = net.encoder.seen[n * k :] - n * k  # the reference's shuffled query order
    ys = torch.arange(n).repeat_interleave(k)
    logits = learner.solve(ws, ys, n).logits(wq)
    loss = F.cross_entropy(logits, yq[0])
    loss.backward()
    scale_grad = learner.scale.grad if ones else learner.log_scale.grad / 10.0
    pairs = [
        ("logits", logits[order], captured["logits"]),
        ("query loss", loss, captured["loss"]),
        ("gradient: support embeddings", ws.grad, table.grad[: n * k]),
        ("gradient: query embeddings", wq.grad, table.grad[n * k :]),
        ("gradient: output scale", scale_grad, net.adjust.scale.grad[0]),
        ("gradient: output bias (zero)", learner.bias.grad, net.adjust.bias.grad[0]),
    ]
    whole = norm_of([b for _, _, b in pairs[2:]])
    name = f"RRNet{'' if ones else ' (control: ours without the ones column)'}, {case.name}"
    return [Row(name, what, relative(a, b, whole), ones) for what, a, b in pairs]


# ---------------------------------------------------------------------------- iMAML


@dataclass
class ImamlCase:
    name: str
    steps: int
    counted: bool


IMAML_CASES = [
    ImamlCase("0 inner steps (phi = theta): the implicit meta-gradient alone", 0, True),
    ImamlCase("control: 5 inner steps (the inner loops differ)", 5, False),
]
IMAML_LAM, IMAML_DAMPING, IMAML_LAM_DAMPING, IMAML_CG, IMAML_LR = 2.0, 1.0, 10.0, 5, 0.005
"""The Omniglot command's lam, cg_damping and cg_steps, ``matrix_evaluator``'s own
``lam_damping`` default (its CG matrix is ``(1 + cg_damping) I + H / (lam + lam_damping)``),
and an inner rate of 0.005 instead of 0.1 (the Hessian's largest eigenvalue is about 300:
at 0.1 both inner loops diverge). At this start the support Hessian has eigenvalues below
-24, so ``2 I + H / 12`` is indefinite and both CGs meet non-positive curvature (metalearn's
at iterations 3, 2 and 3 of the three tasks): IMAML's default ``cg_negative_curvature``,
"continue", runs through it as ``cg_solve`` does."""


def compare_imaml(root: Path, seed: int) -> list[Row]:
    """The reference's per-task meta-gradient (``examples/omniglot_implicit_maml.py``'s
    loop body: ``learn_task``, one step on ``regularization_loss``, the query gradient,
    ``cg_solve`` on ``matrix_evaluator``) against `IMAML` on a copy of the same network
    (``make_conv_network``), with ``lam = 2 + 10`` and ``cg_damping = 1`` so that both solve
    ``(1 + 1) I + H / 12``. Its inner loop (plain gradient descent on the support loss, then
    one step on the proximal term alone) is not metalearn's (descent on their sum), so only
    the case with no inner step is held to the tolerance."""
    learner_model = load_module("implicit_maml", root / "implicit_maml")
    learner_model = load_module("implicit_maml.learner_model",
                                root / "implicit_maml/learner_model.py")  # fmt: skip
    utils = sys.modules["implicit_maml.utils"]
    torch.manual_seed(seed)
    with reference_environment():
        net = learner_model.make_conv_network(in_channels=1, out_dim=5)
    rows = []
    for case in IMAML_CASES:
        rows += imaml_case(learner_model, utils, net, case, seed)
    return rows


def imaml_case(
    learner_model: ModuleType, utils: ModuleType, net: nn.Module, case: ImamlCase, seed: int
) -> list[Row]:
    draw = torch.Generator().manual_seed(seed + 4)
    tasks = []
    for _ in range(3):
        # Omniglot-like binary images (its Hessian at this start is then positive enough)
        xs = (torch.rand((5, 1, 28, 28), generator=draw) < 0.2).to(torch.float64)
        xq = (torch.rand((10, 1, 28, 28), generator=draw) < 0.2).to(torch.float64)
        tasks.append({"x_train": xs, "y_train": torch.arange(5),
                      "x_val": xq, "y_val": torch.arange(5).repeat_interleave(2)})  # fmt: skip
    fast = learner_model.Learner(model=copy.deepcopy(net), loss_function=nn.CrossEntropyLoss(),
                                 inner_lr=IMAML_LR, GPU=False)  # fmt: skip
    w_k = fast.get_params()
    lam = torch.tensor(IMAML_LAM)
    meta_grad = 0.0
    with reference_environment():
        for task in tasks:  # the example script's per-task body, through the Learner's API
            fast.set_params(w_k.clone())
            fast.learn_task(task, num_steps=case.steps)
            fast.inner_opt.zero_grad()
            fast.regularization_loss(w_k, lam).backward()
            fast.inner_opt.step()
            valid_loss = fast.get_loss(task["x_val"], task["y_val"])
            valid_grad = torch.autograd.grad(valid_loss, fast.model.parameters())
            flat_grad = torch.cat([g.contiguous().view(-1) for g in valid_grad])
            evaluator = fast.matrix_evaluator(task, lam, IMAML_DAMPING)
            meta_grad += utils.cg_solve(evaluator, flat_grad, IMAML_CG, x_init=None) / len(tasks)
    ours = copy.deepcopy(net)
    learner = IMAML(ours, lam=IMAML_LAM + IMAML_LAM_DAMPING, inner_lr=IMAML_LR,
                    inner_steps=case.steps, cg_steps=IMAML_CG, cg_tol=1e-300,
                    cg_damping=IMAML_DAMPING)  # fmt: skip
    learner.backward([Task((t["x_train"], t["y_train"]), (t["x_val"], t["y_val"])) for t in tasks])
    offset, rows = 0, []
    for name, p in ours.named_parameters():
        ref = meta_grad[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        rows.append(Row(case.name, f"meta-gradient: {name}", relative(p.grad, ref,
                        float(meta_grad.norm())), case.counted))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> Args:
    args = parse_args_as(Args, argv, __doc__)
    if args.threads < 1:
        usage_error(f"--threads must be at least 1, got {args.threads}")
    if not args.tolerance > 0:
        usage_error(f"--tolerance must be > 0, got {args.tolerance}")
    return args


def check_reference(args: Args) -> Path:
    """The checkout ``--reference`` names, refused in one line when it is not one."""
    marker, repo = MARKER[args.algorithm]
    if args.reference is None:
        usage_error(f"--algorithm {args.algorithm} needs --reference PATH, a checkout of "
                    f"https://github.com/{repo} (commit: docs/algorithms.md)")  # fmt: skip
    root = Path(args.reference).expanduser().resolve()
    if not (root / marker).is_file():
        usage_error(f"--reference {args.reference} has no {marker}: pass a checkout of "
                    f"https://github.com/{repo}")  # fmt: skip
    return root


COMPARE: dict[str, Callable[[Path, int], list[Row]]] = {
    "mamlpp": lambda root, seed: compare_maml(root, MAMLPP_CASES, seed),
    "maml": lambda root, seed: compare_maml(root, MAML_CASES, seed),
    "protonet": compare_protonet,
    "r2d2": compare_r2d2,
    "metaoptnet": compare_metaoptnet,
    "r2d2-bertinetto": compare_r2d2_bertinetto,
    "imaml": compare_imaml,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = check_reference(args)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the references move to CUDA when they see one
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    rows = COMPARE[args.algorithm](root, args.seed)
    table = [[r.case, r.quantity, f"{r.difference:.2e}" + note(r)] for r in rows]
    print(markdown_table(["case", "compared", "relative difference"], table))
    worst = max(r.difference for r in rows if r.counted and r.bound is None)
    print(f"max_relative_difference: {worst:.2e}")
    failed = [r for r in rows if r.counted and not r.difference <= (r.bound or args.tolerance)]
    for r in failed:
        print(f"above its bound: {r.case}: {r.quantity}: {r.difference:.2e}", file=sys.stderr)
    return 1 if failed else 0


def note(row: Row) -> str:
    if not row.counted:
        return " (control)" if row.case.find("control") >= 0 else " (shown)"
    return "" if row.bound is None else f" (bound {row.bound:g})"


if __name__ == "__main__":
    raise SystemExit(main())
