"""The cached generation loop's state, its stages and the cache's layout.

`CachedState` is what `cached_loop.cached_program`'s while loops carry;
`Stages` are the loop's parts (prefill, phases, result); `cache_layout` and
`phase_extents` split the cache into the prefixes that the loop's phases
read (`generate(cache_phases=)`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax

from tunix_blockdiff.rollout import result as result_lib
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


def cache_layout(prompt_width: int, num_new: int, width: int,
                 cache_phases: int) -> tuple[int, int, list[int]]:
  """(prefill slots, cache slots S, phase segment bounds [0, ..., S]).

  The cache is one array per phase (a segment of slots [bounds[i],
  bounds[i + 1])): phase p reads segments 0..p whole. A slice of one array
  was copied at every step on the TPU (1.5 ms a step at batch 128).
  """
  prefill_len = (prompt_width // width) * width
  # S: whole chunks of the cache (`window_attention.Cache`).
  size = window_attention.chunked_size(
      prefill_len + -(-(width - 1 + num_new) // width) * width)
  bounds = [0] + phase_extents(prefill_len, size, width, cache_phases)
  return prefill_len, size, bounds


def num_phases(prompt_width: int, num_new: int, width: int,
               cache_phases: int) -> int:
  """How many phases `cached_loop.cached_stages` makes (<= `cache_phases`)."""
  return len(cache_layout(prompt_width, num_new, width, cache_phases)[2]) - 1


class Stages(NamedTuple):
  """The cached loop in parts, each traceable on its own.

  `cached_loop.cached_stages` makes them; `finish(run_phase(...run_phase(
  init(), 0)..., num_phases - 1))` is the whole loop
  (`cached_loop.cached_program`); each part may be its own program, the
  state passed (and donated) between them.
  """

  init: Callable[[], CachedState]  # prefill and the initial state
  run_phase: Callable[[CachedState, int], CachedState]  # phase p's steps
  finish: Callable[[CachedState], result_lib.GenerationResult]
  num_phases: int
