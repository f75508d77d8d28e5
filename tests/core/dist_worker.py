"""One rank of tests/core/test_distributed.py's 2-process job (launched by torchrun, gloo, CPU).

Each rank runs the library's collectives on float64 problems and saves what it got to
``OUT/rank{R}.pt``; the test compares those files with a single-process reference, so the
assertions (and their failure messages) live in pytest, not here.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/core/dist_worker.py OUT
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from metalearn import distributed as dist
from metalearn.algorithms import MAML, MetaLearner, Reptile
from metalearn.engine import Task
from metalearn.models import MLP

WAYS, META_BATCH, STEPS = 3, 5, 3
TIMEOUT_S = 6.0
"""Collective timeout of this job: short, so the stall check below takes seconds."""


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(4, [8], WAYS).double()


def make_learners(seed: int) -> dict[str, MetaLearner]:
    """The learners compared: MAML both ways (second order) and Reptile (its own .grad),
    with full-batch gradient descent: its default inner loop runs the tasks in sequence
    (mini-batches from one random stream, Adam's state carried from task to task), which
    processes that split the meta-batch do not reproduce (docs/distributed.md)."""
    return {
        "maml-vmap": MAML(make_model(seed), inner_lr=0.3, inner_steps=2, vectorize="vmap"),
        "maml-loop": MAML(make_model(seed), inner_lr=0.3, inner_steps=2, vectorize="loop"),
        "reptile": Reptile(
            make_model(seed),
            inner_lr=0.3,
            inner_steps=3,
            inner_optimizer="sgd",
            inner_batch=None,
            eval_inner_batch=None,
        ),
    }


def make_tasks(gen: torch.Generator, n: int) -> list[Task]:
    """``n`` random 3-way classification tasks in float64 (support 6, query 9 examples)."""
    tasks = []
    for _ in range(n):
        xs = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        xq = torch.randn(9, 4, generator=gen, dtype=torch.float64)
        ys, yq = torch.arange(6) % WAYS, torch.arange(9) % WAYS
        tasks.append(Task(support=(xs, ys), query=(xq, yq)))
    return tasks


def grads(learner: MetaLearner) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in learner.named_parameters()}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    info = dist.init_from_env(device="cpu", timeout_s=TIMEOUT_S)
    assert info.world_size == 2 and info.backend == "gloo", info
    result: dict = {"rank": info.rank}
    learners = make_learners(seed=1 + info.rank)  # ranks start apart: broadcast must fix it
    for name, learner in learners.items():
        dist.broadcast_params(learner)
        result[f"{name}/init"] = {k: v.detach().clone() for k, v in learner.state_dict().items()}
        gen = torch.Generator().manual_seed(0)  # the same global meta-batch on every rank
        opt = torch.optim.Adam(learner.parameters(), lr=0.05)
        for step in range(STEPS):
            tasks = dist.shard(make_tasks(gen, META_BATCH))  # 3 tasks on rank 0, 2 on rank 1
            opt.zero_grad()
            metrics = dist.average_meta_step(learner, learner.backward(tasks), len(tasks))
            if step == 0:
                result[f"{name}/grad"], result[f"{name}/loss"] = grads(learner), metrics.loss
                result[f"{name}/local_tasks"] = len(tasks)
            opt.step()
        result[f"{name}/final"] = {k: v.detach().clone() for k, v in learner.state_dict().items()}
        dist.check_same(learner.parameters())
    # Uneven gathers: rank 0 holds no rows, rank 1 three.
    local = torch.arange(3 * info.rank, dtype=torch.float64).view(-1, 1) + 100 * info.rank
    result["gathered"] = dist.gather_tensor(local)
    result["from_main"] = dist.from_main(lambda: f"made on rank {dist.info().rank}")
    try:
        dist.from_main(_missing_file)
    except FileNotFoundError as err:
        result["from_main_error"] = str(err)
    learner = learners["maml-vmap"]
    with torch.no_grad():  # make the ranks differ on purpose: check_same must say so
        next(learner.parameters()).add_(float(info.rank))
    try:
        dist.check_same(learner.parameters())
    except RuntimeError as err:
        result["check_same_error"] = str(err)
    torch.save(result, out / f"rank{info.rank}.pt")
    stall(out, info.rank)


def _missing_file() -> None:
    raise FileNotFoundError("no checkpoint at /nowhere (raised on rank 0 only)")


def stall(out: Path, rank: int) -> None:
    """Rank 1 stops answering for longer than the timeout: rank 0 must fail, not hang."""
    learner = make_learners(seed=1)["maml-loop"]
    learner.backward(make_tasks(torch.Generator().manual_seed(0), 1))
    dist.barrier()  # both ranks start the clock here
    if rank == 1:
        time.sleep(TIMEOUT_S + 2)
        (out / "rank1-woke").touch()
        return  # never joins the all_reduce; exits cleanly so only rank 0's error is seen
    start = time.monotonic()
    try:
        dist.average_gradients(learner.parameters(), 1)
        outcome = "no error"
    except dist.PeerError as err:
        outcome = str(err)
    torch.save({"error": outcome, "seconds": time.monotonic() - start}, out / "stall.pt")
    # Rank 0 leaves only after rank 1 has woken. A process whose collective timed out, exiting
    # while its peer still holds the connection, sometimes aborts after Python has finished
    # ("terminate called without an active exception", inside gloo's teardown; 4 of 20 runs on
    # a loaded machine, and one CI run). Exiting after the peer: 0 of 18 on the same load.
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while not (out / "rank1-woke").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
