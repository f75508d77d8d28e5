"""LoRA adapters on nn.MultiheadAttention (`metalearn.models.lora.LoRAMultiheadAttention`):
the wrapper computes the base attention at the merged projections, inside a stock encoder
too, and a Linear the attention never calls gets no adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from metalearn.models.lora import LoRAMultiheadAttention, add_lora, lora_keys
from metalearn.models.sequence import SequenceTransformer


def _randomise_b(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("batch_first", [True, False])
def test_the_wrapper_is_the_base_at_merged_weights(batch_first):
    torch.manual_seed(0)
    base = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    lora = LoRAMultiheadAttention(copy.deepcopy(base), rank=2, alpha=3.0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert (lora(x, x, x)[0] - base(x, x, x)[0]).abs().max() < 1e-12  # B = 0: the base
    _randomise_b(lora)
    merged = copy.deepcopy(base)
    w_in, w_out = lora.merged_weights()
    with torch.no_grad():
        merged.in_proj_weight.copy_(w_in)
        merged.out_proj.weight.copy_(w_out)
    got, got_w = lora(x, x, x)
    want, want_w = merged(x, x, x)
    assert (got - want).abs().max() < 1e-12 and (got_w - want_w).abs().max() < 1e-12
    assert (got - base(x, x, x)[0]).abs().max() > 1e-3  # the update matters


def test_an_adapted_encoder_is_the_encoder_at_merged_weights_in_eval_mode():
    """In eval mode under no_grad the stock encoder layer has a fused path that reads the
    base weights; the wrapper keeps it off, so the update is never skipped."""
    torch.manual_seed(0)
    model = SequenceTransformer(vocab=5, ways=3, length=6, width=8, layers=1).double().eval()
    adapted = add_lora(model, 2, layers=(nn.MultiheadAttention,))
    _randomise_b(adapted)
    merged = copy.deepcopy(model)
    w_in, w_out = adapted.encoder.layers[0].self_attn.merged_weights()
    with torch.no_grad():
        merged.encoder.layers[0].self_attn.in_proj_weight.copy_(w_in)
        merged.encoder.layers[0].self_attn.out_proj.weight.copy_(w_out)
        x = torch.randint(5, (4, 6))
        assert (adapted(x) - merged(x)).abs().max() < 1e-12
        assert (adapted(x) - model(x)).abs().max() > 1e-3


def test_out_proj_is_not_adapted_as_a_linear_layer():
    model = SequenceTransformer(vocab=5, ways=3, length=6, width=8, layers=1)
    keys = lora_keys(add_lora(model, 2))  # nn.Linear only
    assert not any("self_attn" in k for k in keys)
    assert "encoder.layers.0.linear1.lora_A" in keys
    both = lora_keys(add_lora(model, 2, layers=(nn.Linear, nn.MultiheadAttention)))
    assert "encoder.layers.0.self_attn.in_proj_lora_A" in both
    assert "encoder.layers.0.self_attn.out_proj_lora_B" in both
    assert not any("out_proj.lora" in k for k in both)
    with pytest.raises(ValueError, match="are not nn.Linear layers"):
        add_lora(model, 2, target=["encoder.layers.0.self_attn.out_proj"])
