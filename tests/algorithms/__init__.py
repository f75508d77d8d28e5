"""Tests of metalearn.algorithms: the learners against independent references."""
