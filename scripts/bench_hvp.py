"""Benchmark Hessian-vector products against one gradient, and dense Hessians against HVPs.

What: part 1 times, on the library's real code path, one gradient (``torch.func.grad`` of
the loss) and one H v with each of `metalearn.HVP_METHODS` (``metalearn.hvp``), plus
`metalearn.hvp_double_backward` on a loss computed by the module itself (its time includes
that forward pass, as the functional methods' times include theirs), for

* ``conv4``: MAML's Omniglot network, `metalearn.models.Conv4` (stride 2, 112,261
  parameters) with its hand-written batch norm (`metalearn.models.batch_norm`);
* ``conv4-fused-bn``: the same network with ``nn.BatchNorm2d(track_running_stats=False)``
  (the fused ``F.batch_norm`` kernel), since the HVP/gradient ratio depends on the form of
  the batch norm;
* ``mlp``: `metalearn.models.MLP` ``(64, [100, 32], 5)``, 9,897 parameters;

each on a batch of 80 random examples (1x28x28 images, or 64 features), 5-way
cross-entropy, float32, with one fixed random direction v. Every method's H v is compared
with forward-over-reverse's (``max|Hv - Hv_ref| / max|Hv_ref|``, float32).

Part 2 compares a dense Hessian (``metalearn.hessian(method="vmap")``, jacfwd of jacrev)
with one HVP on one-hidden-layer MLPs (no batch norm) of growing size n, until the
Hessian's predicted peak memory exceeds ``--max-hessian-gb``; bigger sizes are printed as
"skipped" rows with the memory they would need. The prediction is the larger of the
Hessian itself (n^2 x 4 bytes) and the last measured peak scaled by (n / n_last)^2 (the
vmapped intermediates grow like n x hidden, i.e. like n^2 here).

Timing: inside each repeat the methods of a case run round-robin, after ``--warmup``
warm-up rounds, so drift on a noisy machine hits all of them alike; tables give the median
(and, as a noise check, the minimum) over ``--repeats``, and ratios are medians over the
gradient's median measured in the same run. ``--clock wall`` (default) is
``time.perf_counter``; ``--clock cpu`` is this process's CPU time (``time.process_time``,
all threads), steadier when other jobs share the cores.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above the bytes allocated before
the call. On CPU, the same quantity reconstructed from ``torch.profiler`` memory events
(``profile_memory=True``, a separate untimed call): the highest sum of bytes allocated
minus bytes freed through PyTorch's CPU allocator during the call, i.e. the peak of tensor
memory live above what was live before. It leaves out oneDNN's internal scratch buffers,
Python objects and allocator caching, so it is a lower bound on the RSS growth; the times
are measured without the profiler.

Command::

    .venv/bin/python scripts/bench_hvp.py            # full run, about 1-2 min on 2 cores
    .venv/bin/python scripts/bench_hvp.py --quick    # under 30 s
    .venv/bin/python scripts/bench_hvp.py --device cuda --max-hessian-gb 40

Expected output: markdown tables, and as the very last line
``hvp_over_grad: R (double-backward, hvp's default)``, the median time of one HVP by
`hvp`'s default method (`metalearn.second_order.DEFAULT_HVP_METHOD`) over one gradient
for ``conv4`` (metalearn's Conv4 with its own batch norm).

Why about 3x: the floor for any exact H v of this network is set by its convolutions.
H v needs, per conv layer, the forward conv, two tangent convs and four tangent backward
convs on top of the gradient's three (grad wrt weight and input), i.e. 8-9 conv-sized
products against 3; with this net's layer sizes (the first layer has one input channel and
no input gradient) that is 2.6x a gradient at best, 3.0x as PyTorch computes it.
Measured tables and the machine they came from: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from benchtools import parse_args_as, peak_memory_bytes, time_round_robin, usage_error
from torch import Tensor, nn
from torch.func import functional_call, grad

from metalearn import HVP_METHODS, hessian, hvp, hvp_double_backward
from metalearn.models import MLP, Conv4
from metalearn.second_order import DEFAULT_HVP_METHOD

# The method every other HVP's result is checked against and the dense Hessian is timed
# against (the tables' reference). The last line, hvp_over_grad, reports `hvp`'s own
# default (DEFAULT_HVP_METHOD) instead: what a caller of `hvp` pays.
REFERENCE_METHOD = "forward-over-reverse"
BATCH = 80
WAYS = 5


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One network and batch, with everything the methods need."""

    name: str
    description: str
    model: nn.Module
    params: dict[str, Tensor]
    v: dict[str, Tensor]
    x: Tensor
    y: Tensor

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def loss(self, params: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(functional_call(self.model, params, (self.x,)), self.y)

    def methods(self) -> dict[str, Callable[[], object]]:
        module_params = list(self.model.parameters())
        v_list = list(self.v.values())

        def module_grad() -> object:
            loss = F.cross_entropy(self.model(self.x), self.y)
            return torch.autograd.grad(loss, module_params)

        def module_hvp() -> object:
            loss = F.cross_entropy(self.model(self.x), self.y)
            return hvp_double_backward(loss, module_params, v_list)

        fns: dict[str, Callable[[], object]] = {"grad": lambda: grad(self.loss)(self.params)}
        for method in HVP_METHODS:
            fns[f"hvp {method}"] = lambda m=method: hvp(self.loss, self.params, self.v, method=m)
        fns["hvp_double_backward (module)"] = module_hvp
        fns["grad (autograd, module)"] = module_grad
        return fns


def make_case(
    name: str, model: nn.Module, x: Tensor, description: str, device: torch.device
) -> Case:
    gen = torch.Generator().manual_seed(1)
    model = model.to(device)
    params = {k: p.detach() for k, p in model.named_parameters()}
    v = {k: torch.randn(p.shape, generator=gen).to(device) for k, p in params.items()}
    y = torch.randint(0, WAYS, (x.shape[0],), generator=gen).to(device)
    return Case(name, description, model, params, v, x.to(device), y)


def make_cases(device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 1, 28, 28, generator=gen)
    features = torch.randn(BATCH, 64, generator=gen)
    torch.manual_seed(0)
    conv4 = Conv4(in_channels=1, ways=WAYS)
    torch.manual_seed(0)  # same initial weights; batch norm starts at (1, 0) in both
    fused = Conv4(
        in_channels=1,
        ways=WAYS,
        norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False),
    )
    torch.manual_seed(0)
    mlp = MLP(64, [100, 32], WAYS)
    return [
        make_case("conv4", conv4, images, "metalearn Conv4, hand-written batch norm", device),
        make_case("conv4-fused-bn", fused, images, "Conv4 with nn.BatchNorm2d (fused)", device),
        make_case("mlp", mlp, features, "MLP(64, [100, 32], 5), ReLU", device),
    ]


