"""Genuine packages for the package tests: a small Conv4 in each batch-norm reading, written
by `metalearn.deploy.write_package` exactly as metalearn-export writes one (no data set
needed: random support images stand in for a support folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from metalearn.deploy import adapted_model, write_package
from metalearn.models.backbones import build_backbone

ARGUMENTS = {"in_channels": 1, "ways": 3, "hidden": 4, "pool": "stride", "head": "mean",
             "image_size": None, "activation": "relu", "dropout": 0.0}  # fmt: skip
SUPPORT = 4  # support images
SIDE = 12  # image side


def document(norm: str = "support", **changes: Any) -> dict[str, Any]:
    """The document metalearn-export writes for the package `genuine` builds (no files)."""
    return {"architecture": {"name": "conv4", "arguments": dict(ARGUMENTS)}, "dtype": "float32",
            "norm": norm, "evaluation_norm": "transductive", "support_size": SUPPORT,
            "class_names": ["alpha", "beta", "gamma"],
            "image": {"size": SIDE, "channels": 1, "invert": True, "resample": "lanczos"},
            "source": {"algorithm": "maml", "steps": 1}, **changes}  # fmt: skip


def network(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A seeded Conv4 (its weights stand in for adapted ones) and support images."""
    torch.manual_seed(seed)
    net = build_backbone("conv4", **ARGUMENTS).eval()
    with torch.no_grad():  # batch norm's affine weights away from their 1 and 0
        for name, p in net.named_parameters():
            if ".norm." in name:
                p.add_(torch.randn_like(p) * 0.3)
    return net, torch.rand(SUPPORT, 1, SIDE, SIDE)


def genuine(folder: Path, norm: str = "support", seed: int = 0) -> tuple[Path, nn.Module]:
    """A package at ``folder`` and the eager network it holds."""
    net, support = network(seed)
    model = adapted_model(net, dict(net.named_parameters()), norm=norm, support_x=support)
    return write_package(folder, model, document(norm)), model


def rewrite_document(folder: Path, change) -> None:
    """Edit the package's ``package.json`` in place (``change(tree)`` mutates the tree)."""
    path = folder / "package.json"
    tree = json.loads(path.read_text())
    change(tree)
    path.write_text(json.dumps(tree))
