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

JAX lowers every program (each eager op's too) into a new MLIR context
that loads every dialect linked into jaxlib (`mlir.make_ir_context`);
here a thread reuses its context for 200 lowerings
(`reuse_mlir_contexts`, applied once JAX's `mlir` module is imported).
The lowered programs are the same (the compilation cache keys, hashes of
the programs, still hit); only their container is shared. Five
eager-heavy test modules took 24-26 s instead of 37-41 s (two runs
each, warm cache, 2026-12-07), and in a whole `pytest -n 2` the workers'
peak memory was 3.98 and 4.38 GB instead of 6.25-6.52 (each context
holds its own copy of every dialect).
"""

import gc
import importlib.abc
import importlib.util
import sys
import threading

gc.set_threshold(50_000, 20, 20)

# The real one, also where this file runs twice in a process (at start-up
# from PYTHONPATH, then from conftest).
full_collect = getattr(gc.collect, "full_collect", gc.collect)


def _young_collect(generation: int = 2) -> int:
  """`gc.collect` for the test processes: generations 0 and 1 at most."""
  return full_collect(min(generation, 1))


_young_collect.full_collect = full_collect
gc.collect = _young_collect


MLIR_MODULE = "jax._src.interpreters.mlir"
LOWERINGS_PER_CONTEXT = 200


def reuse_mlir_contexts(mlir) -> None:
  """Makes `mlir.make_ir_context` return a thread's context 200 times."""
  if getattr(mlir.make_ir_context, "reused", False):
    return
  make = mlir.make_ir_context
  local = threading.local()

  def reused():
    if getattr(local, "uses", LOWERINGS_PER_CONTEXT) >= LOWERINGS_PER_CONTEXT:
      local.context, local.uses = make(), 0
    local.uses += 1
    return local.context

  reused.reused = True
  reused.original = make
  mlir.make_ir_context = reused


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Applies `reuse_mlir_contexts` when JAX's `mlir` module is imported."""

  def find_spec(self, fullname, path, target=None):
    if fullname != MLIR_MODULE:
      return None
    sys.meta_path.remove(self)  # find the real module's spec
    try:
      spec = importlib.util.find_spec(fullname)
    finally:
      sys.meta_path.insert(0, self)
    if spec is None:
      return None
    self._loader = spec.loader
    spec.loader = self
    return spec

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    if self in sys.meta_path:
      sys.meta_path.remove(self)
    reuse_mlir_contexts(module)


if MLIR_MODULE in sys.modules:
  reuse_mlir_contexts(sys.modules[MLIR_MODULE])
elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
  sys.meta_path.insert(0, _PatchOnImport())
