"""Benchmark a MAML meta-step: metalearn (loop, vmap, auto) against learn2learn, higher and
TorchOpt.

What: the time of one full meta-step (meta-gradient of a meta-batch + Adam update) for
MAML's Omniglot network (`metalearn.models.Conv4`, stride 2, 5-way, 112k parameters) on
Omniglot-shaped random data (1x28x28): 32 tasks, 5-way 1-shot, one inner step, inner
learning rate 0.4, in four settings (1 or 15 query examples per class x second or first
order). Methods:

* ``loop``, ``vmap``, ``auto``: `metalearn.algorithms.MAML` / `FOMAML` with that
  ``vectorize`` and the default ``chunk_size="auto"``: the meta-batch runs in chunks (one
  task per chunk in the loop; a few tasks per vmapped chunk), one backward per chunk.
* ``whole`` (only when named in ``--methods``): ``auto`` with ``chunk_size=None``, one graph
  for the whole meta-batch and one ``backward`` (the engine before chunking).
* ``learn2learn``: ``l2l.algorithms.MAML`` (``clone`` / ``adapt``), one ``backward`` per
  task, as in learn2learn's Omniglot example.
* ``higher``: ``higher.innerloop_ctx`` with SGD, one ``backward`` per task; first order
  detaches the inner gradient through ``grad_callback`` (higher has no first-order switch
  that keeps the gradient to theta; ``track_higher_grads=False`` cuts it).
* ``torchopt`` (only when named in ``--methods``): TorchOpt's functional optimizer
  (``torchopt.sgd``, or ``torchopt.adam`` with ``--inner-optimizer adam``) on the parameter
  dict through ``torch.func.functional_call``, one ``backward`` per task; first order takes
  the inner gradient without a graph. Its Adam runs with ``eps_root`` the dtype's smallest
  normal number (at ``eps_root = 0`` sqrt's derivative at a zero gradient entry makes the
  meta-gradient NaN; this one changes no update), and each step runs with the network's
  dtype as torch's default (TorchOpt computes Adam's bias correction in the default dtype).
  Its float64 meta-gradient is checked against metalearn's loop before timing.
* ``--inner-optimizer adam``: the same methods with Adam as the inner optimizer
  (`metalearn.optim.Adam` through ``MAML(inner_optimizer="adam")``; higher's
  ``DifferentiableAdam`` from ``torch.optim.Adam``), inner step 0.01, betas (0.9, 0.999),
  eps 1e-8; learn2learn has no differentiable Adam and is skipped. higher adds eps before
  Adam's bias correction, metalearn (as torch.optim.Adam and TorchOpt) after it: with one
  inner step, higher's eps is ``1e-8 * sqrt(1 - beta2)`` so both compute the same update.
  The ratio column and the last line are then against higher.
* ``compile`` (only when named in ``--methods``): ``auto`` under
  `metalearn.algorithms.compiled.CompiledMetaGradient` (the experiments' ``--compile``): each
  vmapped chunk compiled as one graph; minutes of compiling per setting on a CPU.

Every method starts from the same weights and sees the same tasks. By default the baselines
run the network with the fused ``nn.BatchNorm2d(track_running_stats=False)`` (what their
users write, and their faster option here); ``--baseline-norm meta`` gives them the very
module metalearn runs (`MetaBatchNorm`, batch norm from elementary ops; an ``nn.Module``,
so learn2learn's ``clone`` and higher's monkey-patching handle it). Both are the same
transductive batch norm, so the meta-gradients agree (checked in float64).

Timing: methods run round-robin inside each repeat (the starting method rotates), after
``--warmup`` warm-up rounds; the tables give the median over ``--repeats``. Peak memory: a
fresh subprocess per method and setting runs one warm-up meta-step, resets the kernel's
RSS high-water mark (``/proc/self/clear_refs``), runs one more and reports the peak RSS
above the RSS at the start of that step (glibc's mmap threshold is pinned so freed tensors
return to the OS and RSS follows live memory). Linux only.

Command (the baselines live in their own venv, see scripts/install_baselines.sh)::

    .venv-baselines/bin/python scripts/bench_maml.py            # full run, ~15 min on 2 cores
    .venv/bin/python scripts/bench_maml.py --quick              # metalearn only
    .venv-baselines/bin/python scripts/bench_maml.py --threads 1 --clock cpu  # busy machine
    .venv-baselines/bin/python scripts/bench_maml.py --profile vmap:q15-second
    .venv-baselines/bin/python scripts/bench_maml.py --inner-optimizer adam --settings q1-second \
        --methods auto,higher --threads 1    # inner Adam against higher's DifferentiableAdam
    .venv-baselines/bin/python scripts/bench_maml.py --inner-optimizer adam --settings q1-second \
        --methods auto,higher,torchopt       # ... and against TorchOpt's adam

Expected (2 CPU cores): markdown tables of median ms, peak MB and float64 agreement
(relative differences ~1e-14); the last line is ``speedup_vs_learn2learn: X``, metalearn
``auto`` against learn2learn at 1 query per class, second order (``speedup_vs_higher`` with
``--inner-optimizer adam``); when ``torchopt`` runs, ``speedup_vs_torchopt: X`` (the same
ratio against TorchOpt) comes just before it. The measured tables, with
their machine and commit, are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from benchtools import (
    INNER_LR,
    SETTINGS,
    SHOTS,
    WAYS,
    MetaGradient,
    MetaStep,
    Setting,
    learn2learn_gradient,
    markdown_table,
    omniglot_conv4,
    omniglot_tasks,
    parse_args_as,
    parse_setting,
    peak_step_mb,
    run_probe,
    sync,
    usage_error,
)
from torch import Tensor, nn

from metalearn import tune_malloc
from metalearn.algorithms import FOMAML, MAML
from metalearn.algorithms.compiled import CompiledMetaGradient
from metalearn.engine import ChunkSize, InnerLoop, Task, plan

OUTER_LR = 1e-3
METHODS = ("loop", "vmap", "auto", "learn2learn", "higher")
OPTIONAL_METHODS = ("whole", "compile", "torchopt")
"""Run only when named in ``--methods``: ``compile`` spends minutes compiling per setting;
``torchopt`` keeps the default run's tables as they were."""
BASELINES = {"learn2learn": "learn2learn", "higher": "higher", "torchopt": "torchopt"}
"""Method -> the module it imports."""
FLOAT64_TOLERANCE = 1e-9
"""Max relative difference of a float64 meta-gradient from metalearn's loop to call it equal."""
SPREAD_FACTOR = 10
"""`verify_before_timing` also accepts a difference within this many times metalearn's own
vmap-vs-loop difference."""


