"""Differentiable inner optimizers: pure functions of (params, grads, state, hyperparameters).

`SGD` (with momentum and Nesterov momentum), `Adam` and `RMSprop` update a parameter dict
without touching it, so an inner loop built on them is differentiable to any order and runs
under ``torch.func.vmap``; their hyperparameters may be fixed, per tensor or per step, and
learnable (`Hyperparameter`). ``InnerLoop(optimizer=Adam())`` runs MAML's inner loop with
them (`metalearn.engine.inner`)::

    opt = Adam(beta1=0.9, beta2=0.999)
    state = opt.init(params)
    params, state = opt.update(params, grads, state, lr=1e-2, step=0)
"""

from metalearn.optim.adam import Adam, adam_update
from metalearn.optim.base import (
    Hyperparameter,
    InnerOptimizer,
    State,
    check_hyperparameter,
    hyper_at,
    safe_sqrt,
)
from metalearn.optim.rmsprop import RMSprop, rmsprop_update
from metalearn.optim.sgd import SGD, sgd_update

__all__ = [
    "SGD",
    "Adam",
    "Hyperparameter",
    "InnerOptimizer",
    "RMSprop",
    "State",
    "adam_update",
    "check_hyperparameter",
    "hyper_at",
    "rmsprop_update",
    "safe_sqrt",
    "sgd_update",
]
