"""The denoiser's transition pieces, shared with the cached driver.

One step of block diffusion on a window per row (the `block_size` slots of
the row's active block): which rows and slots are still open (`row_status`),
what the step proposes for them (`propose`, `proposal_log_probs`,
`sampling_noise`), which proposals it commits (`select_commits`), and the
padding after a row's first EOS (`pad_after_eos`). `denoise` (over
full-sequence logits) and the block-KV-cached driver (`cached_loop`) both
call exactly these, so they make bit-for-bit the same decisions from the
same logits.

Shapes: B batch, X slots (a canvas or a window), V vocabulary,
W = block_size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import config as config_lib

# Larger than any logical position or block index we compare against.
_BIG = np.iinfo(np.int32).max


class RowStatus(NamedTuple):
  """Per-row progress of a canvas.

  Attributes:
    masked: bool [B, X] completion slots not committed yet.
    live: bool [B] rows that take part in the next step: they have a masked
      completion slot and are not finished by EOS.
    active_block: int32 [B] lowest logical block with a masked completion slot
      (a huge value where there is none).
  """

  masked: jax.Array
  live: jax.Array
  active_block: jax.Array


def first_eos_position(tokens, commit_step, positions, completion, config):
  """int32 [B]: logical position of each row's first committed EOS (or huge)."""
  if config.eos_token_id is None:
    return jnp.full(tokens.shape[:1], _BIG, jnp.int32)
  is_eos = completion & (commit_step >= 0) & (tokens == config.eos_token_id)
  return jnp.min(jnp.where(is_eos, positions, _BIG), axis=1).astype(jnp.int32)


