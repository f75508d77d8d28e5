"""The MAML family on `metalearn.engine.outer`: each algorithm a small `MetaLearner` subclass."""

from metalearn.algorithms.base import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.algorithms.build import (
    ALGORITHM_DEFAULTS,
    build_learner,
    learner_config,
    resolve_learner_args,
)
from metalearn.algorithms.imaml import IMAML, IMAMLMetrics, implicit_meta_gradient
from metalearn.algorithms.lora_maml import LoRAMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp, msl_weights, multi_step_task_loss
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.protomaml import ProtoMAML, prototype_head
from metalearn.algorithms.reptile import Reptile

__all__ = [
    "ALGORITHM_DEFAULTS",
    "ANIL",
    "FOMAML",
    "IMAML",
    "IMAMLMetrics",
    "LoRAMAML",
    "MAML",
    "MAMLpp",
    "MetaLearner",
    "MetaLossLearner",
    "MetaSGD",
    "ProtoMAML",
    "Reptile",
    "StepMetrics",
    "build_learner",
    "implicit_meta_gradient",
    "learner_config",
    "msl_weights",
    "multi_step_task_loss",
    "prototype_head",
    "resolve_learner_args",
]
