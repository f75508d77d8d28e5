"""A small transformer classifier of token sequences, for meta-learning on sequences.

Tokens are embedded, given a learned position embedding, read by a stock
`nn.TransformerEncoder` (post-norm layers, ReLU, no dropout by default) and mean-pooled; the
classifier is the linear ``head``, as in the image backbones, so ANIL adapts ``head.*``.

Second-order MAML through it runs attention's math kernel in the inner loop
(`metalearn.attention`). Its `nn.LayerNorm` layers keep second-order meta-batches in the loop
(`metalearn.engine.plan.vmap_blockers`: their vmapped second derivative is wrong in torch
2.13); first-order ones may run under vmap.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SequenceTransformer"]


class SequenceTransformer(nn.Module):
    """Embedding, a stock transformer encoder, mean pooling and a linear head.

    Args:
        vocab: tokens ``V``.
        ways: classes of the head.
        length: the longest sequence (positions embedded).
        width: the model width ``E``.
        heads: attention heads (``E`` divisible by it).
        layers: encoder layers.
        ffn: the feed-forward width.
        dropout: the encoder layers' dropout (0: a deterministic network).

    Shape:
        ``[N, L]`` long tokens (``L <= length``) -> logits ``[N, ways]``.
    """

    def __init__(
        self,
        vocab: int,
        ways: int,
        length: int,
        width: int = 32,
        heads: int = 2,
        layers: int = 1,
        ffn: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be divisible by heads={heads}")
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.1 * torch.randn(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, ffn, dropout=dropout, batch_first=True)
        # enable_nested_tensor=False: no padding masks here, so no nested-tensor fast path.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, ways)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[-1]]
        return self.head(self.encoder(h).mean(dim=-2))
