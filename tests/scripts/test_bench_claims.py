"""scripts/bench_claims.py: each measurement at a tiny size computes what it claims to compare
(the same view and output both ways, the same logits in every grad mode, accuracies equal
to independent evaluations); no timings are asserted."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from metalearn.algorithms import MAML
from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.engine import Task
from metalearn.runs.evaluation import TEST_SEED, evaluate_tasks
from tests.conftest import OMNIGLOT, needs_omniglot, script

bench_claims = script("bench_claims")
benchtools = script("benchtools")

DATA = OMNIGLOT

# ------------------------------------------------------------------------------ permute


def test_transpose_and_permute_give_one_view_and_the_consumer_sees_its_values() -> None:
    for case in bench_claims.reorder_cases(scale=8):
        assert bench_claims.check_reorder(case) == dict.fromkeys(
            ["same view", "equal values", "equal output"], True
        ), case.name
        x = case.make()
        view = case.permute(x)
        assert not view.is_contiguous()  # both spellings reorder without copying
        # reference: the consumer on a contiguous copy of the reordered values
        torch.testing.assert_close(
            case.then(view), case.then(view.contiguous()), rtol=1e-4, atol=1e-4
        )


def test_the_reorder_check_fails_when_the_two_spellings_differ() -> None:
    case = bench_claims.reorder_cases(scale=8)[0]
    wrong = bench_claims.Reorder(case.name, case.make, case.transpose,
                                 lambda x: x.permute(0, 1, 2, 3), case.then, "")  # fmt: skip
    checks = bench_claims.check_reorder(wrong)
    assert checks["equal values"] is False and checks["same view"] is False


def test_reorder_timing_has_every_stage_both_ways() -> None:
    case = bench_claims.reorder_cases(scale=8)[2]
    calls = dict.fromkeys(["transpose", "permute", "then"], 0)

    def counted(name, fn):
        def run(x):
            calls[name] += 1
            return fn(x)

        return run

    counting = bench_claims.Reorder(case.name, case.make, counted("transpose", case.transpose),
                                    counted("permute", case.permute), counted("then", case.then),
                                    case.then_name)  # fmt: skip
    times = bench_claims.time_reorder(counting, repeats=2, warmup=1, view_calls=3)
    stages = ("view", "contiguous", "then")
    ways = ("transpose", "permute")
    assert set(times) == {f"{s} {w}" for s in stages for w in ways} | {"then contiguous"}
    # every stage ran 1 + 2 times: a view stage is 3 reorders, the others one reorder each
    # (the contiguous copy of the view is made once from permute, before timing)
    assert calls == {"transpose": 3 * 3 + 3 + 3, "permute": 3 * 3 + 3 + 3 + 1, "then": 3 * 3}


# ---------------------------------------------------------------------------- inference


def test_every_grad_mode_gives_the_same_logits_and_only_plain_builds_a_graph() -> None:
    x = torch.rand(3, 1, 28, 28)
    models = bench_claims.inference_models(hidden=4)
    conv4, deployed = models["Conv4"], models["adapted (deploy)"]
    for model in (conv4, deployed):
        plain, no_grad, inference = (
            bench_claims.forward_in(m, model, x) for m in bench_claims.MODES
        )
        assert torch.equal(plain, no_grad) and torch.equal(plain, inference)
        assert inference.is_inference() and not no_grad.is_inference()
        assert not no_grad.requires_grad
    assert bench_claims.forward_in("plain", conv4, x).requires_grad
    # the deploy model's weights need no grad, so even its plain forward builds no graph
    assert not bench_claims.forward_in("plain", deployed, x).requires_grad


def test_held_memory_is_the_output_alone_unless_a_graph_keeps_activations() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3))
    x = torch.randn(5, 6)
    out_bytes, relu_bytes = 5 * 3 * 4, 5 * 7 * 4
    held = {m: benchtools.retained_bytes(lambda m=m: bench_claims.forward_in(m, mlp, x))[1]
            for m in bench_claims.MODES}  # fmt: skip
    assert held["no_grad"] == held["inference_mode"] == out_bytes
    # ReLU saves its output for backward (the second Linear's input, the same tensor)
    assert held["plain"] == out_bytes + relu_bytes
    mb = bench_claims.memory_mb(mlp, x)
    assert mb[:3] == [held[m] / 2**20 for m in bench_claims.MODES]
    # the peak during the call includes what the call leaves held
    assert all(peak >= kept for peak, kept in zip(mb[3:], mb[:3]))


def test_an_inference_tensor_refuses_what_a_no_grad_tensor_allows() -> None:
    errors = bench_claims.inference_tensor_errors()
    assert list(errors.values()) == [
        "Inference tensors cannot be saved for backward",
        "Inplace update to inference tensor outside InferenceMode is not allowed",
        "Inference tensors do not track version counter",
    ]
    w = torch.randn(3, 3, requires_grad=True)
    with torch.no_grad():
        y = torch.randn(2, 3) @ torch.randn(3, 3)
    (y @ w).sum().backward()
    assert w.grad is not None and y.add_(1)._version == 1


def test_mode_timing_covers_the_three_modes() -> None:
    model = bench_claims.inference_models(hidden=4)["Conv4"]
    grad_modes: list[tuple[bool, bool]] = []
    model.register_forward_pre_hook(
        lambda *_: grad_modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    )
    times = bench_claims.time_modes(model, torch.rand(1, 1, 28, 28), repeats=2, warmup=1, calls=2)
    assert set(times) == set(bench_claims.MODES)
    # each mode ran (1 warm-up + 2 repeats) x 2 calls, in its own grad mode
    modes = {(True, False): "plain", (False, False): "no_grad", (False, True): "inference_mode"}
    assert sorted(modes[g] for g in grad_modes) == sorted(list(bench_claims.MODES) * 6)


def test_tiny_permute_and_inference_runs_print_their_tables(capsys) -> None:
    tiny = ["--repeats", "1", "--warmup", "0", "--view-calls", "1", "--small-batch-calls", "1"]
    bench_claims.main(["--only", "permute", "--only", "inference", *tiny])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    # permute: 4 reorders x 3 stages; inference: 2 models x 2 batches, twice; 3 headers
    assert len(rows) == 12 + 4 + 4 + 3
    assert "Inference tensors cannot be saved for backward" in out


def test_bad_arguments_are_one_line_and_exit_2(capsys) -> None:
    for argv, message in ((["--skip-prob", "1"], "must be in [0, 1)"),
                          (["--repeats", "0"], "counts must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            bench_claims.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------- contiguity, sparse, branch (claims 1, 2, 4)


def test_transposed_input_has_the_contiguous_values_and_view_refuses_it() -> None:
    x = bench_claims.transposed((2, 3, 4, 5))
    assert x.shape == (2, 3, 4, 5) and not x.is_contiguous() and x.stride()[-2:] == (1, 4)
    assert bench_claims.view_raises(x) and not bench_claims.view_raises(x.contiguous())
    assert bench_claims.reshape_copies(x) and not bench_claims.reshape_copies(x.contiguous())


def test_sparse_formats_hold_the_matrix_and_count_their_own_buffers() -> None:
    dense = bench_claims.random_sparse(64, 0.1)
    nnz = int((dense != 0).sum())
    mats = bench_claims.sparse_formats(dense)
    rhs = torch.randn(64, 3)
    for name, m in mats.items():
        assert torch.allclose(bench_claims.sparse_matmul(m, rhs), dense @ rhs, atol=1e-5), name
    # dense: 4 B per entry; COO: two int64 indices and a float32 per non-zero (20 B);
    # CSR: 65 int64 row pointers, then an int64 column and a float32 per non-zero (12 B)
    sizes = {name: bench_claims.storage_bytes(m) for name, m in mats.items()}
    assert sizes == {"dense": 64 * 64 * 4, "COO": 20 * nnz, "CSR": 65 * 8 + 12 * nnz}


def test_static_branchless_network_equals_the_dynamic_one_with_no_skip() -> None:
    torch.manual_seed(0)
    net = bench_claims.dynamic_conv(in_channels=1, ways=5, hidden=4, depth=2).eval()
    x = torch.rand(3, 1, 28, 28)
    tasks = benchtools.omniglot_tasks(benchtools.Setting(1, False), 2, torch.float32, seed=0)
    fns = bench_claims.branch_fns(net, x, tasks)
    forward = {name: fn() for name, fn in fns["forward"].items()}
    assert torch.equal(forward["static `nn.Sequential` (no branch)"], forward["none skipped"])
    # skipping both blocks leaves the stem's output: the head of the stem alone
    assert torch.allclose(forward["both skipped"], net.head(net.stem(x)))
    assert not torch.allclose(forward["both skipped"], forward["none skipped"])


def test_tiny_contiguity_sparse_and_branch_runs_print_their_tables(capsys) -> None:
    tiny = ["--repeats", "1", "--warmup", "0", "--scale", "0"]
    bench_claims.main(["--only", "contiguity", "--only", "sparse", "--only", "branch", *tiny])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    # contiguity: 7 ops; sparse: 4 densities; branch: static, 3 branches, mixed; 3 headers
    assert len(rows) == 7 + 4 + 5 + 3
    assert "'x.view(-1) raises': True" in out


# ------------------------------------------------------------------------------ dynamic


def test_random_skips_give_each_task_its_own_flags() -> None:
    x, y = torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)
    tasks = [Task((x, y), (x, y)) for _ in range(40)]
    mixed = bench_claims.random_skips(tasks, random.Random(0), 0.5, blocks=2)
    flags = {t.model_kwargs["skip"] for t in mixed}
    assert flags == {(a, b) for a in (False, True) for b in (False, True)}
    never = bench_claims.random_skips(tasks, random.Random(0), 0.0, blocks=2)
    assert {t.model_kwargs["skip"] for t in never} == {(False, False)}
    assert all(t.model_kwargs == {} for t in tasks)  # the inputs are left as they were


@pytest.mark.slow
@needs_omniglot
def test_skip_accuracies_match_independent_evaluations_on_a_tiny_run() -> None:
    torch.set_num_threads(1)
    data = load_omniglot(DATA, progress=False)
    train = omniglot_samplers(data, ways=5, shots=1, queries=2)["train"]
    test = omniglot_samplers(data, ways=5, shots=1, queries=3)["test"]
    learner = bench_claims.train_dynamic(train, steps=2, meta_batch=3, skip_prob=0.5, hidden=4)
    tasks, steps = 8, 1
    result = bench_claims.skip_accuracies(learner, test, tasks, steps)
    assert set(result) == set(bench_claims.SKIPS)
    assert all(0 <= r["mean"] <= 1 for r in result.values())
    assert result["none"]["diff"] == 0 and result["none"]["diff_ci95"] == 0

    def reference(learner: MAML, source) -> float:
        gen = torch.Generator().manual_seed(TEST_SEED)
        return evaluate_tasks(learner, source, tasks, steps, gen, progress=False)[0]

    for name, skip in bench_claims.SKIPS.items():
        source = bench_claims.SkippingSource(test, skip)
        assert result[name]["mean"] == pytest.approx(reference(learner, source), abs=1e-12)
        diff = result[name]["mean"] - result["none"]["mean"]
        assert result[name]["diff"] == pytest.approx(diff, abs=1e-12)
    # both blocks skipped is the stem and the head alone, a network without the blocks
    net = learner.model
    bare = MAML(nn.Sequential(copy.deepcopy(net.stem), copy.deepcopy(net.head)))
    assert result["both"]["mean"] == pytest.approx(reference(bare, test), abs=1e-12)
