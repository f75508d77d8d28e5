"""Tests of metalearn.debug."""