def _flat(tree: object) -> Tensor:
    leaves = tree.values() if isinstance(tree, dict) else tree
    return torch.cat([t.reshape(-1) for t in leaves])  # type: ignore[union-attr]


def run_case(case: Case, args: Args, device: torch.device) -> dict[str, float]:
    fns = case.methods()
    # The first warm-up round also checks that every method computes the same H v.
    results = {name: fn() for name, fn in fns.items()}
    reference = _flat(results[f"hvp {REFERENCE_METHOD}"])
    scale = reference.abs().max().clamp_min(1e-30)
    agreement = {
        name: float((_flat(out) - reference).abs().max() / scale)
        for name, out in results.items()
        if name.startswith("hvp")
    }
    del results
    times = time_round_robin(fns, args.repeats, args.warmup - 1, device, args.clock_fn)
    memory = {name: peak_memory_bytes(fn, device) for name, fn in fns.items()}
    med = {name: statistics.median(t) for name, t in times.items()}
    low = {name: min(t) for name, t in times.items()}
    g_med, g_low = med["grad"], low["grad"]
    rows = []
    for name in fns:
        rows.append(
            [
                name,
                f"{med[name] * 1e3:.1f}",
                f"{low[name] * 1e3:.1f}",
                f"{med[name] / g_med:.2f}",
                f"{low[name] / g_low:.2f}",
                f"{memory[name] / 2**20:.1f}",
                f"{agreement[name]:.1e}" if name in agreement else "",
            ]
        )
    print(f"\n### {case.name}: {case.description}, {case.n_params:,} parameters, batch {BATCH}\n")
    print_table(
        [
            "method",
            "median ms",
            "min ms",
            "x grad (median)",
            "x grad (min)",
            "peak MB",
            "rel. diff vs fwd-over-rev",
        ],
        rows,
    )
    return {name: med[name] / g_med for name in fns}


