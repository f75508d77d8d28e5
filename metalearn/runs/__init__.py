"""Runs: a run's recipe, the experiment loop that trains it, its lifecycle (state, resume,
user errors, signals), W&B tracking and reading runs back, the typed command line, and
evaluation on freshly drawn tasks."""
