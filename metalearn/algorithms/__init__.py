"""The MAML family on `metalearn.outer`: each algorithm a small `MetaLearner` subclass."""

from metalearn.algorithms.base import MetaLearner, StepMetrics
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp, msl_weights, multi_step_task_loss
from metalearn.algorithms.metasgd import MetaSGD

__all__ = [
    "ANIL",
    "FOMAML",
    "MAML",
    "MAMLpp",
    "MetaLearner",
    "MetaSGD",
    "StepMetrics",
    "msl_weights",
    "multi_step_task_loss",
]
