"""The output head and the proposals on the slots that can commit, only.

A plain step of the cached loop (no finished block in its call) commits only
among the window's eligible slots: masked, in a live row. Under block 16 /
4 steps these are 16, 12, 8 and 4 of the 16 at the four steps of a block,
yet the head and the proposals' passes over the vocabulary ran on all 16
(on a TPU v5e at batch 32, Qwen3-0.6B: 0.87 ms of head and 0.52 ms of
passes in an 8.3 ms call, at the FLOP roof). `propose_eligible` runs them
on the eligible slots alone, gathered first, rounded up to one of a few
static counts (`sizes`: quarters of the window), chosen per step by a
`lax.switch` on the most any row needs. Under the shifted alignment a
slot's logits are those of the slot before it (the first slot's carried).

The proposals of the eligible slots are those of `transition.propose` on
the full window (each slot's logits are its own row of the head's product);
the other slots get token 0 and log-probability -inf, which no commit reads.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import transition

# Final hidden states [B, K, D] -> greedy (proposal, log_prob) [B, K].
Proposer = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def sizes(width: int) -> tuple[int, ...]:
  """The static slot counts the head may run on: W/4, W/2, 3W/4, W, up."""
  return tuple(sorted({-(-width * i // 4) for i in range(1, 5)}))


def propose_eligible(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    eligible: jax.Array,
    config: config_lib.DenoiseConfig,
    noise: jax.Array | None = None,
    carry: jax.Array | None = None,
    proposer: Proposer | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`transition.propose` on the eligible slots of a window only.

  Args:
    head: The output head: [B, K, D] final hidden states to [B, K, V]
      logits.
    hidden: [B, W, D] the window's final hidden states (same-position
      alignment: slot i's logits are the head of hidden state i); with
      `carry`, [B, W - 1, D] those of slots 0..W-2 (shifted: slot i's are
      the head of hidden state i - 1).
    eligible: bool [B, W] the slots that may commit.
    config: The denoising config.
    noise: float32 [B, W, V] Gumbel noise, required when sampling.
    carry: None (same-position), or float32 [B, V] slot 0's logits
      (shifted alignment: those of the slot before the window).
    proposer: None, or a function from final hidden states [B, K, D] to
      `propose`'s greedy (proposal, log_prob) [B, K] of their logits, in
      place of `head` and `propose` (`head_kernel.greedy_proposals`):
      same-position alignment and temperature 0 only.

  Returns:
    (proposal int32 [B, W], log_prob float32 [B, W]): `propose`'s values at
    the eligible slots; 0 and -inf elsewhere.
  """
  batch = hidden.shape[0]
  width = hidden.shape[1] + (carry is not None)
  if eligible.shape != (batch, width):
    raise ValueError(f"eligible must be [{batch}, {width}], got"
                     f" {eligible.shape}")
  if proposer is not None and (carry is not None or config.temperature > 0):
    raise ValueError("proposer needs the same-position alignment and"
                     " temperature 0")
  options = sizes(width)
  need = jnp.max(jnp.sum(eligible, axis=1))
  branch = jnp.sum(need > jnp.asarray(options[:-1], jnp.int32))
  # Each row's eligible slots first, in window order.
  order = jnp.argsort(~eligible, axis=1, stable=True).astype(jnp.int32)
  slot = jnp.arange(width, dtype=jnp.int32)

  def to_slots(proposal, log_prob, picked):
    """[B, count] proposals back to window slots [B, W], by selects (no
    per-row scatter); a picked slot that is not eligible (a row with fewer)
    is dropped."""
    hit = (picked[:, :, None] == slot[None, None, :]) & jnp.take_along_axis(
        eligible, picked, axis=1)[:, :, None]  # [B, count, W]
    return (jnp.sum(jnp.where(hit, proposal[..., None], 0), axis=1),
            jnp.where(jnp.any(hit, axis=1),
                      jnp.sum(jnp.where(hit, log_prob[..., None], 0.0),
                              axis=1), -jnp.inf))

  def on(count: int):
    def run(hidden, noise):
      picked = order[:, :count]
      if carry is None:  # same-position: slot i's own hidden state
        rows = jnp.take_along_axis(hidden, picked[..., None], axis=1)
        if proposer is not None:  # greedy: no logits at all
          return to_slots(*proposer(rows), picked)
        logits = head(rows)
      elif hidden.shape[1] == 0:  # a 1-slot window: the carry alone
        logits = jnp.broadcast_to(carry[:, None], (batch, count,
                                                   carry.shape[-1]))
      else:  # slot i from hidden i - 1, slot 0 the carry (float32, as the
        # loop's concatenation gives them)
        previous = jnp.maximum(picked - 1, 0)[..., None]
        logits = jnp.where((picked == 0)[..., None], carry[:, None, :],
                           head(jnp.take_along_axis(hidden, previous, axis=1)))
      if noise is not None:
        noise = jnp.take_along_axis(noise, picked[..., None], axis=1)
      return to_slots(*transition.propose(logits, config, noise), picked)
    return run

  return jax.lax.switch(branch, [on(c) for c in options], hidden, noise)


__all__ = ["Proposer", "propose_eligible", "sizes"]
