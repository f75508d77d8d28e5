"""Smoke test of scripts/bench_claims.py: its workloads at tiny sizes compute the right thing.

Only correctness is asserted (timings do not belong in tests). ``torch.compile`` is not
exercised here: compiling even a tiny MAML meta-step takes 30+ s on 2 cores; the script
checks the compiled meta-gradient against float64 eager whenever it compiles.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_claims  # noqa: E402
from claims import branch, contiguity, hessian_curve, metastep, metastep_bench, sparse  # noqa: E402


def test_view_raises_and_reshape_copies_only_when_transposed() -> None:
    x = contiguity.non_contiguous((2, 3, 4, 5))
    assert x.shape == (2, 3, 4, 5) and not x.is_contiguous()
    assert contiguity.view_raises(x) and contiguity.reshape_copies(x)
    y = x.contiguous()
    assert torch.equal(x, y)
    assert not contiguity.view_raises(y) and not contiguity.reshape_copies(y)


def test_every_timed_op_gives_the_same_result_on_transposed_input() -> None:
    for name, (x, op) in contiguity.ops("tiny").items():
        if op is None:
            continue
        torch.testing.assert_close(op(x), op(x.contiguous()), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("density", sparse.DENSITIES)
def test_sparse_matmul_equals_dense_and_storage_is_counted(density: float) -> None:
    n, k = 64, 8
    dense = sparse.random_sparse(n, density)
    nnz = int(torch.count_nonzero(dense))
    rhs = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    reference = dense.double() @ rhs.double()
    expected_bytes = {"dense": n * n * 4, "coo": nnz * (2 * 8 + 4), "csr": (n + 1) * 8 + nnz * 12}
    for name, m in sparse.formats(dense).items():
        out = sparse.matmul(m, rhs)
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5, msg=name)
        assert sparse.storage_bytes(m) == expected_bytes[name], name


def test_benchmark_hvp_equals_dense_hessian_times_v_in_float64() -> None:
    problem = hessian_curve.make_problem(120, dtype=torch.float64)
    H = problem.hessian()
    assert H.shape == (problem.n, problem.n)
    torch.testing.assert_close(H, H.T, rtol=0, atol=1e-12)
    v = torch.cat([t.reshape(-1) for t in problem.v.values()])
    torch.testing.assert_close(problem.hvp(), H @ v, rtol=1e-10, atol=1e-12)


def test_hessian_claim_runs_and_reports_agreement() -> None:
    cfg = bench_claims.main(["--quick", "--only", "3"])
    rows = cfg.results["hessian"]["rows"]
    assert [r["n"] for r in rows] == [81, 309, 993]
    assert all(r["rel_error"] < 1e-5 and r["hessian_mb"] > r["hvp_mb"] for r in rows)


def test_static_equivalent_and_skips_compute_the_intended_branch() -> None:
    net = branch.make_net(hidden=4).eval()
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(branch.static_equivalent(net)(x), net(x, skip=False))
        torch.testing.assert_close(net(x, skip=True), net.head(net.stem(x)))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net.head(net.stem(x))
    counts = [branch.flops(net, x, s) for s in branch.SKIPS.values()]
    assert counts[0] > counts[1] > counts[2] == counter.get_total_flops()


@pytest.mark.parametrize("method", ["loop+ckpt", "vmap"])
def test_meta_gradients_of_timed_methods_equal_the_eager_loop(method: str) -> None:
    work = metastep.Workload(steps=2, tasks=3, hidden=4)
    tasks64 = work.make_tasks(torch.float64)
    reference = metastep.meta_gradient(metastep.make_step("loop", work, torch.float64), tasks64)
    exact = metastep.meta_gradient(metastep.make_step(method, work, torch.float64), tasks64)
    assert metastep.max_relative_difference(exact, reference) < 1e-10
    single = metastep.meta_gradient(metastep.make_step(method, work), work.make_tasks())
    assert metastep.max_relative_difference(single, reference) < 1e-4


def test_meta_step_memory_probe_runs_in_a_subprocess() -> None:
    peak = metastep_bench.memory_in_subprocess("loop", metastep.Workload(1, tasks=2, hidden=4))
    assert peak is not None and peak > 0


def test_quick_run_of_claims_1_2_4_records_every_row() -> None:
    cfg = bench_claims.main(["--quick", "--only", "1", "--only", "2", "--only", "4"])
    assert cfg.results["contiguity"]["checks"] == {
        "view raises": True, "reshape copies": True, "reshape of contiguous copies": False,
    }  # fmt: skip
    assert len(cfg.results["contiguity"]["rows"]) == len(contiguity.ops("tiny"))
    assert [r["density"] for r in cfg.results["sparse"]["rows"]] == list(sparse.DENSITIES)
    assert set(cfg.results["branch"]["ms"]["adapt+predict"]) == {
        *branch.SKIPS, "mixed (half none, half both)",
    }  # fmt: skip
