"""Tests of metalearn's top-level modules (autograd, functional, implicit,
distributed, allocator) and of its import layering."""
