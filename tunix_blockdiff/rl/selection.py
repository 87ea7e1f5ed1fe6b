"""The exact per-step likelihood of the confidence-based denoiser, closed form.

At each step of `rollout.denoise` every eligible slot j (a masked completion
slot of the row's active block) draws a proposal x_j from its proposal
distribution p_j (`denoise.proposal_log_probs`), independently of the other
slots, with confidence c_j = p_j(x_j); `denoise.select_commits` then keeps a
subset C and discards the other proposals. The probability of what the step
did (C, and the tokens of C) is therefore

* threshold step, every committed c_i above tau:
  prod_{i in C} p_i(x_i) x prod_{j not in C} P(c_j <= tau);
* forced step (nothing above tau; C = {i}, the most confident):
  p_i(x_i) [c_i <= tau] x prod_{j != i} P(j ranks below i);
* with `sub_block_size`, the eligible slots of a step are those of the
  block's first sub-block that still had masked slots (a function of the
  trace, so the likelihood stays exact);
* static step (`steps_per_block`, |C| = k = ceil(eligible / steps left)):
  prod_{i in C} p_i(x_i) x prod_{j not in C} P(j ranks below every i in C),

where "j ranks below i" is `select_commits`' order: c_j < c_i, or c_j = c_i
and j has the higher logical position. With w the weakest member of C (lowest
confidence, ties to the highest position) "below every i in C" is "below w",
and each factor P(.) is a sum over the vocabulary, sum_v p_j(v) [v loses],
computed here as a masked logsumexp: differentiable in the logits, no sampling.
Everything else (an empty or over-full C, a committed confidence on the wrong
side of tau) has probability 0, scored `LOGP_FLOOR` to stay finite.

Attribution to tokens: a step's selection log-factor (the product over the
non-committed slots, plus the floor of an impossible step) is split evenly
over the |C| tokens the step committed, so each token's log-prob is its own
proposal log-prob plus 1/|C| of its step's selection term, and a row's token
log-probs sum to its trajectory log-prob.

Shapes: S step canvases, B batch, N completion slots, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rollout import transition

# Fill of the masked logsumexp: finite, so an empty sum has finite gradients.
_EMPTY_LOG = -1e30


def _masked_logsumexp(log_probs: jax.Array, keep: jax.Array) -> jax.Array:
  """log sum_v exp(log_probs[..., v]) over `keep`; ~-1e30 when none is kept."""
  return jax.nn.logsumexp(jnp.where(keep, log_probs, _EMPTY_LOG), axis=-1)


def _group_reduce(same_block, values, op, fill):
  """Reduces `values` [S, B, N] over each slot's block: [S, B, N]."""
  expanded = jnp.where(same_block[None], values[:, :, None, :], fill)
  return op(expanded, axis=-1)


