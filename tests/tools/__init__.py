"""Tests of metalearn.tools: the metalearn-* commands and how experiments are found."""
