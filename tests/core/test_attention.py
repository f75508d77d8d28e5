"""`metalearn.attention.attention_kernel`, the one rule for which attention kernel runs: the
math kernel where a gradient is differentiated again or under vmap, the fused one otherwise;
the fused fast path of nn.MultiheadAttention off; torch's settings restored after."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from metalearn.attention import attention_kernel

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _attention() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, batch_first=True).eval()


def _ops(run) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {event.name for event in prof.events()}


def _forward(attn: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    return attn(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("twice", [True, False])
def test_the_kernel_follows_the_rule(twice):
    attn, x = _attention(), torch.randn(3, 5, 8)

    def run():
        with attention_kernel(twice_differentiated=twice):
            _forward(attn, x)

    ops = _ops(run)
    assert (MATH in ops) == twice and (FLASH in ops) == (not twice)


def test_once_inside_twice_keeps_the_math_kernel():
    attn, x = _attention(), torch.randn(3, 5, 8)

    def run():
        with attention_kernel(True), attention_kernel(False):
            _forward(attn, x)

    ops = _ops(run)
    assert MATH in ops and FLASH not in ops


def test_batched_inputs_take_the_math_kernel():
    attn, xs = _attention(), torch.randn(4, 3, 5, 8)

    def one(x):
        with attention_kernel(False, inputs=x):
            return _forward(attn, x)

    ops = _ops(lambda: torch.func.vmap(one)(xs))
    assert MATH in ops and FLASH not in ops


def test_the_fast_path_is_off_inside_and_restored_after():
    attn, x = _attention(), torch.randn(3, 5, 8)
    with torch.no_grad():  # eval mode, no grad: nn.MultiheadAttention's fused fast path
        assert "aten::_native_multi_head_attention" in _ops(lambda: _forward(attn, x))
        with attention_kernel(False):
            assert "aten::_native_multi_head_attention" not in _ops(lambda: _forward(attn, x))
    assert torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(RuntimeError, match="inside"), attention_kernel(True):
        raise RuntimeError("inside")
    assert torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # sdpa_kernel's settings restored too


@pytest.mark.parametrize("twice", [True, False])
def test_it_compiles_without_a_graph_break(twice):
    lin = nn.Linear(3, 3)

    def f(x):
        with attention_kernel(twice, inputs=x):
            return lin(x).sin().sum()

    explained = torch._dynamo.explain(f)(torch.randn(2, 3))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
