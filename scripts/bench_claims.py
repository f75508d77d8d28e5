"""Measure PyTorch-practice claims on metalearn's workloads (``docs/claims.md`` 1, 2, 4, 8-10).

* ``contiguity`` (claim 1): ops on a transposed view against the same values contiguous, at
  Conv4's shapes; the usual fix (``.contiguous()`` first) and its fresh-memory control.
* ``sparse`` (claim 2): dense, COO and CSR storage and matmul time at four densities.
* ``branch`` (claim 4): `metalearn.models.dynamic.dynamic_conv` with no, one and both blocks
  skipped (and its layers without the branch): forward and MAML adapt+predict time, and
  the FLOPs skipped.
* ``dynamic``: does skipping `metalearn.models.dynamic.DynamicBlock`s leave accuracy unchanged?
  A ``dynamic_conv`` network is meta-trained with MAML on Omniglot 5-way 1-shot, once with
  every block always taken and once with each block skipped at random per task (stochastic
  depth, Huang et al., 2016), then tested on the same test tasks with no block skipped,
  block 2 skipped and both skipped: mean accuracy, its 95% interval, and the paired
  difference from no block skipped.
* ``permute``: ``permute`` against ``transpose`` for the same reorder: the view itself, the
  view made contiguous, and the convolution or matmul that follows it, at Conv4's,
  mini-ImageNet's and a linear layer's shapes.
* ``inference``: a forward pass of Conv4 and of the adapted deploy model at batch 1 and 80,
  plain, under ``torch.no_grad`` and under ``torch.inference_mode``: latency, the memory
  the output holds (a plain forward's autograd graph), peak tensor memory; and what an
  inference tensor refuses afterwards.

Timing is this process's CPU time (``time.process_time``) with ``--threads`` torch threads,
the compared forms interleaved round-robin within each repeat (`benchtools.time_round_robin`),
medians, every ratio against a baseline of the same run. The load average is printed with
the numbers (the machine may be shared). Each section also prints the checks that its
compared forms compute the same thing.

Command::

    .venv/bin/python scripts/bench_claims.py --only contiguity --only sparse --only branch
    .venv/bin/python scripts/bench_claims.py --only permute --only inference
    .venv/bin/python scripts/bench_claims.py --only dynamic --data-root ../shared/data/omniglot

Expected: per section, a header line (torch, threads, load average, metalearn commit) and
markdown tables; ``dynamic`` takes about 15 minutes with the defaults on one thread.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from benchtools import (
    Setting,
    markdown_table,
    omniglot_conv4,
    omniglot_tasks,
    parse_args_as,
    peak_memory_bytes,
    retained_bytes,
    run_header,
    time_round_robin,
    usage_error,
)
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from metalearn.algorithms import MAML
from metalearn.data import EpisodicSampler, load_omniglot, omniglot_samplers
from metalearn.deploy import adapt_to_support, adapted_model
from metalearn.engine import Task
from metalearn.models import Conv4
from metalearn.models.dynamic import dynamic_conv
from metalearn.runs.evaluation import TEST_SEED, accuracy_interval

Section = Literal["contiguity", "sparse", "branch", "dynamic", "permute", "inference"]
SECTIONS: tuple[str, ...] = typing.get_args(Section)

# ------------------------------------------------------------------------------ dynamic

SKIPS = {"none": (False, False), "block 2": (False, True), "both": (True, True)}
"""The tested branches of the two-block ``dynamic_conv``: name -> ``skip`` flags per block."""


class SkippingSource:
    """An `metalearn.runs.evaluation.TaskSource` whose tasks all take one branch: ``skip`` flags."""

    def __init__(self, sampler: EpisodicSampler, skip: tuple[bool, ...]) -> None:
        self.sampler, self.skip = sampler, skip

    def sample_indices(self, generator: torch.Generator, tasks: int) -> tuple[Tensor, Tensor]:
        return self.sampler.sample_indices(generator, tasks)

    def tasks_from_indices(self, classes: Tensor, examples: Tensor) -> list[Task]:
        tasks = self.sampler.tasks_from_indices(classes, examples)
        return [dataclasses.replace(t, model_kwargs={"skip": self.skip}) for t in tasks]


def random_skips(tasks: list[Task], rng: random.Random, p: float, blocks: int) -> list[Task]:
    """The tasks, each given its own branch: every block skipped with probability ``p``."""

    def flags() -> tuple[bool, ...]:
        return tuple(rng.random() < p for _ in range(blocks))

    return [dataclasses.replace(t, model_kwargs={"skip": flags()}) for t in tasks]


def train_dynamic(
    sampler: EpisodicSampler,
    steps: int,
    meta_batch: int,
    skip_prob: float,
    seed: int = 0,
    hidden: int = 64,
    outer_lr: float = 1e-3,
) -> MAML:
    """MAML (second order, 1 inner step, inner lr 0.4) on ``dynamic_conv(hidden=hidden)``.

    With ``skip_prob > 0`` each training task skips each block with that probability, so
    the network learns to work without either block; with 0 every block is always taken.
    Adam on theta with ``outer_lr``; tasks from ``sampler`` seeded by ``seed``.
    """
    torch.manual_seed(seed)
    learner = MAML(dynamic_conv(hidden=hidden))
    blocks = len(learner.model.blocks)
    opt = torch.optim.Adam(learner.parameters(), lr=outer_lr)
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    for _ in range(steps):
        tasks = sampler.batch(meta_batch, gen)
        if skip_prob > 0:
            tasks = random_skips(tasks, rng, skip_prob, blocks)
        opt.zero_grad(set_to_none=True)
        learner.backward(tasks)
        opt.step()
    return learner


def task_accuracies(
    learner: MAML, source: SkippingSource, tasks: int, steps: int, seed: int, chunk: int = 50
) -> Tensor:
    """Query accuracy of each of ``tasks`` test tasks, ``[T]`` float64.

    The tasks are drawn as `metalearn.runs.evaluation.evaluate_tasks` draws them (every index
    up front from a generator seeded ``seed``), so its mean is that function's and every
    branch is tested on the same tasks, which pairs the differences.
    """
    classes, examples = source.sample_indices(torch.Generator().manual_seed(seed), tasks)
    accs = [
        learner.evaluate(source.tasks_from_indices(classes[i : i + chunk], examples[i : i + chunk]),
                         steps=steps)[1]
        for i in range(0, tasks, chunk)
    ]  # fmt: skip
    return torch.cat(accs).double()


def skip_accuracies(
    learner: MAML, sampler: EpisodicSampler, tasks: int, steps: int, seed: int = TEST_SEED
) -> dict[str, dict[str, float]]:
    """Each `SKIPS` branch's accuracy on the same tasks: ``{branch: {"mean", "ci95",
    "diff", "diff_ci95"}}``, the difference paired with no block skipped, per task."""
    accs = {name: task_accuracies(learner, SkippingSource(sampler, skip), tasks, steps, seed)
            for name, skip in SKIPS.items()}  # fmt: skip
    out = {}
    for name, acc in accs.items():
        diff = acc - accs["none"]
        out[name] = {"mean": acc.mean().item(), "ci95": accuracy_interval(acc),
                     "diff": diff.mean().item(), "diff_ci95": accuracy_interval(diff)}  # fmt: skip
    return out


def run_dynamic(a: Args) -> None:
    data = load_omniglot(a.data_root, progress=False)
    train = omniglot_samplers(data, ways=5, shots=1, queries=5)["train"]
    test = omniglot_samplers(data, ways=5, shots=1, queries=15)["test"]
    trainings = {"every block taken": 0.0}
    if a.skip_prob > 0:
        trainings[f"random skips (p = {a.skip_prob})"] = a.skip_prob
    rows = []
    for label, prob in trainings.items():
        start = time.perf_counter()
        learner = train_dynamic(train, a.train_steps, a.meta_batch, prob, hidden=a.hidden)
        trained_s = time.perf_counter() - start
        print(f"trained with {label}: {trained_s:.0f} s wall; {run_header()}", flush=True)
        results = skip_accuracies(learner, test, a.test_tasks, a.eval_steps)
        rows += [
            [label, name, *_percent_cells(r), f"{trained_s:.0f}"] for name, r in results.items()
        ]
    print(f"\nOmniglot 5-way 1-shot, dynamic_conv(hidden={a.hidden}), MAML second order, "
          f"{a.train_steps} meta-steps of {a.meta_batch} tasks (5 query), tested on "
          f"{a.test_tasks} tasks (15 query, {a.eval_steps} inner steps, seed {TEST_SEED}); "
          f"{run_header()}\n")  # fmt: skip
    header = ["trained with", "skipped at test", "accuracy % (95% CI)",
              "paired difference from none, points (95% CI)", "training s"]  # fmt: skip
    print(markdown_table(header, rows))


def _percent_cells(r: dict[str, float]) -> list[str]:
    """A `skip_accuracies` entry as two cells: accuracy and paired difference, in percent."""
    accuracy = f"{100 * r['mean']:.2f} +- {100 * r['ci95']:.2f}"
    if r["diff"] == 0 and r["diff_ci95"] == 0:
        return [accuracy, ""]
    return [accuracy, f"{100 * r['diff']:+.2f} +- {100 * r['diff_ci95']:.2f}"]


# ------------------------------------------------------------------------------ permute


@dataclasses.dataclass(frozen=True)
class Reorder:
    """One reorder written both ways, and the op that consumes its result.

    ``make()`` builds the input; ``transpose`` and ``permute`` give the same view of it;
    ``then`` is what the workload does next with that view.
    """

    name: str
    make: Callable[[], Tensor]
    transpose: Callable[[Tensor], Tensor]
    permute: Callable[[Tensor], Tensor]
    then: Callable[[Tensor], Tensor]
    then_name: str


def reorder_cases(scale: int = 1) -> list[Reorder]:
    """The measured reorders at their real shapes divided by ``scale`` (tests use > 1)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Callable[[], Tensor]:
        return lambda: torch.randn(*shape, generator=g)

    n, c, s, m = 80 // scale or 1, 64 // scale or 1, 14, 1024 // scale
    w64 = torch.randn(c, c, 3, 3, generator=g)
    w3 = torch.randn(32 // scale or 1, 3, 3, 3, generator=g)
    lin = torch.randn(m, m, generator=g)
    return [
        Reorder(f"swap H and W of a Conv4 activation [{n}, {c}, {s}, {s}]", randn(n, c, s, s),
                lambda x: x.transpose(2, 3), lambda x: x.permute(0, 1, 3, 2),
                lambda x: F.conv2d(x, w64, stride=2, padding=1), "conv2d 3x3/2"),
        Reorder(f"NHWC -> NCHW of mini-ImageNet images [{n}, 84, 84, 3]", randn(n, 84, 84, 3),
                lambda x: x.transpose(1, 3).transpose(2, 3), lambda x: x.permute(0, 3, 1, 2),
                lambda x: F.conv2d(x, w3, padding=1), "conv2d 3->32, 3x3"),
        Reorder(f"transpose a [{m}, {m}] matrix", randn(m, m),
                lambda x: x.t(), lambda x: x.permute(1, 0), lambda x: x @ lin, "matmul"),
        Reorder(f"swap the last two dims of [{n // 5 or 1}, 75, 1600] features",
                randn(n // 5 or 1, 75, 1600),
                lambda x: x.transpose(1, 2), lambda x: x.permute(0, 2, 1),
                lambda x: torch.bmm(x, x.new_ones(x.shape[0], 75, 5)), "bmm with [B, 75, 5]"),
    ]  # fmt: skip


def check_reorder(case: Reorder) -> dict[str, bool]:
    """Whether both spellings give the same view and the same consumer output."""
    x = case.make()
    a, b = case.transpose(x), case.permute(x)
    return {
        "same view": a.shape == b.shape and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr() == x.data_ptr(),
        "equal values": torch.equal(a, b),
        "equal output": torch.equal(case.then(a), case.then(b)),
    }  # fmt: skip


def time_reorder(case: Reorder, repeats: int, warmup: int, view_calls: int) -> dict[str, float]:
    """Median CPU seconds of each stage, by both spellings: ``{"<stage> <way>": s}``.

    Stages: ``view`` (one call; ``view_calls`` per timed sample, as a view takes about a
    microsecond), ``contiguous`` (the view copied), ``then`` (the consumer on the view);
    ``then contiguous`` is the consumer on a contiguous tensor of the view's values, made
    before timing (what the layout of the view costs the consumer).
    """
    x = case.make()
    dense = case.permute(x).contiguous()

    def views(fn: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(view_calls):
                fn(x)

        return run

    fns: dict[str, Callable[[], object]] = {}
    for way in ("transpose", "permute"):
        reorder = getattr(case, way)
        fns[f"view {way}"] = views(reorder)
        fns[f"contiguous {way}"] = lambda r=reorder: r(x).contiguous()
        fns[f"then {way}"] = lambda r=reorder: case.then(r(x))
    fns["then contiguous"] = lambda: case.then(dense)
    times = time_round_robin(fns, repeats, warmup, "cpu", time.process_time)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {k: v / view_calls if k.startswith("view") else v for k, v in med.items()}


def run_permute(a: Args) -> None:
    rows = []
    for case in reorder_cases():
        checks = check_reorder(case)
        if not all(checks.values()):
            raise AssertionError(f"{case.name}: transpose and permute disagree: {checks}")
        t = time_reorder(case, a.repeats, a.warmup, a.view_calls)
        for stage, unit, label in (("view", 1e6, "view alone (us)"),
                                   ("contiguous", 1e3, "view + .contiguous() (ms)"),
                                   ("then", 1e3, f"view + {case.then_name} (ms)")):  # fmt: skip
            tr, pe = t[f"{stage} transpose"], t[f"{stage} permute"]
            cells = [f"{tr * unit:.3f}", f"{pe * unit:.3f}", f"{pe / tr:.2f}", "", ""]
            if stage == "then":
                dense = t["then contiguous"]
                cells[3:] = [f"{dense * unit:.3f}", f"{pe / dense:.2f}"]
            rows.append([case.name, label, *cells])
    print(f"\n{run_header()}; {a.repeats} repeats after {a.warmup} warm-ups, medians; "
          "same view, values and output checked for every row\n")  # fmt: skip
    header = ["reorder", "stage", "transpose", "permute", "permute / transpose",
              "contiguous input", "permute / contiguous"]  # fmt: skip
    print(markdown_table(header, rows))


# ---------------------------------------------------------------------------- inference

MODES = ("plain", "no_grad", "inference_mode")


def forward_in(mode: str, model: nn.Module, x: Tensor) -> Tensor:
    """``model(x)`` plainly, under ``torch.no_grad()`` or under ``torch.inference_mode()``."""
    if mode == "plain":
        return model(x)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        return model(x)


def inference_models(hidden: int = 64, seed: int = 0) -> dict[str, nn.Module]:
    """Conv4 as trained (parameters require grad, transductive batch norm) and the deploy
    model adapted from it on a random 5-way 1-shot support set (``norm="support"``)."""
    torch.manual_seed(seed)
    conv4 = Conv4(ways=5, hidden=hidden)
    support_x, support_y = torch.rand(5, 1, 28, 28), torch.arange(5)
    learner = MAML(conv4)
    params = adapt_to_support(learner, support_x, support_y, steps=10)
    return {"Conv4": conv4, "adapted (deploy)": adapted_model(learner, params, support_x=support_x)}


def time_modes(model: nn.Module, x: Tensor, repeats: int, warmup: int, calls: int) -> dict:
    """Median CPU seconds per forward of ``model(x)`` in each of `MODES`."""

    def run(mode: str) -> Callable[[], None]:
        def calls_of() -> None:
            for _ in range(calls):
                forward_in(mode, model, x)

        return calls_of

    times = time_round_robin({m: run(m) for m in MODES}, repeats, warmup, "cpu", time.process_time,
                             collect=True)  # fmt: skip
    return {m: statistics.median(v) / calls for m, v in times.items()}


def inference_tensor_errors() -> dict[str, str]:
    """What a tensor made under ``inference_mode`` refuses later, outside it: each
    attempt's error message (a no_grad tensor does all three)."""
    w = torch.randn(3, 3, requires_grad=True)
    with torch.inference_mode():
        y = torch.randn(2, 3) @ torch.randn(3, 3)
    attempts = {
        "saved for backward (y @ w, w requires grad)": lambda: (y @ w).sum().backward(),
        "in-place update (y.add_(1))": lambda: y.add_(1),
        "version counter (y._version)": lambda: y._version,
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "(no error)"
        except RuntimeError as e:
            out[name] = str(e).split(".")[0]  # its first sentence
    return out


def memory_mb(model: nn.Module, x: Tensor) -> list[float]:
    """MB held while the output of one ``model(x)`` is kept (`benchtools.retained_bytes`),
    then the call's peak tensor MB (`benchtools.peak_memory_bytes`), in each of `MODES`."""
    calls = [lambda m=m: forward_in(m, model, x) for m in MODES]
    held = [retained_bytes(call)[1] / 2**20 for call in calls]
    return held + [peak_memory_bytes(call, "cpu") / 2**20 for call in calls]


def run_inference(a: Args) -> None:
    rows, memory = [], []
    for name, model in inference_models().items():
        for batch, calls in ((1, a.small_batch_calls), (80, 1)):
            x = torch.rand(batch, 1, 28, 28)
            outs = [forward_in(m, model, x) for m in MODES]
            if not all(torch.equal(outs[0], o) for o in outs[1:]):
                raise AssertionError(f"{name} at batch {batch}: the modes' outputs differ")
            t = time_modes(model, x, a.repeats, a.warmup, calls)
            ms = [f"{t[m] * 1e3:.3f}" for m in MODES]
            ratios = [t["no_grad"] / t["plain"], t["inference_mode"] / t["no_grad"]]
            rows.append([name, str(batch), *ms, *(f"{r:.3f}" for r in ratios)])
            memory.append([name, str(batch), *(f"{v:.2f}" for v in memory_mb(model, x))])
    print(f"\n{run_header()}; {a.repeats} repeats after {a.warmup} warm-ups, medians; "
          f"batch 1 timed over {a.small_batch_calls} calls per repeat; outputs equal in all "
          "modes (checked)\n")  # fmt: skip
    ratios = ["no_grad / plain", "inference_mode / no_grad"]
    print(markdown_table(["model", "batch", *(f"{m} ms" for m in MODES), *ratios], rows))
    held, peak = [f"held MB, {m}" for m in MODES], [f"peak MB, {m}" for m in MODES]
    print("\n" + markdown_table(["model", "batch", *held, *peak], memory))
    print("\nAn inference_mode output used outside inference_mode:")
    for what, message in inference_tensor_errors().items():
        print(f"* {what}: {message}")


# --------------------------------------------------------------------------- contiguity


def transposed(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    """A tensor of ``shape`` whose last two dimensions are a transposed view (strides swapped)."""
    *lead, h, w = shape
    return torch.randn(*lead, w, h, generator=torch.Generator().manual_seed(seed)).transpose(-1, -2)


def view_raises(x: Tensor) -> bool:
    """Whether ``x.view(-1)`` raises (it does when the strides cannot be flattened)."""
    try:
        x.view(-1)
    except RuntimeError:
        return True
    return False


def reshape_copies(x: Tensor) -> bool:
    """Whether ``x.reshape(-1)`` copied (a new storage) rather than returned a view."""
    return x.reshape(-1).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def repeated(fn: Callable[[], object], n: int) -> Callable[[], None]:
    """``fn`` called ``n`` times: one timed sample of an op under a millisecond."""

    def run() -> None:
        for _ in range(n):
            fn()

    return run


def conv4_fwd_bwd(x: Tensor, copy: bool = False) -> Callable[[], None]:
    """Forward + backward of MAML's Omniglot Conv4 on images ``x`` ``[N, 1, 28, 28]``;
    ``copy=True`` makes the input contiguous inside each call (the fix, timed with it)."""
    model, y = omniglot_conv4(torch.float32, seed=0), torch.arange(x.shape[0]) % 5

    def run() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.contiguous() if copy else x), y).backward()

    return run


def contiguity_ops(scale: int) -> dict[str, tuple[Tensor, Callable[[Tensor], object] | None]]:
    """op name -> (transposed input, op) at Conv4's shapes (``scale`` 1) or tiny ones."""
    n, hidden, d = (80, 64, 1024) if scale == 1 else (4, 8, 16)
    act = transposed((n, hidden, 14, 14))
    weight, other = torch.randn(hidden, hidden, 3, 3), torch.randn(act.shape)
    matrix = torch.randn(d, d)
    return {
        "conv2d 3x3/2 (block 2)": (act, lambda x: F.conv2d(x, weight, stride=2, padding=1)),
        "matmul (left transposed)": (transposed((d, d), 2), lambda a: a @ matrix),
        "add (other operand contiguous)": (act, lambda x: x + other),
        "relu": (act, torch.relu),
        "sum over N,H,W (batch norm's)": (act, lambda x: x.sum((0, 2, 3))),
        "sum over last dim": (act, lambda x: x.sum(-1)),
        "Conv4 forward+backward": (transposed((n, 1, 28, 28), 1), None),
    }


def run_contiguity(a: Args) -> None:
    x = transposed((80, 64, 14, 14))
    checks = {"x.view(-1) raises": view_raises(x), "x.reshape(-1) copies": reshape_copies(x),
              "contiguous copy's reshape copies": reshape_copies(x.contiguous())}  # fmt: skip
    rows = []
    for name, (x_t, op) in contiguity_ops(a.scale).items():
        x_c = x_t.contiguous()
        if op is None:
            fns = {"contiguous": conv4_fwd_bwd(x_c), "transposed": conv4_fwd_bwd(x_t),
                   "copy+op": conv4_fwd_bwd(x_t, copy=True)}  # fmt: skip
            calls = 1
        else:
            fns = {
                "contiguous": lambda op=op, x=x_c: op(x),
                "transposed": lambda op=op, x=x_t: op(x),
                "copy+op": lambda op=op, x=x_t: op(x.contiguous()),
                # Control: the same fresh allocation and copy, from a contiguous source.
                "clone+op": lambda op=op, x=x_c: op(x.clone()),
                "copy alone": lambda x=x_t: x.contiguous(),
            }
            calls = 10
        timed = {k: repeated(f, calls) for k, f in fns.items()}
        times = time_round_robin(timed, a.repeats, a.warmup, "cpu", time.process_time, collect=True)
        ms = {k: statistics.median(t) * 1e3 / calls for k, t in times.items()}
        c = ms["contiguous"]
        rows.append([name, "x".join(map(str, x_t.shape)), f"{c:.3f}", f"{ms['transposed']:.3f}",
                     f"{ms['transposed'] / c:.2f}", f"{ms['copy alone']:.3f}" if "copy alone" in ms
                     else "(inside)", f"{ms['copy+op'] / c:.2f}",
                     f"{ms['clone+op'] / c:.2f}" if "clone+op" in ms else ""])  # fmt: skip
    print(f"\n{run_header()}; {a.repeats} repeats after {a.warmup} warm-ups, medians; ops under "
          "a millisecond timed over 10 calls per sample\n")  # fmt: skip
    header = ["op", "input", "contiguous ms", "transposed ms", "ratio", "`.contiguous()` ms",
              "copy+op ratio", "clone+op ratio"]  # fmt: skip
    print(markdown_table(header, rows))
    print(f"\nchecks on a transposed [80, 64, 14, 14]: {checks}")


# ------------------------------------------------------------------------------- sparse

DENSITIES = (0.001, 0.01, 0.1, 0.5)


def random_sparse(n: int, density: float, seed: int = 0) -> Tensor:
    """A dense ``[n, n]`` float32 matrix with about ``density * n * n`` non-zeros."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n, generator=g) * (torch.rand(n, n, generator=g) < density)


def sparse_formats(dense: Tensor) -> dict[str, Tensor]:
    """The same matrix as ``dense``, ``COO`` (coalesced) and ``CSR``."""
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = dense.to_sparse_csr()
    return {"dense": dense, "COO": dense.to_sparse_coo().coalesce(), "CSR": csr}


def storage_bytes(t: Tensor) -> int:
    """Bytes held by the tensor's own buffers (values plus any index arrays)."""
    if t.layout == torch.sparse_coo:
        parts = [t.indices(), t.values()]
    elif t.layout == torch.sparse_csr:
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    else:
        parts = [t]
    return sum(p.numel() * p.element_size() for p in parts)


def sparse_matmul(m: Tensor, rhs: Tensor) -> Tensor:
    """``m @ rhs`` for any of the three layouts (``torch.sparse.mm`` for COO)."""
    return torch.sparse.mm(m, rhs) if m.layout == torch.sparse_coo else m @ rhs


def run_sparse(a: Args) -> None:
    n, k = (4096, 64) if a.scale == 1 else (256, 8)
    rhs = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    rows = []
    for density in DENSITIES:
        mats = sparse_formats(random_sparse(n, density))
        products = {name: sparse_matmul(m, rhs) for name, m in mats.items()}
        scale = products["dense"].abs().max()
        for name in ("COO", "CSR"):  # float32 sums in another order: relative to the largest
            if (products[name] - products["dense"]).abs().max() > 1e-5 * scale:
                raise AssertionError(f"density {density}: the {name} product differs from dense")
        fns = {name: lambda m=m: sparse_matmul(m, rhs) for name, m in mats.items()}
        times = time_round_robin(fns, a.repeats, a.warmup, "cpu", time.process_time, collect=True)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        mb = [f"{storage_bytes(m) / 2**20:.1f}" for m in mats.values()]
        ratios = [f"{ms['dense'] / ms['COO']:.2f}", f"{ms['dense'] / ms['CSR']:.2f}"]
        rows.append([f"{100 * density:g}%", *mb, *(f"{v:.2f}" for v in ms.values()), *ratios])
    print(f"\n{run_header()}; [{n}, {n}] sparse x [{n}, {k}] dense, float32, {a.repeats} "
          f"repeats after {a.warmup} warm-ups, medians; products = dense (checked)\n")  # fmt: skip
    header = ["density", "dense MB", "COO MB", "CSR MB", "dense ms", "COO ms", "CSR ms",
              "dense / COO time", "dense / CSR time"]  # fmt: skip
    print(markdown_table(header, rows))


# ------------------------------------------------------------------------------- branch

BRANCHES = {"none skipped": (False, False), "block 2 skipped": (False, True),
            "both skipped": (True, True)}  # fmt: skip


class Residual(nn.Module):
    """``body(x) + x``: a `DynamicBlock` with its branch taken away."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + x


def branch_fns(net: nn.Module, x: Tensor, tasks: list[Task]) -> dict[str, dict]:
    """The timed calls: ``forward`` of ``x`` per branch (and the same layers with no branch,
    ``nn.Sequential``), ``adapt+predict`` (MAML's ``evaluate``, 1 inner step) per branch."""
    static = nn.Sequential(net.stem, *(Residual(b.body) for b in net.blocks), net.head)
    forward = {"static `nn.Sequential` (no branch)": lambda: static(x)}
    forward |= {name: lambda s=s: net(x, skip=s) for name, s in BRANCHES.items()}
    learner, half = MAML(net, inner_lr=0.4, inner_steps=1), len(tasks) // 2
    skips = {name: [s] * len(tasks) for name, s in BRANCHES.items()}
    skips["mixed (half none, half both)"] = [BRANCHES["none skipped"]] * half + [
        BRANCHES["both skipped"]] * (len(tasks) - half)  # fmt: skip
    evaluate = {}
    for name, flags in skips.items():
        branched = [dataclasses.replace(t, model_kwargs={"skip": f}) for t, f in zip(tasks, flags)]
        evaluate[name] = lambda t=branched: learner.evaluate(t)
    return {"forward": forward, "adapt+predict": evaluate}


def run_branch(a: Args) -> None:
    hidden, batch, n_tasks = (64, 80, 16) if a.scale == 1 else (8, 10, 4)
    torch.manual_seed(0)
    net = dynamic_conv(in_channels=1, ways=5, hidden=hidden, depth=2).eval()
    x = torch.rand(batch, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    flops = {}
    for name, skip in BRANCHES.items():
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net(x, skip=skip)
        flops[name] = counter.get_total_flops()
    tasks = omniglot_tasks(Setting(5, False), n_tasks, torch.float32, seed=0)
    ms = {}
    for kind, fns in branch_fns(net, x, tasks).items():
        with torch.no_grad():
            times = time_round_robin(fns, a.repeats, a.warmup, "cpu", time.process_time, True)
        ms[kind] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    rows = []
    for name in ms["forward"] | ms["adapt+predict"]:
        saved = f"{100 * (1 - flops[name] / flops['none skipped']):.0f}%" if name in flops else ""
        cells = [name, saved]
        for kind_ms in ms.values():
            base = kind_ms["none skipped"]
            cells += ([f"{kind_ms[name]:.1f}", f"{100 * (1 - kind_ms[name] / base):.0f}%"]
                      if name in kind_ms else ["", ""])  # fmt: skip
        rows.append(cells)
    print(f"\n{run_header()}; dynamic_conv(hidden={hidden}), {a.repeats} repeats after "
          f"{a.warmup} warm-ups, medians\n")  # fmt: skip
    header = ["branch", "FLOPs saved (forward)", f"forward of {batch} ms", "time saved",
              f"adapt+predict, {n_tasks} tasks ms", "time saved"]  # fmt: skip
    print(markdown_table(header, rows))


# --------------------------------------------------------------------------------- main


@dataclasses.dataclass
class Args:
    """Arguments of bench_claims.py (each is a --flag; see --help)."""

    only: tyro.conf.UseAppendAction[tuple[Section, ...]] = ()
    """A section to run; repeatable (default: all)."""
    threads: int = 1
    """Torch threads."""
    repeats: int = 21
    """Timed repeats (permute, inference)."""
    warmup: int = 3
    """Untimed rounds first."""
    view_calls: int = 1000
    """View calls per timed sample."""
    small_batch_calls: int = 20
    """Batch-1 forwards per timed sample."""
    data_root: str | None = None
    """Omniglot's folder (default: $METALEARN_DATA)."""
    train_steps: int = 300
    """Meta-steps of each model (dynamic)."""
    meta_batch: int = 16
    """Tasks per meta-step (dynamic)."""
    skip_prob: float = 0.5
    """Each block's skip chance in the second model (0: no second model)."""
    test_tasks: int = 600
    """Test tasks (dynamic)."""
    eval_steps: int = 10
    """Inner steps at test (dynamic)."""
    hidden: int = 64
    """Channels of the networks."""
    scale: Literal[0, 1] = 1
    """contiguity, sparse, branch: 1 the documented sizes, 0 tiny ones."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    a = parse_args_as(Args, argv, __doc__)
    counts = (a.threads, a.repeats, a.view_calls, a.small_batch_calls, a.train_steps,
              a.meta_batch, a.test_tasks, a.hidden)  # fmt: skip
    if min(counts) < 1 or a.warmup < 0 or a.eval_steps < 0:
        usage_error("counts must be at least 1 (--warmup and --eval-steps at least 0)")
    if not 0 <= a.skip_prob < 1:
        usage_error(f"--skip-prob {a.skip_prob}: must be in [0, 1)")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    runs = {"contiguity": run_contiguity, "sparse": run_sparse, "branch": run_branch,
            "dynamic": run_dynamic, "permute": run_permute, "inference": run_inference}  # fmt: skip
    for section in a.only or SECTIONS:
        print(f"## {section}", flush=True)
        runs[section](a)
        print(flush=True)


if __name__ == "__main__":
    main()
