"""Query accuracy of an adapted learner under each batch-norm reading used for deployment.

What: adapts a checkpoint's learner on Omniglot test tasks (MAML split, seed 2, as the
experiment's test) and reports the query accuracy of the adapted network three ways:
transductive batch norm with the whole query set in one batch (what the experiment's
evaluation does; also checked against ``learner.evaluate``), transductive with one image
per call (what a deployed classifier sees when called on single images), and batch norm
frozen at the support set's statistics (``metalearn.deploy.adapted_model(norm="support")``).

Command:
    python scripts/eval_deploy_norm.py runs/maml-5w1s-seed0/checkpoint.pt --shots 1

Measured: see docs/deploy.md.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.deploy import adapt_to_support, adapted_model, load_learner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="an Omniglot experiment checkpoint")
    parser.add_argument("--shots", type=int, default=1, help="support images per class")
    parser.add_argument("--tasks", type=int, default=200, help="test tasks (multiple of 50)")
    parser.add_argument("--data-root", default=None, help="Omniglot (default $METALEARN_DATA)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    learner, run = load_learner(args.checkpoint)
    steps = run["eval_inner_steps"]
    data = load_omniglot(args.data_root, progress=False)
    sampler = omniglot_samplers(data, run["split"], ways=run["ways"], shots=args.shots,
                                queries=15)["test"]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    names = ["transductive, query set in one batch", "transductive, one image per call",
             "frozen support statistics", "learner.evaluate (reference)"]  # fmt: skip
    acc: dict[str, list[Tensor]] = {name: [] for name in names}
    for _ in range(args.tasks // 50):
        tasks = sampler.batch(50, gen)
        acc[names[3]] += list(learner.evaluate(tasks, steps=steps)[1])
        for task in tasks:
            (xs, ys), (xq, yq) = task.support, task.query
            params = adapt_to_support(learner, xs, ys, steps=steps)
            live = adapted_model(learner, params, norm="transductive")
            frozen = adapted_model(learner, params, norm="support", support_x=xs)
            with torch.inference_mode():
                single = torch.cat([live(xq[i : i + 1]) for i in range(len(xq))])
                for name, logits in zip(names, (live(xq), single, frozen(xq))):
                    acc[name].append((logits.argmax(-1) == yq).double().mean())
    for name in names:
        a = torch.stack(acc[name]).double()
        half = 1.96 * a.std().item() / len(a) ** 0.5
        print(f"{name:40s} {a.mean().item():.4f} ± {half:.4f} ({len(a)} tasks, {steps} steps)")


if __name__ == "__main__":
    main()
