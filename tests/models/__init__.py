"""Tests of metalearn.models: backbones and their functional paths."""
