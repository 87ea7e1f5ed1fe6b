"""The cached generation loop's state, and the cache's phase segments.

`CachedState` is what `cached_loop.cached_program`'s while loops carry;
`phase_extents` splits the cache into the prefixes that the loop's phases
read (`generate(cache_phases=)`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax

from tunix_blockdiff.rollout import window_attention


def phase_extents(prefill_len: int, size: int, width: int,
                  phases: int) -> list[int]:
  """The cache prefix each of `phases` phases reads: increasing, the last S.

  The slots after the prefill are split evenly, rounded up to a multiple of
  the block and of the cache's chunk (`window_attention.TILE`, a TPU tile's
  rows), capped at `size` (whole chunks).
  """
  step = math.lcm(width, window_attention.TILE)
  extents = []
  for p in range(1, phases + 1):
    end = prefill_len + -(-(size - prefill_len) * p // phases)
    end = min(size, -(-end // step) * step)
    if not extents or end > extents[-1]:
      extents.append(end)
  return extents


class CachedState(NamedTuple):
  """The cached loop's carry (`cached_loop.cached_program`)."""

  step: jax.Array  # the program's steps (model calls after the prefill)
  row_step: jax.Array  # int32 [B] each row's own steps (held ones not)
  tokens: jax.Array  # int32 [B, T] logical layout
  commit_step: jax.Array  # int32 [B, T]
  logprobs: jax.Array  # float32 [B, T]
  block_steps: jax.Array  # int32 [B]
  last_block: jax.Array  # int32 [B]
  # Chunked segments, one per phase; logical [0, fresh_start), shifted.
  cache: tuple[window_attention.Cache, ...]
  written: jax.Array  # int32 [B] logical slots [0, written) are final
  # The block finished by the last fused step, not yet in `cache`: its keys
  # [B, K, W, H] per layer, its slot and whether each row finished one.
  fresh: window_attention.Cache
  fresh_start: jax.Array  # int32 [B]
  fresh_valid: jax.Array  # bool [B]
  carry: jax.Array  # float32 [B, V] logit of slot written - 1 (shifted;
  # [B, 1] zeros otherwise)
