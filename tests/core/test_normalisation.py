"""`metalearn.normalisation.read_normalisation`: the normalisation calls of one forward, named
by the parameters that flow into their weight and bias, whatever the modules are called or
typed; torch's own functions and metalearn's elementary batch norm alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metalearn.models import Conv4, MetaBatchNorm, ResNet12
from metalearn.normalisation import read_normalisation

F64 = torch.float64


class _Plain(nn.Module):
    """Norm weights as bare parameters passed to the functions themselves, one of them a
    per-step copy picked by indexing (as HowToTrainYourMAMLPytorch's per-step batch norm),
    and a Linear named like a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gamma, self.beta = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))
        self.steps = nn.Parameter(torch.ones(2, 4))
        self.norm = nn.Linear(4, 4)  # named like a norm, is not one
        self.ln, self.gn = nn.LayerNorm(4), nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.batch_norm(self.conv(x), None, None, bias=self.beta, weight=self.gamma, training=True)
        h = torch.batch_norm(h, self.steps[1], None, None, None, True, 0.1, 1e-5, False)
        h = self.gn(self.inorm(h)).mean((2, 3))
        return self.norm(F.dropout(self.ln(h), 0.5))


def test_every_norm_call_is_read_with_the_parameters_flowing_into_it():
    model = _Plain().to(F64)
    calls = read_normalisation(model, torch.randn(5, 1, 6, 6, dtype=F64)).calls
    got = [(c.function.rsplit(".", 1)[-1], c.parameters, c.statistics, c.vmap_exact)
           for c in calls]  # fmt: skip
    assert got == [
        ("batch_norm", ("gamma", "beta"), "batch", False),
        ("batch_norm", ("steps",), "batch", False),
        ("instance_norm", ("inorm.weight", "inorm.bias"), "example", False),
        ("group_norm", ("gn.weight", "gn.bias"), "example", True),
        ("layer_norm", ("ln.weight", "ln.bias"), "example", False),
    ]
    assert [c.function for c in calls[:2]] == ["torch.nn.functional.batch_norm",
                                                "torch.batch_norm"]  # fmt: skip


def test_module_forms_train_and_eval_and_running_stats():
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)).to(F64)
    x = torch.randn(4, 1, 5, 5, dtype=F64)
    before = {k: b.clone() for k, b in model.named_buffers()}
    (train,) = read_normalisation(model, x).calls
    assert (train.statistics, train.updates_running_stats, train.vmap_exact) == (
        "batch", True, False)  # fmt: skip
    for name, b in model.named_buffers():  # the read wrote no running statistic
        assert torch.equal(b, before[name]), name
    (evaluation,) = read_normalisation(model.eval(), x).calls
    assert (evaluation.statistics, evaluation.updates_running_stats) == ("running", False)
    assert evaluation.vmap_exact and evaluation.parameters == ("1.weight", "1.bias")


def test_the_read_draws_nothing_from_torchs_random_stream():
    model = _Plain().to(F64)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    read_normalisation(model, torch.randn(5, 1, 6, 6, dtype=F64, generator=torch.Generator()))
    assert torch.equal(torch.rand(3), expected)


def test_metalearns_elementary_batch_norm_is_read_as_exact_under_vmap():
    model = Conv4(in_channels=1, ways=3, hidden=4)
    calls = read_normalisation(model, torch.randn(3, 1, 28, 28)).calls
    assert [c.function for c in calls] == ["metalearn.models.norm.batch_norm"] * 4
    assert [c.parameters for c in calls] == [
        (f"features.{i}.norm.weight", f"features.{i}.norm.bias") for i in range(4)]  # fmt: skip
    assert all(c.statistics == "batch" and c.vmap_exact for c in calls)
    # ResNet-12: the same names the type-based rule found before
    net = ResNet12(widths=(4, 4, 4, 4))
    read = read_normalisation(net, torch.randn(2, 3, 16, 16)).parameter_names()
    by_type = {f"{m}.{p}" for m, mod in net.named_modules() if isinstance(mod, MetaBatchNorm)
               for p in ("weight", "bias")}  # fmt: skip
    assert read == by_type and len(read) > 8


def test_layers_never_called_are_not_norms_and_unweighted_calls_name_nothing():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.spare = nn.Linear(3, 3), nn.LayerNorm(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(self.l(x), (3,))

    (call,) = read_normalisation(Unused(), torch.randn(2, 3)).calls
    assert call.parameters == () and call.vmap_exact
