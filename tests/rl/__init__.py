"""Tests of metalearn.rl: environments and meta-RL estimators."""
