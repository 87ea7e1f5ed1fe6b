"""`CallCounterRNG`: a rollout engine's sampling noise, one key per call.

Call i of `generate` samples with `fold_in(base key, i)`, so the call
counter is the RNG's whole state: the rl and opd jobs save `calls` with
each checkpoint and set it back on resume, and a resumed run draws the
noise an uninterrupted one would. Shared by `BlockDiffusionRollout` and
`DiffusionGemmaRollout`.
"""

from __future__ import annotations

import jax
import numpy as np
from tunix.rl.rollout import base_rollout


class CallCounterRNG:
  """Mixin: `_init_rng(seed)` in `__init__`, then `_next_key` per call."""

  def _init_rng(self, seed: int) -> None:
    self._base_key = jax.random.key(seed)
    self._calls = 0

  @property
  def calls(self) -> int:
    """`generate` calls so far: call i samples with `fold_in(seed key, i)`."""
    return self._calls

  @calls.setter
  def calls(self, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise TypeError(f"calls must be an int, got {type(value).__name__}")
    if value < 0:
      raise ValueError(f"calls must be >= 0, got {value}")
    self._calls = int(value)

  def _next_key(self, rollout_config: base_rollout.RolloutConfig) -> jax.Array:
    """The key of this call: `RolloutConfig.seed` (an int or a key) or the
    engine's seed, folded with the call count (then incremented)."""
    seed = rollout_config.seed
    if seed is None:
      base = self._base_key
    elif isinstance(seed, (int, np.integer)):
      base = jax.random.key(int(seed))
    else:
      base = seed
    key = jax.random.fold_in(base, self._calls)
    self._calls += 1
    return key


__all__ = ["CallCounterRNG"]
