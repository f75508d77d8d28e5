"""The MAML family on `metalearn.engine`: each algorithm a small `MetaLearner` subclass, and
the registry of them by name (`metalearn.algorithms.registry`)."""

from metalearn.algorithms.base import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.algorithms.imaml import IMAML, IMAMLMetrics, implicit_meta_gradient
from metalearn.algorithms.lora_maml import LoRAMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp, msl_weights, multi_step_task_loss
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.protomaml import ProtoMAML, prototype_head
from metalearn.algorithms.registry import (
    ALGORITHMS,
    LEARNERS,
    complete_arguments,
    learner_arguments,
    make_learner,
)
from metalearn.algorithms.reptile import Reptile

__all__ = [
    "ALGORITHMS",
    "ANIL",
    "FOMAML",
    "IMAML",
    "IMAMLMetrics",
    "LEARNERS",
    "LoRAMAML",
    "MAML",
    "MAMLpp",
    "MetaLearner",
    "MetaLossLearner",
    "MetaSGD",
    "ProtoMAML",
    "Reptile",
    "StepMetrics",
    "complete_arguments",
    "implicit_meta_gradient",
    "learner_arguments",
    "make_learner",
    "msl_weights",
    "multi_step_task_loss",
    "prototype_head",
]