# --------------------------------------------------------------------------- dense Hessian


def hessian_scaling(args: Args, device: torch.device) -> None:
    """Dense Hessian vs one HVP on MLP(32, [h], 5), sizes growing until the budget."""
    in_features = 32
    budget = args.max_hessian_gb * 2**30
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, in_features, generator=gen).to(device)
    y = torch.randint(0, WAYS, (BATCH,), generator=gen).to(device)
    rows = []
    last: tuple[int, int] | None = None  # (n, measured Hessian peak bytes)
    for target in args.hessian_sizes:
        hidden = max(1, round((target - WAYS) / (in_features + 1 + WAYS)))
        torch.manual_seed(0)
        model = MLP(in_features, [hidden], WAYS).to(device)
        params = {k: p.detach() for k, p in model.named_parameters()}
        n = sum(p.numel() for p in params.values())
        dense = n * n * 4
        predicted = max(dense, last[1] * (n / last[0]) ** 2 if last else 0)
        if predicted > budget:
            rows.append(
                [f"{n:,}", str(hidden), f"{dense / 2**30:.2f}", "", "", "", "", ""]
                + [f"skipped: needs ~{predicted / 2**30:.2f} GB > {args.max_hessian_gb:g} GB"]
            )
            continue

        def loss(p: dict[str, Tensor], model: nn.Module = model) -> Tensor:
            return F.cross_entropy(functional_call(model, p, (x,)), y)

        v = {k: torch.randn(p.shape, generator=gen).to(device) for k, p in params.items()}
        fns = {
            "hessian": lambda loss=loss, params=params: hessian(loss, params, method="vmap"),
            "hvp": lambda loss=loss, params=params, v=v: hvp(
                loss, params, v, method=REFERENCE_METHOD
            ),
        }
        repeats = max(1, min(args.repeats, 5 if n >= 3000 else args.repeats))
        times = time_round_robin(fns, repeats, 1, device, args.clock_fn)
        peaks = {name: peak_memory_bytes(fn, device) for name, fn in fns.items()}
        last = (n, max(peaks["hessian"], dense))
        H = fns["hessian"]()
        check = float((H @ _flat(v) - _flat(fns["hvp"]())).abs().max() / H.abs().max())
        t_h, t_v = (statistics.median(times[k]) for k in ("hessian", "hvp"))
        rows.append(
            [
                f"{n:,}",
                str(hidden),
                f"{dense / 2**30:.3f}",
                f"{t_h * 1e3:.1f}",
                f"{t_v * 1e3:.2f}",
                f"{t_h / t_v:.1f}",
                f"{peaks['hessian'] / 2**20:.1f}",
                f"{peaks['hvp'] / 2**20:.2f}",
                f"{check:.1e}",
            ]
        )
        del H
    print(
        f"\n### Dense Hessian (hessian(method='vmap')) vs one HVP ({REFERENCE_METHOD}): "
        f"MLP({in_features}, [h], {WAYS}), batch {BATCH}, no batch norm\n"
    )
    print_table(
        [
            "n params",
            "h",
            "H size GB (n^2 x 4 B)",
            "hessian ms",
            "hvp ms",
            "hessian / hvp",
            "hessian peak MB",
            "hvp peak MB",
            "rel. diff H@v vs hvp",
        ],
        rows,
    )