def row_status(
    tokens: jax.Array,
    commit_step: jax.Array,
    positions: jax.Array,
    completion: jax.Array,
    config: config_lib.DenoiseConfig,
) -> RowStatus:
  """Which rows are still denoising, and their active blocks.

  A row is finished by EOS once every completion slot before its first
  committed EOS is committed; masked slots after that EOS then no longer keep
  it alive.

  Args:
    tokens: int [B, X] canvas (any slot order).
    commit_step: int [B, X] commit steps, -1 where not committed.
    positions: int [B, X] logical positions.
    completion: bool [B, X] completion slots (valid ones only).
    config: The denoising config.

  Returns:
    `RowStatus`.
  """
  masked = completion & (commit_step < 0)
  live = jnp.any(masked, axis=1)
  if config.eos_token_id is not None:
    first_eos = first_eos_position(
        tokens, commit_step, positions, completion, config
    )
    pending_before_eos = jnp.any(
        masked & (positions < first_eos[:, None]), axis=1
    )
    finished = (first_eos < _BIG) & ~pending_before_eos
    live &= ~finished
  active_block = jnp.min(
      jnp.where(masked, positions // config.block_size, _BIG), axis=1
  ).astype(jnp.int32)
  return RowStatus(masked=masked, live=live, active_block=active_block)


def sampling_noise(
    rng: jax.Array, step: jax.Array, batch: int, block_size: int, vocab: int
) -> jax.Array:
  """Gumbel noise of one step: float32 [B, W, V].

  Keyed by `fold_in(rng, step)` and laid out by window slot (in-block offset),
  so the cached and cacheless drivers draw the same sample for the same row,
  logical position and step.
  """
  return jax.random.gumbel(
      jax.random.fold_in(rng, step), (batch, block_size, vocab), jnp.float32
  )


def _filter_top_k(logits: jax.Array, top_k: int) -> jax.Array:
  """Keeps the logits >= the k-th largest (ties at the k-th are all kept)."""
  top_k = min(top_k, logits.shape[-1])
  kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
  return jnp.where(logits >= kth, logits, -jnp.inf)


def _filter_top_p(logits: jax.Array, top_p: float) -> jax.Array:
  """Nucleus filter: keeps token i iff the mass of strictly likelier tokens < p.

  Tie-invariant: tokens as likely as the least likely kept one are all kept.
  """
  probs = jax.nn.softmax(logits, axis=-1)
  sorted_probs = -jnp.sort(-probs, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_probs, num_kept - 1, axis=-1)
  return jnp.where(probs >= cutoff, logits, -jnp.inf)


def proposal_log_probs(
    logits: jax.Array, config: config_lib.DenoiseConfig
) -> jax.Array:
  """Log-probabilities of the proposal distribution: float32 [..., V].

  The mask token's logit is removed. Greedy (`temperature == 0`): the softmax
  of the remaining logits. Sampling: the logits are divided by `temperature`,
  then filtered by `top_k`, then by `top_p` (the nucleus of the top-k
  distribution), then normalised; filtered tokens get -inf.

  This is the distribution under which `denoise` records log-probs, so a
  scorer that applies it to fresh logits of a step's canvas reproduces them.

  Args:
    logits: float [..., V] target-aligned logits.
    config: The denoising config.
  """
  return jax.nn.log_softmax(_proposal_logits(logits, config), axis=-1)


def _proposal_logits(
    logits: jax.Array, config: config_lib.DenoiseConfig
) -> jax.Array:
  """The logits `proposal_log_probs` normalises: float32 [..., V]."""
  token = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  logits = _unfiltered(logits, token, config)
  if config.temperature > 0:
    if config.top_k is not None:
      logits = _filter_top_k(logits, config.top_k)
    if config.top_p is not None:
      logits = _filter_top_p(logits, config.top_p)
  return logits


def _unfiltered(logits: jax.Array, token: jax.Array,
                config: config_lib.DenoiseConfig) -> jax.Array:
  """float32 logits of tokens `token` (broadcast), mask token's -inf, / T.

  Elementwise (a select, not an update of the mask token's entry), so XLA
  fuses it into the reductions that read it: an update made the TPU write a
  float32 copy of a bf16 model's [B, W, V] logits (0.94 ms at batch 128,
  Qwen3-0.6B) that every pass then read.
  """
  logits = jnp.where(token == config.mask_token_id, -jnp.inf,
                     logits.astype(jnp.float32))
  if config.temperature > 0:
    logits = logits / config.temperature
  return logits


def propose(
    logits: jax.Array,
    config: config_lib.DenoiseConfig,
    noise: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Proposals and their log-probabilities for every window slot.

  Greedy: the argmax of the logits, the mask token's removed (lowest token
  id on exact ties); it is the argmax of the log-probabilities too, unless
  their rounding ties logits that differ (then the logits decide).
  Sampling: Gumbel-max over the filtered distribution, `argmax(log_probs +
  noise)`, an exact sample of it.

  Args:
    logits: float [B, W, V], any float dtype (computed in float32).
    config: The denoising config.
    noise: float32 [B, W, V] Gumbel noise, required when sampling.

  Returns:
    (proposal int32 [B, W], log_prob float32 [B, W]); the confidence of a
    proposal is `exp(log_prob)`. The mask token is never proposed.
  """
  if config.temperature > 0 and noise is None:
    raise ValueError("noise is required when config.temperature > 0")
  # `proposal_log_probs`, written out (the same operations as
  # `jax.nn.log_softmax`, so the values are the same to the bit) so that the
  # [..., V] log-probabilities are never stored: XLA fuses them into the
  # reductions, and the chosen one is computed from its logit alone. At a
  # real vocabulary that saves writing and reading a float32 copy of the
  # logits. Greedy takes two passes over the logits (the argmax, whose logit
  # is the maximum; then the normaliser), not three.
  sampling = config.temperature > 0
  x = _proposal_logits(logits, config)
  if sampling and (config.top_k is not None or config.top_p is not None):
    pick = lambda p: jnp.take_along_axis(x, p[..., None], axis=-1)
  else:
    # The chosen entries from the raw logits, then the same elementwise
    # transform: `x` itself is never stored (its producer fuses into the
    # reductions).
    pick = lambda p: _unfiltered(
        jnp.take_along_axis(logits, p[..., None], axis=-1), p[..., None],
        config)
  if sampling:
    x_max = jnp.max(x, axis=-1, keepdims=True)
  else:
    proposal = jnp.argmax(x, axis=-1).astype(jnp.int32)
    x_max = pick(proposal)
  x_max = jax.lax.stop_gradient(x_max)
  shifted_logsumexp = jnp.log(
      jnp.sum(jnp.exp(x - x_max), axis=-1, keepdims=True))
  if sampling:
    scores = (x - x_max) - shifted_logsumexp + noise
    proposal = jnp.argmax(scores, axis=-1).astype(jnp.int32)
  chosen = pick(proposal)
  log_prob = ((chosen - x_max) - shifted_logsumexp)[..., 0]
  return proposal, log_prob


def sub_block_of(positions: jax.Array, config: config_lib.DenoiseConfig):
  """int32 sub-block index of each logical position within its block."""
  return (positions % config.block_size) // config.sub_block_size


def active_sub_block(
    eligible: jax.Array,
    positions: jax.Array,
    config: config_lib.DenoiseConfig,
) -> jax.Array:
  """`eligible` [B, W] cut to each row's first sub-block that has any.

  The identity without `sub_block_size`. Rows' windows are one block, so
  the first sub-block is the lowest index among eligible slots.
  """
  if config.sub_block_size is None:
    return eligible
  sub = sub_block_of(positions, config)
  first = jnp.min(jnp.where(eligible, sub, config.block_size), axis=-1,
                  keepdims=True)
  return eligible & (sub == first)


def select_commits(
    confidence: jax.Array,
    eligible: jax.Array,
    positions: jax.Array,
    block_steps: jax.Array,
    config: config_lib.DenoiseConfig,
    threshold: jax.Array | None = None,
) -> jax.Array:
  """Which eligible window slots to commit this step (DESIGN.md 5.3 step 3).

  With `sub_block_size`, eligible slots are first cut to the row's first
  sub-block that has any (`active_sub_block`). Threshold mode: every
  eligible slot with confidence strictly above
  `threshold`; if none, the single most confident (ties: lowest logical
  position). Static mode (`steps_per_block = S`): the k most confident, k =
  ceil(eligible left / (S - steps already taken in this block)), ties ranked
  by lowest logical position.

  Args:
    confidence: float32 [B, W].
    eligible: bool [B, W] masked completion slots of live rows' active blocks.
    positions: int [B, W] logical positions (distinct among eligible slots).
    block_steps: int32 [B] steps each row has taken in its current block.
    config: The denoising config.
    threshold: float32 [] used in place of `config.threshold` (a program's
      operand, so that one compiled program serves every threshold); None:
      `config.threshold`.

  Returns:
    bool [B, W], a subset of `eligible` with at least one slot in every row
    that has an eligible slot.
  """
  eligible = active_sub_block(eligible, positions, config)
  conf_i = confidence[:, :, None]
  conf_j = confidence[:, None, :]
  pos_i = positions[:, :, None]
  pos_j = positions[:, None, :]
  # rank[b, i]: eligible slots that beat slot i (more confident, or as
  # confident at a lower logical position). Windows are one block wide, so
  # the W x W comparison is cheap.
  beats = eligible[:, None, :] & (
      (conf_j > conf_i) | ((conf_j == conf_i) & (pos_j < pos_i))
  )
  rank = jnp.sum(beats, axis=2)
  if config.steps_per_block is not None:
    left = jnp.sum(eligible, axis=1)
    steps_left = jnp.maximum(config.steps_per_block - block_steps, 1)
    count = (left + steps_left - 1) // steps_left
    return eligible & (rank < count[:, None])
  if threshold is None:
    threshold = config.threshold
  above = eligible & (confidence > threshold)
  best = eligible & (rank == 0)
  return jnp.where(jnp.any(above, axis=1, keepdims=True), above, best)


def pad_after_eos(
    tokens: jax.Array,
    commit_step: jax.Array,
    logprobs: jax.Array,
    positions: jax.Array,
    completion: jax.Array,
    config: config_lib.DenoiseConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Completion slots after a row's first committed EOS become padding.

  They get `pad_token_id`, commit step -1 and log-prob 0. Identity without
  `eos_token_id`.

  Args:
    tokens: int32 [B, X]; commit_step: int32 [B, X]; logprobs: float32
      [B, X]; positions: int [B, X] logical positions; completion: bool
      [B, X]; config: the denoising config.

  Returns:
    (tokens, commit_step, logprobs) with the same shapes and dtypes.
  """
  if config.eos_token_id is None:
    return tokens, commit_step, logprobs
  first_eos = first_eos_position(
      tokens, commit_step, positions, completion, config
  )
  after = completion & (positions > first_eos[:, None])
  return (
      jnp.where(after, config.pad_token_id, tokens).astype(jnp.int32),
      jnp.where(after, -1, commit_step).astype(jnp.int32),
      jnp.where(after, 0.0, logprobs).astype(jnp.float32),
  )


def check_vocab(vocab: int, config: config_lib.DenoiseConfig) -> None:
  """Raises unless every special id of `config` is a token of `vocab`."""
  if vocab < 2:
    raise ValueError(
        "logits_fn must return a vocabulary of >= 2 tokens (the mask token is"
        f" never proposed), got V={vocab}"
    )
  for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
    value = getattr(config, name)
    if value is not None and value >= vocab:
      raise ValueError(
          f"config.{name}={value} is outside the logits vocabulary V={vocab}"
      )
