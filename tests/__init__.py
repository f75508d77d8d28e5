"""The tests, one folder per room of the project (metalearn's rooms; ``core`` for its top-level
modules; ``experiments``, ``scripts``, ``docs``; ``baselines`` against learn2learn, higher and
TorchOpt), ``helpers`` shared by several rooms and ``fixtures`` (files read by tests). Packages,
so a test imports a helper by its full name (``from tests.helpers.run_helpers import make``)
with pytest's default import mode putting the repository root on ``sys.path``; no test edits it."""
