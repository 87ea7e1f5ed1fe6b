"""Run at the start of every Python process that the tests launch.

`tests/conftest.py` puts this directory first on `PYTHONPATH`, so the jobs
under `launch`, killed and resumed runs, notebook kernels and benchmark
subprocesses collect garbage as rarely as the xdist workers do (see the
`gc.set_threshold` note in conftest.py): a `tunix-blockdiff sft` of 4 steps
took 21.6 s of CPU instead of 23.1 s.

Libraries' explicit `gc.collect()` calls (Tunix's `RLCluster` and
`show_hbm_usage`, made to free device memory between phases) collect the
young generations only here: each full collection walks a test worker's
whole heap, about 0.9 s, and a whole `pytest -n 2` made 70 of them, 63 s
of the workers' 78 s of collection time (`gc.callbacks`, 2026-12-07).
Reference counting still frees all acyclic garbage at once, and Python's
own schedule still makes full collections; `full_collect` is the real one
(conftest calls it before freezing the imported heap).
"""

import gc

gc.set_threshold(50_000, 20, 20)

# The real one, also where this file runs twice in a process (at start-up
# from PYTHONPATH, then from conftest).
full_collect = getattr(gc.collect, "full_collect", gc.collect)


def _young_collect(generation: int = 2) -> int:
  """`gc.collect` for the test processes: generations 0 and 1 at most."""
  return full_collect(min(generation, 1))


_young_collect.full_collect = full_collect
gc.collect = _young_collect
