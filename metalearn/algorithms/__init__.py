"""The MAML family on `metalearn.engine`: each algorithm a small `MetaLearner` subclass, and
the registry of them by name (`metalearn.algorithms.registry`)."""

from metalearn.algorithms.base import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.algorithms.heads import HeadLearner, LinearHead
from metalearn.algorithms.imaml import IMAML, IMAMLMetrics, implicit_meta_gradient
from metalearn.algorithms.lora_maml import LoRAMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp, msl_weights, multi_step_task_loss
from metalearn.algorithms.metaoptnet import MetaOptNet, svm_classifier
from metalearn.algorithms.metaoptnet_lr import MetaOptNetLR, logistic_classifier
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.protomaml import ProtoMAML, prototype_head
from metalearn.algorithms.protonet import ProtoNet, prototype_classifier
from metalearn.algorithms.r2d2 import R2D2, ridge_classifier
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
    "HeadLearner",
    "IMAML",
    "IMAMLMetrics",
    "LEARNERS",
    "LinearHead",
    "LoRAMAML",
    "MAML",
    "MAMLpp",
    "MetaLearner",
    "MetaLossLearner",
    "MetaOptNet",
    "MetaOptNetLR",
    "MetaSGD",
    "ProtoMAML",
    "ProtoNet",
    "R2D2",
    "Reptile",
    "StepMetrics",
    "complete_arguments",
    "implicit_meta_gradient",
    "learner_arguments",
    "logistic_classifier",
    "make_learner",
    "msl_weights",
    "multi_step_task_loss",
    "prototype_classifier",
    "prototype_head",
    "ridge_classifier",
    "svm_classifier",
]
