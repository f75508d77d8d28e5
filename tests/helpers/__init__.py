"""Helpers shared by several rooms of tests/ (tiny runs, data-set fixtures, pickle writers)."""
