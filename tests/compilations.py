"""Counting XLA compilations in a block (shared by tests)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting() -> Iterator[list[str]]:
  """Yields the list of XLA compilations made inside the block.

  A read from the persistent compilation cache counts too (JAX times it as
  a compilation): the list is empty only where no program was needed.
  """
  compiles = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == _EVENT:
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
