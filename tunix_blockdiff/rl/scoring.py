"""Trajectory-exact per-token log-probabilities of block-diffusion rollouts.

This module scores each committed token under the proposal distribution of
the canvas of the step that committed it (DESIGN.md 5.5); the product of
those is the `committed_only` likelihood. The exact likelihood adds each
step's selection probability (`rl.likelihood`, `rl.selection`) from the same
canvases. The rollout records each token's commit step; this module rebuilds
every step's canvas from those steps and scores all of them in one batched,
differentiable forward pass:

* Within a block, the steps that committed something are ranked 0, 1, ...
  (a token's *rank* is the number of distinct earlier commit steps of its
  block). At rank r, a block's canvas holds the tokens of ranks < r and the
  mask token elsewhere; earlier blocks are clean; later blocks are unseen.
* The two-stream mask (clean x0 | noised xt) gives every noised block exactly
  that context, so one model call scores rank r for all blocks at once. The
  R ranks (R <= block size) are stacked along the batch axis: one call of
  batch R*B and length 2L scores every action of the rollout.

The public names follow the Tunix diffusion proposals (google/tunix PRs
#1743-#1749): `compute_diffusion_per_token_logps(model, batch, logits_fn,
...)` scores a prepared `DiffusionTokenBatch` with a `DiffusionLogitsFn`.

Shapes: B batch, P prompt slots (left padded), N completion slots,
L = P + N, V vocabulary, R ranks.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import flash
from tunix_blockdiff.attention import masks
from tunix_blockdiff.rl import trajectory_batch
from tunix_blockdiff.rollout import transition

# Floor on a scored log-probability. It never binds under the rollout's own
# parameters (a committed token is always inside its step's top-k/top-p set);
# after an update a token can leave that set, and the floor keeps its score
# (and everything computed from it) finite.
LOGP_FLOOR = -1e4
NEVER_COMMITTED = trajectory_batch.NEVER_COMMITTED
# Batch preparation lives in `rl.trajectory_batch`; re-exported here, where
# callers have always found it.
prepare_trajectory_batch = trajectory_batch.prepare_trajectory_batch
sequence_layout = trajectory_batch.sequence_layout


def commit_ranks(
    commit_step: jax.Array, positions: jax.Array, block_size: int
) -> jax.Array:
  """Rank of each slot's commit step among its block's distinct commit steps.

  Counting distinct earlier steps (not `step - first step of the block`)
  keeps ranks dense even when a batched driver leaves a row idle for a step.

  Args:
    commit_step: int [B, L], -1 where never committed.
    positions: int [B, L] logical positions (blocks are `pos // block_size`).
    block_size: Slots per block.

  Returns:
    int32 [B, L]: the rank (0 where never committed).
  """
  block = positions // block_size
  committed = commit_step >= 0
  same_block = block[:, :, None] == block[:, None, :]
  index = jnp.arange(commit_step.shape[1])
  same_step = same_block & (commit_step[:, :, None] == commit_step[:, None, :])
  # Slot j represents its step value if no earlier slot of its block shares it.
  has_earlier_twin = jnp.any(
      same_step & (index[None, None, :] < index[None, :, None]), axis=2
  )
  represents_step = committed & ~has_earlier_twin
  earlier_steps = (
      same_block
      & represents_step[:, None, :]
      & (commit_step[:, None, :] < commit_step[:, :, None])
  )
  ranks = jnp.sum(earlier_steps, axis=2, dtype=jnp.int32)
  return jnp.where(committed, ranks, 0)


def step_canvases(
    layout: Mapping[str, jax.Array],
    *,
    block_size: int,
    mask_token_id: int,
    num_ranks: int,
) -> tuple[jax.Array, jax.Array]:
  """Every block's noised canvas at each within-block step rank.

  Args:
    layout: From `sequence_layout`.
    block_size: Slots per block.
    mask_token_id: The mask token id.
    num_ranks: R, how many ranks to build.

  Returns:
    (noised int32 [R, B, L], ranks int32 [B, L]). At rank r a completion slot
    holds its token iff it was committed at a rank < r of its block; prompt
    slots are always clean.
  """
  completion = layout["completion"]
  steps = layout["commit_step"]
  ranks = commit_ranks(steps, layout["positions"], block_size)
  rank_axis = jnp.arange(num_ranks, dtype=jnp.int32)[:, None, None]
  visible = ~completion[None] | ((steps >= 0)[None] & (ranks[None] < rank_axis))
  noised = jnp.where(visible, layout["tokens"][None], mask_token_id)
  return noised.astype(jnp.int32), ranks


def make_rank_logits_fn(
    *,
    block_size: int,
    mask_token_id: int,
    alignment: str = "same_position",
    max_steps_per_block: int | None = None,
    attention: config_lib.AttentionConfig | None = None,
) -> Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]:
  """Logits of every completion slot on every within-block step-rank canvas.

  One model call of batch R*B and length 2L (two-stream `[x0 | xt]`, one
  noised stream per within-block step rank) scores all of them.

  Args:
    block_size: Slots per block of the rollout.
    mask_token_id: The mask token id.
    alignment: `same_position` or `shifted`, as the rollout used.
    max_steps_per_block: Static bound R on steps per block; default
      `block_size`, which always suffices (each step commits at least one
      slot of its block). A smaller R (e.g. the rollout's `steps_per_block`)
      saves compute; a trajectory that needs more raises when checked
      eagerly.
    attention: The two-stream call's attention (`flash.chosen_logits`;
      None: dense masks). Splash needs the `with mesh:` context.

  Returns:
    `fn(model, model_inputs) -> (logits float32 [R, B, N, V], ranks int32
    [B, N])`: `logits[r, :, n]` are the target-aligned logits of completion
    slot n on its block's canvas at step rank r (earlier blocks clean, the
    block holding its tokens of ranks < r); `ranks` is each slot's commit
    rank (0 where never committed).
  """
  block_size = masks.check_block_size(block_size)
  if alignment not in config_lib.ALIGNMENTS:
    raise ValueError(
        f"alignment must be one of {config_lib.ALIGNMENTS}, got {alignment!r}"
    )
  num_ranks = block_size if max_steps_per_block is None else max_steps_per_block
  if (
      isinstance(num_ranks, bool)
      or not isinstance(num_ranks, numbers.Integral)
      or num_ranks < 1
  ):
    raise ValueError(
        f"max_steps_per_block must be an int >= 1, got {max_steps_per_block!r}"
    )
  num_ranks = min(int(num_ranks), block_size)

  def rank_logits_fn(model, model_inputs):
    layout = sequence_layout(model_inputs, mask_token_id)
    noised, ranks = step_canvases(
        layout,
        block_size=block_size,
        mask_token_id=mask_token_id,
        num_ranks=num_ranks,
    )
    if trajectory_batch.is_concrete(ranks) and num_ranks < block_size:
      if np.any(
          np.asarray((ranks >= num_ranks) & (layout["commit_step"] >= 0))
      ):
        raise ValueError(
            f"a block took more than max_steps_per_block={num_ranks} steps;"
            " raise it (block_size always suffices)"
        )
    batch, length = layout["tokens"].shape

    def tile(x):
      return jnp.broadcast_to(x[None], (num_ranks,) + x.shape).reshape(
          (num_ranks * batch,) + x.shape[1:]
      )

    logits = flash.chosen_logits(
        model,
        noised.reshape(num_ranks * batch, length),
        tile(layout["positions"]),
        attention=attention,
        clean_tokens=tile(layout["tokens"]),
        block_size=block_size,
        alignment=alignment,
        validity=tile(layout["validity"]),
    )
    logits = logits.reshape((num_ranks, batch, length, logits.shape[-1]))
    num_new = model_inputs["completion_tokens"].shape[1]
    return (
        logits[:, :, length - num_new :, :].astype(jnp.float32),
        ranks[:, length - num_new :],
    )

  return rank_logits_fn


def make_trajectory_logits_fn(
    *,
    block_size: int,
    mask_token_id: int,
    alignment: str = "same_position",
    max_steps_per_block: int | None = None,
    attention: config_lib.AttentionConfig | None = None,
) -> Callable[[Any, Mapping[str, jax.Array]], jax.Array]:
  """A `DiffusionLogitsFn` giving each completion slot its own step's logits.

  Arguments as `make_rank_logits_fn`, whose one model call it reuses.

  Returns:
    `logits_fn(model, model_inputs) -> float32 [B, N, V]`: for completion
    slot j, the target-aligned logits of the canvas of the step that
    committed it (arbitrary where nothing was committed).
  """
  rank_logits_fn = make_rank_logits_fn(
      block_size=block_size,
      mask_token_id=mask_token_id,
      alignment=alignment,
      max_steps_per_block=max_steps_per_block,
      attention=attention,
  )

  def logits_fn(model, model_inputs):
    logits, ranks = rank_logits_fn(model, model_inputs)
    # Each slot keeps the logits of the rank (step) that committed it.
    return jnp.take_along_axis(logits, ranks[None, :, :, None], axis=0)[0]

  return logits_fn


def compute_diffusion_per_token_logps(
    model,
    batch: compat.DiffusionTokenBatch,
    logits_fn: Callable[[Any, Any], jax.Array],
    *,
    config: config_lib.DenoiseConfig,
    stop_gradient: bool = True,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Per-token log-probabilities of a prepared diffusion rollout.

  The first three arguments follow the Tunix proposal (PRs #1743-#1749).
  Where that proposal takes a `temperature`, this takes the rollout's whole
  `DenoiseConfig`, because a block-diffusion rollout samples from the
  proposal distribution of `denoise.proposal_log_probs`: mask token removed,
  then temperature, top-k and top-p (greedy rollouts, temperature 0, are
  scored under the plain softmax, which is their recorded confidence).
  Scoring under that same distribution is what makes the scores reproduce
  the rollout's log-probs, and what makes the GRPO ratio exactly 1 before
  any update.

  Args:
    model: The policy (any model `logits_fn` accepts).
    batch: Target-aligned batch; `loss_weights == 0` marks inactive slots.
    logits_fn: `(model, batch.model_inputs) -> [B, N, V]` target-aligned
      logits (e.g. `make_trajectory_logits_fn(...)`).
    config: The rollout's `DenoiseConfig`.
    stop_gradient: Detach the result from the model.
    return_entropy: Also return each slot's proposal-distribution entropy.

  Returns:
    float32 [B, N] log-probabilities of `batch.target_ids` (0 at inactive
    slots; a token outside the top-k/top-p set of fresh parameters scores
    `LOGP_FLOOR` instead of -inf), and with `return_entropy` float32 [B, N]
    entropies.
  """
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  logits = logits_fn(model, batch.model_inputs)
  targets = jnp.asarray(batch.target_ids)
  if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(targets.shape):
    raise ValueError(
        f"logits_fn returned shape {tuple(logits.shape)}; expected [batch,"
        f" length, vocab] with [batch, length] = {tuple(targets.shape)}"
    )
  if config.mask_token_id >= logits.shape[-1]:
    raise ValueError(
        f"config.mask_token_id={config.mask_token_id} is outside the"
        f" vocabulary V={logits.shape[-1]}"
    )
  active = jnp.asarray(batch.loss_weights) != 0
  # Inactive slots may carry any id or non-finite logits: neutralise them.
  logits = jnp.where(active[..., None], logits.astype(jnp.float32), 0.0)
  targets = jnp.where(active, targets, 0)
  log_probs = transition.proposal_log_probs(logits, config)
  logps = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  logps = jnp.where(active, jnp.maximum(logps, LOGP_FLOOR), 0.0)
  if stop_gradient:
    logps = jax.lax.stop_gradient(logps)
  if not return_entropy:
    return logps
  entropy = jnp.where(active, proposal_entropy(log_probs), 0.0)
  if stop_gradient:
    entropy = jax.lax.stop_gradient(entropy)
  return logps, entropy


