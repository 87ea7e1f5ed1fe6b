"""Wall-time medians for the benchmarks (these 2-core machines are noisy)."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np


def median_seconds(run: Callable[[], Any], repeats: int) -> tuple[Any, float]:
  """(the first call's output, the median wall seconds of `repeats` calls).

  Each call's output is fetched to the host (`jax.device_get`) inside its
  timing, so the seconds cover the whole call. Compile (warm up) first: the
  first call is timed like the others.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  first, times = None, []
  for i in range(repeats):
    clock = time.perf_counter()
    out = jax.device_get(run())
    times.append(time.perf_counter() - clock)
    if i == 0:
      first = out
  return first, float(np.median(times))
