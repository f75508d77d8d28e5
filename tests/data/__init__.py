"""Tests of metalearn.data: loaders, samplers, augmentations, published file formats."""