def _rollout_kwargs(config: config_lib.DenoiseConfig) -> dict[str, Any]:
  return dict(
      block_size=config.block_size,
      mask_token_id=config.mask_token_id,
      alignment=config.alignment,
      max_steps_per_block=config.steps_per_block,
  )


def proposal_entropy(log_probs: jax.Array) -> jax.Array:
  """Entropy float32 [...] of log-probs [..., V] that may hold -inf."""
  probs = jnp.exp(log_probs)
  # `where` before the product: 0 * -inf would poison values and gradients.
  safe_log_probs = jnp.where(probs > 0, log_probs, 0.0)
  return -jnp.sum(probs * safe_log_probs, axis=-1)


def trajectory_logits_fn_for(config: config_lib.DenoiseConfig,
                             attention=None):
  """`make_trajectory_logits_fn` for rollouts made with `config`."""
  return make_trajectory_logits_fn(**_rollout_kwargs(config),
                                   attention=attention)


def rank_logits_fn_for(config: config_lib.DenoiseConfig, attention=None):
  """`make_rank_logits_fn` for rollouts made with `config`."""
  return make_rank_logits_fn(**_rollout_kwargs(config), attention=attention)


def score_trajectories(
    model,
    prompt_tokens,
    prompt_mask,
    completion_tokens,
    commit_step,
    config: config_lib.DenoiseConfig,
    *,
    stop_gradient: bool = True,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Trajectory-exact per-token log-probs of rollouts made with `config`.

  Under the rollout's own parameters this reproduces the log-probs the
  rollout recorded: same canvases, same proposal distribution.

  Args:
    model: Tunix causal LM used as a block-diffusion model.
    prompt_tokens: int [B, P] left-padded prompts.
    prompt_mask: bool [B, P].
    completion_tokens: int [B, N] tokens as committed (the rollout's trace,
      i.e. `GenerationResult.trace_tokens`).
    commit_step: int [B, N], -1 where never committed
      (`GenerationResult.trace_commit_step`).
    config: The rollout's `DenoiseConfig`.
    stop_gradient: Detach the result from the model.
    return_entropy: Also return per-slot entropies.

  Returns:
    float32 [B, N] log-probs (0 where never committed), and optionally
    float32 [B, N] entropies.
  """
  batch = prepare_trajectory_batch(
      prompt_tokens,
      prompt_mask,
      completion_tokens,
      commit_step,
      mask_token_id=config.mask_token_id,
  )
  return compute_diffusion_per_token_logps(
      model,
      batch,
      trajectory_logits_fn_for(config),
      config=config,
      stop_gradient=stop_gradient,
      return_entropy=return_entropy,
  )