def per_token_log_likelihood(
    step_log_probs: jax.Array,
    tokens: jax.Array,
    step_key: jax.Array,
    block_rank: jax.Array,
    positions: jax.Array,
    config: config_lib.DenoiseConfig,
) -> jax.Array:
  """Per-token exact log-likelihood of denoising trajectories.

  Step canvases are indexed by s: a block's step is the pair (s, block) that
  committed something, and slot n of that block is eligible there iff it was
  committed at s or later (`step_key[n] >= s`) or never (`step_key[n] ==
  -1`). s may be the global step (one canvas per model call) or the
  within-block step rank (the stacked two-stream canvases of `rl.scoring`);
  in both cases canvas s of slot n must be the canvas its block saw at its
  step s.

  Args:
    step_log_probs: float32 [S, B, N, V] proposal log-probs
      (`denoise.proposal_log_probs`) of completion slot n on canvas s; only
      read at eligible slots.
    tokens: int [B, N] the trace tokens (as committed; any id where never).
    step_key: int [B, N] index s of the canvas that committed each slot, -1
      where none did; in [0, S).
    block_rank: int [B, N] steps its block had taken before the step that
      committed each slot (the static schedule's `block_steps`); any value
      where never committed.
    positions: int [B, N] logical positions (blocks are `pos // block_size`;
      the tie order is lowest position first).
    config: The rollout's `DenoiseConfig` (temperature > 0).

  Returns:
    float32 [B, N]: each committed token's proposal log-prob plus its share
    of its step's selection log-prob (see the module docstring), 0 where
    never committed. Rows sum to the trajectory log-probs.
  """
  num_steps = step_log_probs.shape[0]
  step_log_probs = step_log_probs.astype(jnp.float32)
  step_key = step_key.astype(jnp.int32)
  blocks = positions // config.block_size
  same_block = blocks[:, :, None] == blocks[:, None, :]  # [B, N, N]
  steps = jnp.arange(num_steps, dtype=jnp.int32)[:, None, None]
  committed = step_key[None] == steps  # [S, B, N]
  # A step of slot n's block happened on canvas s.
  has_step = _group_reduce(same_block, committed, jnp.any, False)
  eligible = has_step & ((step_key[None] < 0) | (step_key[None] >= steps))
  if config.sub_block_size is not None:
    # Only the block's first sub-block that still had masked slots took
    # part in the step (`transition.active_sub_block`).
    sub = transition.sub_block_of(positions, config)[None]  # [1, B, N]
    first = _group_reduce(same_block, jnp.where(eligible, sub,
                                                config.block_size),
                          jnp.min, config.block_size)
    eligible = eligible & (sub == first)
  losers = eligible & ~committed

  safe_tokens = jnp.broadcast_to(
      jnp.maximum(tokens, 0)[None, ..., None], committed.shape + (1,)
  )
  own_log_prob = jnp.take_along_axis(step_log_probs, safe_tokens, axis=-1)[
      ..., 0
  ]
  confidence = jnp.exp(own_log_prob)  # as `denoise` computes it
  count = _group_reduce(same_block, committed.astype(jnp.int32), jnp.sum, 0)
  # The weakest committed slot of each step: lowest confidence, then highest
  # logical position (it loses ties).
  weakest_conf = _group_reduce(
      same_block, jnp.where(committed, confidence, jnp.inf), jnp.min, jnp.inf
  )
  at_weakest = committed & (confidence == weakest_conf)
  weakest_pos = _group_reduce(
      same_block, jnp.where(at_weakest, positions[None], -1), jnp.max, -1
  )

  if config.steps_per_block is None:
    tau = jnp.float32(config.threshold)
    all_above = ~_group_reduce(
        same_block, committed & (confidence <= tau), jnp.any, False
    )
    # A threshold step: losers must be <= tau (any position loses the tie).
    # A forced step: one slot, which every loser ranks below.
    possible = all_above | (count == 1)
    bar = jnp.where(all_above, tau, weakest_conf)
    bar_pos = jnp.where(all_above, -1, weakest_pos)
  else:
    rank = _group_reduce(
        same_block, jnp.where(committed, block_rank[None], 0), jnp.max, 0
    )
    left = _group_reduce(same_block, eligible.astype(jnp.int32), jnp.sum, 0)
    steps_left = jnp.maximum(config.steps_per_block - rank, 1)
    possible = count == (left + steps_left - 1) // steps_left
    bar, bar_pos = weakest_conf, weakest_pos

  probs = jnp.exp(step_log_probs)
  loses = (probs < bar[..., None]) | (
      (probs == bar[..., None])
      & (positions[None, :, :, None] > bar_pos[..., None])
  )
  loser_log_prob = jnp.maximum(
      _masked_logsumexp(step_log_probs, loses), scoring.LOGP_FLOOR
  )
  selection = _group_reduce(
      same_block, jnp.where(losers, loser_log_prob, 0.0), jnp.sum, 0.0
  )
  if config.sub_block_size is not None:
    # A commit outside the step's sub-block is impossible.
    possible &= ~_group_reduce(same_block, committed & ~eligible, jnp.any,
                               False)
  selection += jnp.where(possible, 0.0, scoring.LOGP_FLOOR)
  share = selection / jnp.maximum(count, 1)
  per_step = jnp.maximum(own_log_prob, scoring.LOGP_FLOOR) + share
  return jnp.sum(jnp.where(committed, per_step, 0.0), axis=0)


__all__ = ["per_token_log_likelihood"]
