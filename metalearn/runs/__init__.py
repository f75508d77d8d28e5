"""Runs: an experiment's arguments (checked, resolved, resumed) and the recipe they are, the
`Run` an experiment's own loop uses (lock, resume, signals, W&B, progress, checkpoints), the
metric names, the lifecycle's state and user errors, W&B tracking and reading runs back, the
typed command line, and evaluation on freshly drawn tasks."""
