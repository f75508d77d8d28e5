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
  parameters stay out of the inner loop), through ``adapt_keys``.
* ``protonet``, ``r2d2``, ``metaoptnet``: ``kjunelee/MetaOptNet``
  (``models/classification_heads.py``: ``ProtoNetHead``, ``R2D2Head``,
  ``MetaOptNetHead_SVM_CS``) against `prototype_classifier`, the `R2D2` learner's head and the
  `MetaOptNet` learner's head, on the same random embeddings. ``metaoptnet`` needs ``qpth``
  (which pins numpy < 2: run this script from an environment that has it).
* ``r2d2-bertinetto``: ``bertinetto/r2d2`` (``fewshots/models/r2d2.RRNet.loss``) with an
  identity encoder, so its input rows are the embeddings.

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

Expected: a markdown table per algorithm, then ``max_relative_difference: X`` (about 1e-15
where metalearn computes the reference's function; the measured values are in
docs/algorithms.md).
"""

from __future__ import annotations

import contextlib
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

from metalearn.algorithms import MAML, MAMLpp, MetaOptNet, R2D2
from metalearn.algorithms.protonet import prototype_classifier
from metalearn.engine import Task
from metalearn.models import MetaBatchNorm

Algorithm = Literal["mamlpp", "maml", "protonet", "r2d2", "metaoptnet", "r2d2-bertinetto"]

MARKER = {
    "mamlpp": ("few_shot_learning_system.py", "AntreasAntoniou/HowToTrainYourMAMLPytorch"),
    "maml": ("few_shot_learning_system.py", "AntreasAntoniou/HowToTrainYourMAMLPytorch"),
    "protonet": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "r2d2": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "metaoptnet": ("models/classification_heads.py", "kjunelee/MetaOptNet"),
    "r2d2-bertinetto": ("fewshots/models/r2d2.py", "bertinetto/r2d2"),
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
    ``.cuda()`` as the identity, ``torch.gesv(B, A)`` as ``torch.linalg.solve(A, B)``, and
    ``.float()`` keeping float64 (float64 is the point of the check). Their prints are
    silenced."""
    saved = torch.Tensor.cuda, torch.Tensor.float, getattr(torch, "gesv", None)
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.get_default_dtype())  # type: ignore[method-assign]
    torch.gesv = lambda b, a: (torch.linalg.solve(a, b), None)  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # their zero_grad reads .grad of non-leaves
            yield
    finally:
        torch.Tensor.cuda, torch.Tensor.float = saved[0], saved[1]  # type: ignore[method-assign]
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
                       first_order=not case.second_order, adapt_keys=keys)  # fmt: skip
        return learner, net
    learner = MAMLpp(
        net, inner_lr=args.task_learning_rate, inner_steps=steps,
        msl_steps=args.multi_step_loss_num_epochs if args.use_multi_step_loss_optimization else 0,
        first_order_steps=0 if case.second_order else 10**9, per_step_bn=True,
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
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = check_reference(args)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the references move to CUDA when they see one
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    rows = COMPARE[args.algorithm](root, args.seed)
    table = [[r.case, r.quantity, f"{r.difference:.2e}" + ("" if r.counted else " (control)")]
             for r in rows]  # fmt: skip
    print(markdown_table(["case", "compared", "relative difference"], table))
    worst = max(r.difference for r in rows if r.counted)
    print(f"max_relative_difference: {worst:.2e}")
    if not (worst <= args.tolerance):
        print(f"above --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
