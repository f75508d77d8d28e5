"""The MAML family on `metalearn.outer`: each algorithm a small `MetaLearner` subclass."""

from metalearn.algorithms.base import MetaLearner, StepMetrics
from metalearn.algorithms.maml import ANIL, FOMAML, MAML

__all__ = ["ANIL", "FOMAML", "MAML", "MetaLearner", "StepMetrics"]
