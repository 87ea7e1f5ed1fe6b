"""Compiled programs shared by every model of one architecture.

A sampler's programs take the model's parameters as arguments and close over
its `nnx.GraphDef` (the architecture and static settings). Keyed by that
GraphDef and the program's static settings, one traced and compiled program
serves a new instance, a reloaded checkpoint, an evaluation's fresh sampler
or a test's fresh tiny model, instead of tracing, lowering and compiling the
same program again (on an accelerator without a persistent compilation
cache, every evaluation of a run would compile it anew). A structurally
different model has another GraphDef and gets its own programs; a qwix LoRA
wrapping makes a new GraphDef each time, so LoRA models never share one
wrongly. GraphDefs are unhashable, so they are compared, not hashed.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class ProgramCache(Generic[T]):
  """Programs by (GraphDef, static key), the least recently used evicted.

  Thread-safe: rollouts may run on other threads.

  Attributes:
    max_programs: How many (GraphDef, key) entries are kept.
  """

  def __init__(self, max_programs: int = 32):
    if not isinstance(max_programs, int) or max_programs < 1:
      raise ValueError(
          f"max_programs must be an int >= 1, got {max_programs!r}")
    self.max_programs = max_programs
    # (key, GraphDef, program), the least recently used first.
    self._entries: list[tuple[Any, Any, T]] = []
    self._lock = threading.RLock()

  def lookup(self, graphdef, key) -> T | None:
    """The program of (`graphdef`, `key`), or None; marks it recent."""
    with self._lock:
      for i, (k, g, program) in enumerate(self._entries):
        if k == key and g == graphdef:
          self._entries.append(self._entries.pop(i))
          return program
    return None

  def get(self, graphdef, key, build: Callable[[], T]) -> T:
    """The program of (`graphdef`, `key`); `build()` makes it when absent."""
    with self._lock:
      program = self.lookup(graphdef, key)
      if program is None:
        program = build()
        self._entries.append((key, graphdef, program))
        del self._entries[:-self.max_programs]
      return program

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()

  def __len__(self) -> int:
    return len(self._entries)


__all__ = ["ProgramCache"]
