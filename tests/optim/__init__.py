"""Tests of metalearn.optim: the differentiable inner optimizers."""