ADAM = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
"""The inner Adam of ``--inner-optimizer adam``."""

HEADLINE = "q1-second"
"""The setting of the last line's speedup."""


@dataclass
class BenchArgs:
    """Command-line arguments of the benchmark (each is a --flag; see --help)."""

    repeats: int = 15
    """Timed rounds; each times every method once. Tables report the median."""
    warmup: int = 3
    """Untimed rounds before timing (allocator, oneDNN and autograd caches warm up)."""
    settings: list[str] = field(default_factory=lambda: list(SETTINGS))
    """Which workloads to run: ``q<query per class>-<first|second>`` (see `parse_setting`),
    comma- or space-separated."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """Which methods to run, comma- or space-separated; a baseline that is not installed is
    skipped with a message."""
    tasks: int = 32
    """Tasks per meta-batch."""
    float64_check: bool = True
    """Compare every method's float64 meta-gradient with metalearn's loop."""
    memory: bool = True
    """Measure peak RSS per method and setting, each in a fresh subprocess."""
    baseline_norm: Literal["fused", "meta"] = "fused"
    """Batch norm of the baselines' network: ``nn.BatchNorm2d`` or metalearn's module."""
    threads: int = 0
    """torch intra-op threads (0: torch's default). On a busy machine use 1: OpenMP threads
    that spin at barriers while a sibling is descheduled made 2-thread steps 10-40x slower."""
    clock: Literal["wall", "cpu"] = "wall"
    """``wall`` (perf_counter) or ``cpu`` (process CPU time: steadier on a shared machine,
    the same as wall on a quiet one with one thread; counts every thread's spinning too)."""
    seed: int = 0
    """Seed of the initial weights and the random tasks."""
    device: str = "cpu"
    """Where the networks and tasks live (``cuda`` for a GPU). On CUDA each timed step ends
    with a synchronize, peak memory is the allocator's (in this process), and malloc tuning
    and page faults concern the host only."""
    malloc: Literal["tuned", "default"] = "tuned"
    """``tuned``: `metalearn.tune_malloc` before timing, as the experiments do (process-wide,
    so every method, baselines included, runs on it); ``default``: glibc's own thresholds,
    under which large freed tensors go back to the kernel and cost page faults next step."""
    profile: str = ""
    """``METHOD:SETTING``: print the top ops of that meta-step (torch.profiler) and exit."""
    inner_optimizer: Literal["sgd", "adam"] = "sgd"
    """The inner loop's optimizer: MAML's SGD, or Adam (metalearn.optim against higher's
    DifferentiableAdam; learn2learn has none)."""
    quick: bool = False
    """3 repeats, 1 warm-up, no memory (over --repeats, --warmup and --memory)."""
    probe_memory: str = ""
    """Internal: ``METHOD:SETTING`` measured in this (fresh) process; prints one JSON line."""


# ---------------------------------------------------------------------------- methods


def inner_settings(inner_optimizer: str) -> dict[str, object]:
    """The learner's inner-loop arguments for ``--inner-optimizer``."""
    if inner_optimizer == "sgd":
        return {"inner_lr": INNER_LR}
    return {"inner_lr": ADAM["lr"], "inner_optimizer": "adam", "inner_beta1": ADAM["beta1"],
            "inner_beta2": ADAM["beta2"], "inner_eps": ADAM["eps"]}  # fmt: skip


def metalearn_gradient(
    model: nn.Module,
    setting: Setting,
    vectorize: str,
    chunk_size: ChunkSize = "auto",
    inner_optimizer: str = "sgd",
) -> MetaGradient:
    cls = FOMAML if setting.first_order else MAML
    # adapt_norm: the baselines' MAML adapts every parameter, batch norm's included.
    learner = cls(
        model, inner_steps=1, vectorize=vectorize, chunk_size=chunk_size, adapt_norm=True,
        **inner_settings(inner_optimizer),
    )  # fmt: skip

    def run(tasks: Sequence[Task]) -> None:
        learner.backward(tasks)  # mean query loss over tasks, one backward per chunk

    return run


def higher_gradient(
    model: nn.Module, setting: Setting, inner_optimizer: str = "sgd"
) -> MetaGradient:
    import higher

    if inner_optimizer == "adam":
        # higher's eps is added before the bias correction: at step 1 it is metalearn's
        # (torch.optim.Adam's) eps times sqrt(1 - beta2), which makes the updates equal.
        eps = ADAM["eps"] * (1 - ADAM["beta2"]) ** 0.5
        inner_opt: torch.optim.Optimizer = torch.optim.Adam(
            model.parameters(), lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=eps
        )
    else:
        inner_opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)

    def detach(grads: list[Tensor]) -> list[Tensor]:
        return [g.detach() for g in grads]  # FOMAML: the inner gradient is a constant

    callback = detach if setting.first_order else None

    def run(tasks: Sequence[Task]) -> None:
        for task in tasks:
            with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (f, opt):
                opt.step(
                    F.cross_entropy(f(task.support[0]), task.support[1]), grad_callback=callback
                )
                loss = F.cross_entropy(f(task.query[0]), task.query[1])
                (loss / len(tasks)).backward()

    return run


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside the block, restored after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def torchopt_gradient(
    model: nn.Module, setting: Setting, inner_optimizer: str = "sgd"
) -> MetaGradient:
    """TorchOpt's functional optimizer on the parameter dict, one ``backward`` per task."""
    import torchopt
    from torch.func import functional_call

    dtype = next(model.parameters()).dtype
    if inner_optimizer == "adam":
        # eps after the bias correction, as metalearn's; eps_root the smallest normal number,
        # so that sqrt is differentiable at a zero gradient entry and no v_hat changes.
        optimizer = torchopt.adam(
            lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
            eps_root=torch.finfo(dtype).tiny,
        )  # fmt: skip
    else:
        optimizer = torchopt.sgd(lr=INNER_LR)
    theta = dict(model.named_parameters())

    def task_loss(params: dict[str, Tensor], split: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(functional_call(model, params, split[0]), split[1])

    def run(tasks: Sequence[Task]) -> None:
        # TorchOpt builds Adam's bias correction in the default dtype: the network's here.
        with default_dtype(dtype):
            for task in tasks:
                grads = torch.autograd.grad(task_loss(theta, task.support), list(theta.values()),
                                            create_graph=not setting.first_order)  # fmt: skip
                updates, _ = optimizer.update(
                    dict(zip(theta, grads)), optimizer.init(theta), inplace=False
                )
                params = torchopt.apply_updates(theta, updates, inplace=False)
                (task_loss(params, task.query) / len(tasks)).backward()

    return run


def compiled_gradient(
    model: nn.Module, setting: Setting, inner_optimizer: str = "sgd"
) -> MetaGradient:
    """``auto``'s learner under ``--compile``
    (`metalearn.algorithms.compiled.CompiledMetaGradient`).

    Each vmapped chunk of the plan (its meta-loss, inner gradient included, and AOTAutograd's
    backward) is one compiled graph. Each chunk size compiles on its first call (minutes on
    2 cores): keep ``--warmup``.
    """
    cls = FOMAML if setting.first_order else MAML
    learner = cls(model, inner_steps=1, adapt_norm=True, **inner_settings(inner_optimizer))
    return CompiledMetaGradient(learner)


def make_gradient(
    method: str, model: nn.Module, setting: Setting, inner_optimizer: str = "sgd"
) -> MetaGradient:
    if method in ("loop", "vmap", "auto"):
        return metalearn_gradient(model, setting, method, inner_optimizer=inner_optimizer)
    if method == "whole":
        return metalearn_gradient(model, setting, "auto", None, inner_optimizer)
    if method == "compile":
        return compiled_gradient(model, setting, inner_optimizer)
    if method == "learn2learn":
        return learn2learn_gradient(model, setting)
    if method == "higher":
        return higher_gradient(model, setting, inner_optimizer)
    if method == "torchopt":
        return torchopt_gradient(model, setting, inner_optimizer)
    names = ", ".join(METHODS + OPTIONAL_METHODS)
    raise ValueError(f"unknown method {method!r}; choose from {names}")


def make_step(method: str, setting: Setting, dtype: torch.dtype, args: BenchArgs) -> MetaStep:
    norm = args.baseline_norm if method in BASELINES else "meta"
    model = omniglot_conv4(dtype, args.seed, norm, args.device)
    opt = torch.optim.Adam(model.parameters(), lr=OUTER_LR)
    return MetaStep(model, make_gradient(method, model, setting, args.inner_optimizer), opt)


def available(methods: Sequence[str], inner_optimizer: str = "sgd") -> list[str]:
    """The methods whose package imports; says which baselines are skipped and why."""
    kept = []
    for method in methods:
        if method not in METHODS + OPTIONAL_METHODS:
            names = ", ".join(METHODS + OPTIONAL_METHODS)
            raise ValueError(f"unknown method {method!r} in --methods; choose from {names}")
        if method == "learn2learn" and inner_optimizer != "sgd":
            print(f"skipping learn2learn: it has no differentiable {inner_optimizer}")
            continue
        if method in BASELINES:
            try:
                __import__(BASELINES[method])
            except ImportError as error:
                print(
                    f"skipping {method}: not installed in {sys.executable} ({error}); "
                    "run `bash scripts/install_baselines.sh` and use .venv-baselines/bin/python"
                )
                continue
        kept.append(method)
    return kept


# ---------------------------------------------------------------------------- measurements


@dataclass
class Timings:
    """One setting's timed meta-steps."""

    seconds: dict[str, list[float]]
    """Per method, one entry per timed repeat."""
    faults: dict[str, list[int]]
    """Per method, the process's minor page faults during each timed step (getrusage)."""
    auto_plan: str
    """What ``auto`` ran (see `auto_plan`)."""


def time_methods(methods: Sequence[str], setting: Setting, args: BenchArgs) -> Timings:
    """Seconds and page faults per meta-step for each method, interleaved round-robin."""
    tasks = omniglot_tasks(setting, args.tasks, torch.float32, args.seed, args.device)
    steps = {m: make_step(m, setting, torch.float32, args) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    faults: dict[str, list[int]] = {m: [] for m in methods}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for r in range(args.warmup + args.repeats):
        order = list(methods[r % len(methods) :]) + list(methods[: r % len(methods)])
        for method in order:
            gc.collect()
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = clock()
            steps[method](tasks)
            sync(args.device)  # CUDA runs asynchronously: wait for the step's kernels
            if r >= args.warmup:
                times[method].append(clock() - start)
                faults[method].append(
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
                )
    return Timings(times, faults, auto_plan(tasks, setting, args))


def paired_ratios(timed: Timings, numerator: str, denominator: str) -> list[float]:
    """``numerator / denominator`` time in each round: both ran back to back, so a slow spell
    of the machine that spans a round cancels out of its ratio."""
    return [a / b for a, b in zip(timed.seconds[numerator], timed.seconds[denominator])]


def middle_half(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (both the value itself when only one)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def auto_plan(tasks: Sequence[Task], setting: Setting, args: BenchArgs) -> str:
    """What ``auto`` runs, e.g. ``"vmap, 4x8"`` (4 chunks of 8 tasks) or ``"loop, 32x1"``."""
    model = omniglot_conv4(torch.float32, args.seed)
    inner = InnerLoop(steps=1, lr=INNER_LR, first_order=setting.first_order)
    chunks = plan(model, tasks, inner, "auto")
    return f"{chunks[0].mode}, {len(chunks)}x{len(chunks[0].tasks)}"


def float64_gradients(method: str, setting: Setting, args: BenchArgs) -> dict[str, Tensor]:
    step = make_step(method, setting, torch.float64, args)
    step.gradient(omniglot_tasks(setting, args.tasks, torch.float64, args.seed, args.device))
    return {n: p.grad.detach().clone() for n, p in step.model.named_parameters()}


def max_relative_difference(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    """``max|g - ref| / max|ref|`` over all parameters together.

    Not per tensor: the conv biases feed a batch norm, which cancels them, so their exact
    meta-gradient is 0 and any rounding would read as a relative difference of order 1.
    """
    error = max(float((grads[n] - ref).abs().max()) for n, ref in reference.items())
    return error / max(float(ref.abs().max()) for ref in reference.values())


def probe_memory(method: str, setting: Setting, args: BenchArgs) -> float:
    """Peak memory above the start of one warmed-up meta-step, MB (this process)."""
    tasks = omniglot_tasks(setting, args.tasks, torch.float32, args.seed, args.device)
    step = make_step(method, setting, torch.float32, args)
    return peak_step_mb(lambda: step(tasks), args.device)


def device_name(args: BenchArgs) -> str:
    """``cpu`` or the GPU's name, for the report's header."""
    device = torch.device(args.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def memory_in_subprocess(method: str, setting: Setting, args: BenchArgs) -> float | None:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--probe-memory", f"{method}:{setting.name}",
        "--tasks", str(args.tasks), "--baseline-norm", args.baseline_norm,
        "--threads", str(args.threads), "--seed", str(args.seed), "--device", args.device,
        "--inner-optimizer", args.inner_optimizer,
    ]  # fmt: skip
    return run_memory_probe(cmd, f"{method} {setting.name}")


def run_memory_probe(cmd: list[str], label: str) -> float | None:
    """Run a ``--probe-memory`` command in a fresh process; its peak MB, or None (said why)."""
    record, out = run_probe(cmd)
    if record is None:
        print(f"memory probe of {label} failed:\n{out.stderr[-2000:]}")
        return None
    return record["peak_mb"]


def profile_step(method: str, setting: Setting, args: BenchArgs, rows: int = 25) -> None:
    """Print the ops that take the most self CPU time in one warmed-up meta-step."""
    tasks = omniglot_tasks(setting, args.tasks, torch.float32, args.seed, args.device)
    step = make_step(method, setting, torch.float32, args)
    for _ in range(max(args.warmup, 1)):
        step(tasks)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(tasks)
    print(f"## profile: {method}, {setting.name}\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


# ---------------------------------------------------------------------------- reporting


def baseline_of(args: BenchArgs) -> str:
    """The baseline the ratio column and the last line compare ``auto`` with."""
    return "learn2learn" if args.inner_optimizer == "sgd" else "higher"


def headline(
    medians: dict[str, dict[str, float]], methods: Sequence[str], baseline: str = "learn2learn"
) -> str:
    if baseline == "higher":
        if "higher" not in methods or HEADLINE not in medians or "auto" not in methods:
            return f"speedup_vs_higher: n/a (needs higher, setting {HEADLINE} and method auto)"
        return f"speedup_vs_higher: {medians[HEADLINE]['higher'] / medians[HEADLINE]['auto']:.2f}"
    if "learn2learn" not in methods:
        missing = importlib.util.find_spec("learn2learn") is None
        return f"speedup_vs_learn2learn: n/a (learn2learn not {'installed' if missing else 'run'})"
    if HEADLINE not in medians or "auto" not in methods:
        return f"speedup_vs_learn2learn: n/a (needs setting {HEADLINE} and method auto)"
    row = medians[HEADLINE]
    return f"speedup_vs_learn2learn: {row['learn2learn'] / row['auto']:.2f}"


def torchopt_headline(medians: dict[str, dict[str, float]], methods: Sequence[str]) -> str:
    """``speedup_vs_torchopt: X``, ``auto`` against TorchOpt in setting `HEADLINE`."""
    if HEADLINE not in medians or "auto" not in methods:
        return f"speedup_vs_torchopt: n/a (needs setting {HEADLINE} and method auto)"
    return f"speedup_vs_torchopt: {medians[HEADLINE]['torchopt'] / medians[HEADLINE]['auto']:.2f}"


def verify_before_timing(method: str, settings: dict[str, Setting], args: BenchArgs) -> None:
    """Stop unless ``method``'s float64 meta-gradient equals metalearn's loop's in each setting.

    Equal: a relative difference (`max_relative_difference`) within `FLOAT64_TOLERANCE`, or
    within `SPREAD_FACTOR` times metalearn's own vmap-vs-loop difference where that is
    larger: inner Adam divides each gradient entry by its magnitude, so its meta-gradient
    amplifies the rounding of entries near zero (the conv biases a batch norm cancels), and
    two correct computations differ by about 1e-9 there. A method that computes something
    else is not timed.
    """
    for name, setting in settings.items():
        reference = float64_gradients("loop", setting, args)
        diff = max_relative_difference(float64_gradients(method, setting, args), reference)
        own = max_relative_difference(float64_gradients("vmap", setting, args), reference)
        allowed = max(FLOAT64_TOLERANCE, SPREAD_FACTOR * own)
        print(
            f"{method} verified before timing, {name}: float64 meta-gradient vs metalearn loop "
            f"{diff:.1e} (metalearn vmap vs loop {own:.1e}; allowed {allowed:.1e})"
        )
        if not diff <= allowed:
            raise SystemExit(
                f"{method} disagrees with metalearn in {name}: {diff:.1e} > {allowed:.1e}"
            )


def main(args: BenchArgs) -> str:
    """Run the benchmark, print the tables; returns the last line (the headline)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA GPU; use --device cpu")
    settings = {name: parse_setting(name) for name in args.settings}
    if args.probe_memory:
        method, name = args.probe_memory.split(":")
        print(json.dumps({"peak_mb": probe_memory(method, parse_setting(name), args)}))
        return ""
    # Not in the memory probe above: it pins its own thresholds so RSS follows live memory.
    malloc = tune_malloc().reason if args.malloc == "tuned" else "glibc defaults"
    if args.profile:
        method, name = args.profile.split(":")
        profile_step(method, parse_setting(name), args)
        return ""
    methods = available(args.methods, args.inner_optimizer)
    inner = f"inner lr {INNER_LR}" if args.inner_optimizer == "sgd" else f"inner Adam {ADAM}"
    print(
        f"# MAML meta-step, Conv4 (stride 2), {args.tasks} tasks, {WAYS}-way {SHOTS}-shot, "
        f"1 inner step, {inner}\n\ntorch {torch.__version__}, {device_name(args)}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; baselines' batch norm: {args.baseline_norm}; "
        f"{args.repeats} repeats after {args.warmup} warm-up, interleaved; {args.clock} clock; "
        f"malloc: {malloc}\n"
    )
    if "torchopt" in methods and args.float64_check:
        verify_before_timing("torchopt", settings, args)
    medians = report_times(methods, settings, args)
    if args.memory:
        report_memory(methods, settings, args)
    if args.float64_check:
        report_float64(methods, settings, args)
    if "torchopt" in methods:
        print(torchopt_headline(medians, methods))
    last = headline(medians, methods, baseline_of(args))
    print(last)
    return last


def report_times(
    methods: Sequence[str], settings: dict[str, Setting], args: BenchArgs
) -> dict[str, dict[str, float]]:
    medians: dict[str, dict[str, float]] = {}
    rows, fault_rows = [], []
    for name, setting in settings.items():
        timed = time_methods(methods, setting, args)
        medians[name] = {m: statistics.median(t) for m, t in timed.seconds.items()}
        cells = [f"{1e3 * medians[name][m]:.0f}" for m in methods]
        ratio, base = "-", baseline_of(args)
        if "auto" in methods and base in methods:
            low, high = middle_half(paired_ratios(timed, base, "auto"))
            ratio = f"{medians[name][base] / medians[name]['auto']:.2f}x"
            ratio += f" ({low:.2f}-{high:.2f})"
        rows.append([name, *cells, timed.auto_plan, ratio])
        fault_rows.append([name, *(f"{statistics.median(timed.faults[m]):.0f}" for m in methods)])
        print(
            f"timed {name}: " + ", ".join(f"{m} {c} ms" for m, c in zip(methods, cells)), flush=True
        )
    print(f"\n## Meta-step time, median ms ({args.clock} clock)\n")
    ratio_header = f"{baseline_of(args)} / auto (rounds' middle half)"
    print(markdown_table(["setting", *methods, "auto ran", ratio_header], rows) + "\n")
    print(
        "The ratio is of the medians; in brackets, the quartiles of the per-round ratios (each "
        "round times every method once, back to back), which show this run's noise.\n"
    )
    print(f"## Minor page faults per meta-step, median (malloc: {args.malloc})\n")
    print(markdown_table(["setting", *methods], fault_rows) + "\n")
    return medians


def report_memory(methods: Sequence[str], settings: dict[str, Setting], args: BenchArgs) -> None:
    rows = []
    for name, setting in settings.items():
        peaks = [memory_in_subprocess(m, setting, args) for m in methods]
        rows.append([name, *("failed" if p is None else f"{p:.0f}" for p in peaks)])
    what = "CUDA allocated bytes" if torch.device(args.device).type == "cuda" else "RSS"
    print(f"## Peak memory of a meta-step, MB above the step's starting {what} (fresh process)\n")
    print(markdown_table(["setting", *methods], rows) + "\n")


def report_float64(methods: Sequence[str], settings: dict[str, Setting], args: BenchArgs) -> None:
    rows = []
    for name, setting in settings.items():
        reference = float64_gradients("loop", setting, args)
        diffs = [
            max_relative_difference(float64_gradients(m, setting, args), reference) for m in methods
        ]
        rows.append([name, *(f"{d:.1e}" for d in diffs)])
        if bad := [m for m, d in zip(methods, diffs) if d > FLOAT64_TOLERANCE]:
            print(
                f"WARNING: {name}: {bad} disagree with metalearn's loop beyond {FLOAT64_TOLERANCE}"
            )
    print("## float64 meta-gradient, max relative difference from metalearn loop\n")
    print(markdown_table(["setting", *methods], rows) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> BenchArgs:
    args = parse_args_as(BenchArgs, argv, __doc__)
    args = dataclasses.replace(
        args,
        settings=[name for item in args.settings for name in item.split(",") if name],
        methods=[name for item in args.methods for name in item.split(",") if name],
    )
    if args.quick:
        args = dataclasses.replace(args, repeats=3, warmup=1, memory=False)
    if args.repeats < 1 or args.warmup < 0 or args.tasks < 1 or args.threads < 0:
        usage_error(
            "--repeats and --tasks must be at least 1, --warmup and --threads at least 0, got "
            f"{args.repeats}, {args.tasks}, {args.warmup} and {args.threads}"
        )
    for name in args.settings:
        try:
            parse_setting(name)
        except ValueError as error:
            usage_error(f"--settings: {error}")
    unknown = [m for m in args.methods if m not in METHODS + OPTIONAL_METHODS]
    if unknown:
        usage_error(
            f"--methods: unknown {', '.join(unknown)}; choose from "
            f"{', '.join(METHODS + OPTIONAL_METHODS)}"
        )
    return args


if __name__ == "__main__":
    main(parse_args())
