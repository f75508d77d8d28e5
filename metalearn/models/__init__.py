"""Backbones for few-shot learning, written for the functional core (one module each):
`Conv4` (MAML's, Omniglot and mini-ImageNet), `ResNet12`, `R2D2Net` (R2-D2's encoder),
`MLP`, and `SequenceTransformer` (a stock `nn.TransformerEncoder` classifier of token
sequences).

Every model here is meant to be run through `torch.func.functional_call` with a parameter
dict, batched over tasks with `torch.func.vmap` and differentiated to second order. So:

* no module holds buffers that change in ``forward`` (no running statistics, no in-place
  updates);
* batch norm is `batch_norm`, written from elementary ops, because the fused
  ``F.batch_norm(training=True)`` gives wrong second-order gradients under ``vmap``
  (measured on torch 2.13, see `batch_norm`);
* training and evaluation mode differ only in `R2D2Net`'s dropout (`evaluation_mode`);
* the classifier is a submodule called ``head`` and everything before it ``features``, so
  ANIL adapts ``head.*`` only by passing those keys.
"""

from metalearn.models.backbones import BACKBONES, build_backbone, sized_by_image
from metalearn.models.conv4 import Conv4, ConvBlock
from metalearn.models.mlp import MLP
from metalearn.models.mode import evaluation_mode
from metalearn.models.norm import (
    NORM_TYPES,
    MetaBatchNorm,
    batch_norm,
    norm_parameter_names,
    normalise,
)
from metalearn.models.r2d2net import R2D2Net
from metalearn.models.resnet12 import ResidualBlock, ResNet12
from metalearn.models.sequence import SequenceTransformer

__all__ = [
    "BACKBONES",
    "MLP",
    "NORM_TYPES",
    "Conv4",
    "ConvBlock",
    "MetaBatchNorm",
    "R2D2Net",
    "ResNet12",
    "ResidualBlock",
    "SequenceTransformer",
    "batch_norm",
    "build_backbone",
    "evaluation_mode",
    "norm_parameter_names",
    "normalise",
    "sized_by_image",
]
