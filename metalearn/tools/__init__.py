"""The command-line tools, one module per command (``[project.scripts]`` in pyproject.toml).

``metalearn-evaluate`` (`evaluate`), ``metalearn-grid`` (`grid`), ``metalearn-compare``
(`compare`), ``metalearn-export`` (`export`) and ``metalearn-predict`` (`predict`): each
module's ``main(argv)`` parses its flags and returns the exit status (a user's mistake: one
line on stderr and status 2). The top floor of the package: a tool imports any room below
and none imports a tool. Each imports torch and wandb inside the functions that use them, so
``--help`` answers without loading them. `experiments` is how a tool (and the tests and
benchmarks) finds and loads an experiment file.
"""