# --------------------------------------------------------------------------- output


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A markdown table with columns padded to equal width (numbers right-aligned)."""
    width = max(len(headers), *(len(r) for r in rows))
    rows = [list(r) + [""] * (width - len(r)) for r in rows]
    headers = list(headers) + [""] * (width - len(headers))
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def numeric(column: int) -> bool:
        cells = [r[column] for r in rows if r[column]]
        return bool(cells) and all(_is_number(c) for c in cells)

    right = [numeric(i) for i in range(width)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "| " + " | ".join(padded) + " |"

    print(line(headers))
    print(
        "|"
        + "|".join(("-" * (w + 1) + ":") if r else "-" * (w + 2) for w, r in zip(widths, right))
        + "|"
    )
    for row in rows:
        print(line(row))


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


@dataclass
class Args:
    """Arguments of bench_hvp.py (each is a --flag; see --help)."""

    repeats: int | None = None
    """Timed rounds (None: 21, or 3 with --quick)."""
    warmup: int | None = None
    """Untimed rounds, the first of which checks that the methods agree (None: 2, or 1 with
    --quick)."""
    device: str = dataclasses.field(
        default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu"
    )
    """cpu or cuda (cuda:N); the default is cuda where it is available."""
    threads: int | None = None
    """Torch intra-op threads (None: torch's default)."""
    clock: Literal["wall", "cpu"] = "wall"
    """Wall time or process CPU time."""
    max_hessian_gb: float = 2.0
    """Skip dense Hessians whose predicted peak memory exceeds this (GB)."""
    hessian_sizes: tuple[int, ...] | None = None
    """Target parameter counts for part 2 (None: 100 300 1000 3000 10000 30000, or 100 300
    1000 with --quick)."""
    quick: bool = False
    """3 repeats, 1 warm-up, Hessians up to n=1000."""

    @property
    def clock_fn(self) -> Callable[[], float]:
        return time.perf_counter if self.clock == "wall" else time.process_time


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line, with the defaults that depend on --quick filled in."""
    args = parse_args_as(Args, argv, __doc__)
    quick = args.quick
    args = dataclasses.replace(
        args,
        repeats=(3 if quick else 21) if args.repeats is None else args.repeats,
        warmup=(1 if quick else 2) if args.warmup is None else args.warmup,
        hessian_sizes=args.hessian_sizes
        or ((100, 300, 1000) if quick else (100, 300, 1000, 3000, 10000, 30000)),
    )
    if args.repeats < 1 or args.warmup < 1:
        usage_error("--repeats and --warmup must be >= 1")
    if args.max_hessian_gb <= 0:
        usage_error("--max-hessian-gb must be > 0")
    if args.threads is not None and args.threads < 1:
        usage_error(f"--threads must be >= 1, got {args.threads}")
    if min(args.hessian_sizes) < 1:
        usage_error(f"--hessian-sizes must be >= 1, got {list(args.hessian_sizes)}")
    return args


def main(argv: Sequence[str] | None = None) -> float:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        usage_error("--device cuda given but CUDA is not available; use --device cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"torch {torch.__version__}, device {device} ({where or 'cpu'}), "
        f"{torch.get_num_threads()} threads of {os.cpu_count()} cores, float32, "
        f"{args.clock} clock, {args.repeats} repeats after {args.warmup} warm-up"
    )
    ratios = {}
    for case in make_cases(device):
        ratios[case.name] = run_case(case, args, device)
    hessian_scaling(args, device)
    r = ratios["conv4"][f"hvp {DEFAULT_HVP_METHOD}"]
    print(f"\nhvp_over_grad: {r:.2f} ({DEFAULT_HVP_METHOD}, hvp's default)")
    return r


if __name__ == "__main__":
    main()
