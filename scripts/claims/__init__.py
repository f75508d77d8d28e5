"""The pieces of `scripts/bench_claims.py`: one module per measured performance claim.

Each module holds a claim's workload, its correctness checks (run by
``tests/test_bench_claims.py`` at tiny sizes) and a ``run(cfg)`` that times it and prints a
markdown table. They import the timing helpers of ``scripts/bench_hvp.py`` and the MAML
workload of ``scripts/bench_maml.py``, so ``scripts/`` must be on ``sys.path`` (it is when
the script runs; the test inserts it).
"""
