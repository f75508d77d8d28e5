"""Tests of scripts/: the benchmarks, transfer_check.py and gpu_check.sh."""
