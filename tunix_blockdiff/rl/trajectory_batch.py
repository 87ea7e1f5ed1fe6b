"""Trajectory batches: a rollout's trace packed for the scorers.

`prepare_trajectory_batch` validates a rollout (left-padded prompts, trace
tokens, commit steps) and packs it into the `DiffusionTokenBatch` that
`rl.scoring` and `rl.likelihood` consume; `sequence_layout` gives its
full-sequence `[prompt | completion]` view.

Shapes: B batch, P prompt slots (left padded), N completion slots,
L = P + N.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import compat

NEVER_COMMITTED = -1


def is_concrete(*values) -> bool:
  """True when no value is a tracer (eager checks can inspect them)."""
  return not any(isinstance(v, jax.core.Tracer) for v in values)


def prepare_trajectory_batch(
    prompt_tokens,
    prompt_mask,
    completion_tokens,
    commit_step,
    *,
    mask_token_id: int,
    loss_weights=None,
) -> compat.DiffusionTokenBatch:
  """Packs a rollout into the `DiffusionTokenBatch` the scorer consumes.

  Checks run here, before any compute (eagerly, on concrete arrays; inside a
  `jit` only the static checks run).

  Args:
    prompt_tokens: int [B, P] left-padded prompts.
    prompt_mask: bool [B, P] real prompt slots (a contiguous suffix per row).
    completion_tokens: int [B, N] tokens as committed: completion slot j is
      logical position `prompt_length + j`. Slots never committed may hold
      any id.
    commit_step: int [B, N] step that committed each slot, -1 where none did.
    mask_token_id: The mask token id; no committed token may equal it.
    loss_weights: Optional float [B, N] weights of the scored tokens
      (default: 1 where committed). Must be 0 where nothing was committed.

  Returns:
    `DiffusionTokenBatch` with `model_inputs` = {prompt_tokens, prompt_mask,
    completion_tokens, commit_step} (int32/bool), `target_ids` =
    completion tokens [B, N] and `loss_weights` float32 [B, N].

  Raises:
    ValueError / TypeError: missing or malformed commit steps, shape or dtype
      mismatches, committed mask tokens, holes in the prompt mask.
  """
  if commit_step is None:
    raise ValueError(
        "commit_step is required: trajectory-exact scoring rebuilds each"
        " denoising step's canvas from the step that committed every token"
        " (BlockDiffusionRollout returns it with each trajectory)"
    )
  prompt_tokens = _as_int_array("prompt_tokens", prompt_tokens)
  completion_tokens = _as_int_array("completion_tokens", completion_tokens)
  commit_step = _as_int_array("commit_step", commit_step)
  if tuple(jnp.shape(prompt_mask)) != tuple(prompt_tokens.shape):
    raise ValueError(
        "prompt_mask must have the shape of prompt_tokens"
        f" {tuple(prompt_tokens.shape)}, got {tuple(jnp.shape(prompt_mask))}"
    )
  if tuple(commit_step.shape) != tuple(completion_tokens.shape):
    raise ValueError(
        "commit_step must have the shape of completion_tokens"
        f" {tuple(completion_tokens.shape)}, got {tuple(commit_step.shape)}"
    )
  if prompt_tokens.shape[0] != completion_tokens.shape[0]:
    raise ValueError(
        f"prompt_tokens has batch {prompt_tokens.shape[0]} but"
        f" completion_tokens has batch {completion_tokens.shape[0]}"
    )
  if loss_weights is None:
    loss_weights = (commit_step >= 0).astype(jnp.float32)
  elif tuple(jnp.shape(loss_weights)) != tuple(completion_tokens.shape):
    raise ValueError(
        "loss_weights must have the shape of completion_tokens"
        f" {tuple(completion_tokens.shape)}, got"
        f" {tuple(jnp.shape(loss_weights))}"
    )
  if is_concrete(prompt_mask, completion_tokens, commit_step, loss_weights):
    steps = np.asarray(commit_step)
    if np.any(steps < NEVER_COMMITTED):
      raise ValueError("commit_step must be >= -1 (-1 = never committed)")
    if np.any((steps >= 0) & (np.asarray(completion_tokens) == mask_token_id)):
      raise ValueError(
          "completion_tokens holds the mask token at a committed slot; pass"
          " the tokens exactly as the rollout committed them"
      )
    if np.any((steps < 0) & (np.asarray(loss_weights) != 0)):
      raise ValueError("loss_weights must be 0 where commit_step == -1")
    present = np.asarray(prompt_mask).astype(bool)
    if np.any(present[:, :-1] & ~present[:, 1:]):
      raise ValueError(
          "prompt_mask must mark a contiguous suffix of each row (left padding)"
      )
  return compat.DiffusionTokenBatch(
      model_inputs={
          "prompt_tokens": jnp.asarray(prompt_tokens, jnp.int32),
          "prompt_mask": jnp.asarray(prompt_mask, jnp.bool_),
          "completion_tokens": jnp.asarray(completion_tokens, jnp.int32),
          "commit_step": jnp.asarray(commit_step, jnp.int32),
      },
      target_ids=jnp.asarray(completion_tokens, jnp.int32),
      loss_weights=jnp.asarray(loss_weights, jnp.float32),
  )


def _as_int_array(name: str, value):
  if not isinstance(value, (jax.Array, np.ndarray)):
    value = np.asarray(value)
  if value.ndim != 2:
    raise ValueError(
        f"{name} must have shape [batch, length], got {value.shape}"
    )
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
  return value


def sequence_layout(
    model_inputs: Mapping[str, jax.Array], mask_token_id: int
) -> dict[str, jax.Array]:
  """The full-sequence view `[prompt | completion]` of a trajectory batch.

  Args:
    model_inputs: From `prepare_trajectory_batch`.
    mask_token_id: Written into completion slots that were never committed.

  Returns:
    Dict of [B, L] arrays: `tokens` (clean sequence), `positions` (logical),
    `validity`, `completion` (bool) and `commit_step` (-1 on prompt slots).
  """
  prompt_tokens = model_inputs["prompt_tokens"]
  prompt_mask = model_inputs["prompt_mask"].astype(jnp.bool_)
  completion_tokens = model_inputs["completion_tokens"]
  commit_step = model_inputs["commit_step"]
  batch, prompt_width = prompt_tokens.shape
  num_new = completion_tokens.shape[1]
  prompt_lengths = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
  prompt_positions = jnp.maximum(
      jnp.cumsum(prompt_mask.astype(jnp.int32), axis=1) - 1, 0
  )
  completion_positions = prompt_lengths[:, None] + jnp.arange(
      num_new, dtype=jnp.int32
  )
  committed = commit_step >= 0
  return {
      "tokens": (
          jnp.concatenate(
              [
                  prompt_tokens,
                  jnp.where(committed, completion_tokens, mask_token_id),
              ],
              axis=1,
          ).astype(jnp.int32)
      ),
      "positions": jnp.concatenate(
          [prompt_positions, completion_positions], axis=1
      ),
      "validity": jnp.concatenate(
          [prompt_mask, jnp.ones((batch, num_new), jnp.bool_)], axis=1
      ),
      "completion": jnp.concatenate(
          [
              jnp.zeros((batch, prompt_width), jnp.bool_),
              jnp.ones((batch, num_new), jnp.bool_),
          ],
          axis=1,
      ),
      "commit_step": jnp.concatenate(
          [
              jnp.full((batch, prompt_width), NEVER_COMMITTED, jnp.int32),
              commit_step.astype(jnp.int32),
          ],
          axis=1,
      ),
  }
