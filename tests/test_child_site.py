"""The test processes' start-up settings (`tests/child_site/sitecustomize.py`)."""

import gc
import os
import pathlib
import runpy
import subprocess
import sys
import threading

import jax
from jax._src.interpreters import mlir
import jax.numpy as jnp
import numpy as np

CHILD_SITE = pathlib.Path(__file__).resolve().parent / "child_site"
SITE = runpy.run_path(str(CHILD_SITE / "sitecustomize.py"))


def test_library_collections_are_young_and_the_real_one_is_kept():
  assert gc.collect.__name__ == "_young_collect"
  assert gc.collect.full_collect is SITE["full_collect"]
  assert gc.get_threshold()[0] == 50_000


def test_a_thread_reuses_its_context_for_a_bounded_number_of_lowerings():
  assert mlir.make_ir_context.reused
  per_context = SITE["LOWERINGS_PER_CONTEXT"]
  contexts = [mlir.make_ir_context() for _ in range(2 * per_context)]
  # A new context every `per_context` calls (the first cycle may have
  # begun before this test): one or two changes, `per_context` apart.
  changes = [i for i in range(1, len(contexts))
             if contexts[i] is not contexts[i - 1]]
  assert len(changes) in (1, 2)
  assert changes[-1] - changes[0] in (0, per_context)
  assert all(isinstance(c, mlir.ir.Context) for c in contexts)
  other = []
  thread = threading.Thread(target=lambda: other.append(mlir.make_ir_context()))
  thread.start()
  thread.join()
  assert all(other[0] is not c for c in contexts)


def test_programs_lowered_in_a_shared_context_are_the_same_programs(
    monkeypatch):

  def program():  # a new function each time: traced and lowered anew
    return jax.jit(lambda x, y: jnp.tanh(x @ y).sum(0) + 1.0)

  x = jnp.arange(12.0).reshape(3, 4)
  y = jnp.ones((4, 5))
  shared = [program().lower(x, y).as_text() for _ in range(3)]
  with monkeypatch.context() as m:  # JAX's own: a new context each time
    m.setattr(mlir, "make_ir_context", mlir.make_ir_context.original)
    fresh = program().lower(x, y).as_text()
  assert shared[0] == shared[1] == shared[2] == fresh
  np.testing.assert_allclose(
      program()(x, y), np.tanh(np.asarray(x) @ np.asarray(y)).sum(0) + 1.0,
      rtol=1e-6)


def test_a_launched_process_patches_jax_when_it_imports_it():
  code = ("import sys; assert 'jax' not in sys.modules;"
          " from jax._src.interpreters import mlir;"
          " import jax.numpy as jnp; print(jnp.ones(3).sum());"
          " print(getattr(mlir.make_ir_context, 'reused', False))")
  env = dict(os.environ, PYTHONPATH=str(CHILD_SITE))
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout.split()
  assert out == ["3.0", "True"]
