"""Tests of metalearn.second_order: Hessians, HVPs, CG, eigenvalues, traces."""
