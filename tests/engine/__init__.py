"""Tests of metalearn.engine: inner and outer loops, chunking, the planner, compiled steps."""
