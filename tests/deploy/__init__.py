"""Tests of metalearn.deploy: export, archives, AOTInductor packages, prediction."""
