"""Tests of experiments/*.py run end to end, and of experiments/sweeps/."""
