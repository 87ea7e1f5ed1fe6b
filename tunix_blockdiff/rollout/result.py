"""What `generate` returns, and the cacheless row layout of its rows.

Shapes: B batch, P prompt width, N `max_new_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GenerationResult(NamedTuple):
  """What `generate` returns (cached and cacheless alike).

  Completion slot n of row b is the row's logical position
  `prompt_lengths[b] + n`. Steps are global: one step is one model call of
  the denoising loop, shared by all rows (`num_steps` of them). Under the
  cached driver's `lockstep` a step a row was held in is not one of its
  own: its commit steps count the calls it acted in (the default loop's
  numbers), while `num_steps` counts every call.

  Attributes:
    tokens: int32 [B, N] the completion; `pad_token_id` after the first EOS.
    commit_step: int32 [B, N] step at which each slot was committed; -1 after
      the first EOS.
    logprobs: float32 [B, N] log-prob of each committed token under the
      proposal distribution of its step (`denoise.proposal_log_probs`); 0
      where `commit_step` is -1.
    num_steps: int32 [] denoising model calls (not counting the prefill).
    prompt_tokens: int32 [B, P] the left-padded prompts, echoed.
    prompt_lengths: int32 [B] the prompt lengths, echoed.
    trace_tokens: int32 [B, N] the canvas as the denoiser left it, before EOS
      padding: every committed token (also those committed after the first
      EOS, in its block, before the row stopped); the mask token where a slot
      was never committed.
    trace_commit_step: int32 [B, N] commit steps of `trace_tokens` (-1: never).
    trace_logprobs: float32 [B, N] log-probs of `trace_tokens` (0: never).
  """

  tokens: jax.Array
  commit_step: jax.Array
  logprobs: jax.Array
  num_steps: jax.Array
  prompt_tokens: jax.Array
  prompt_lengths: jax.Array
  trace_tokens: jax.Array
  trace_commit_step: jax.Array
  trace_logprobs: jax.Array

  def sequence(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The full rows in the cacheless physical layout.

    Returns:
      (tokens int32 [B, P + N], positions int32 [B, P + N], validity bool
      [B, P + N], completion bool [B, P + N]): `[left padding | prompt |
      completion]`, completion from `tokens` (EOS-padded), padding slots at
      logical position 0 and invalid.
    """
    return sequence_layout(self.prompt_tokens, self.prompt_lengths, self.tokens)

  def canvas_at(self, step, mask_token_id: int) -> jax.Array:
    """The canvas the model saw at `step`: int32 [B, P + N].

    Completion slot n holds `trace_tokens` iff `0 <= trace_commit_step <
    step`, else `mask_token_id`; use it with the positions and validity of
    `sequence()`. Rows already finished at `step` are rebuilt the same way;
    their logits at that step were not used.
    """
    committed = (self.trace_commit_step >= 0) & (self.trace_commit_step < step)
    completion = jnp.where(committed, self.trace_tokens, mask_token_id)
    layout = sequence_layout(
        self.prompt_tokens, self.prompt_lengths, completion
    )
    return layout[0]


def sequence_layout(prompt_tokens, prompt_lengths, completion_tokens):
  """Rows `[left padding | prompt | completion]` as `denoise` inputs.

  Args:
    prompt_tokens: int [B, P] left-padded prompts.
    prompt_lengths: int [B] prompt lengths.
    completion_tokens: int [B, N] completion slots (any content).

  Returns:
    (tokens int32 [B, P + N], positions int32 [B, P + N], validity bool
    [B, P + N], completion bool [B, P + N]); padding slots sit at logical
    position 0 and are invalid.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  batch, width = prompt_tokens.shape
  num_new = completion_tokens.shape[1]
  index = jnp.arange(width + num_new, dtype=jnp.int32)[None, :]
  start = (width - lengths)[:, None]
  validity = index >= start
  positions = jnp.where(validity, index - start, 0)
  tokens = jnp.concatenate(
      [prompt_tokens, jnp.asarray(completion_tokens, jnp.int32)], axis=1
  )
  completion = jnp.broadcast_to(index >= width, (batch, width + num_new))
  return tokens, positions.astype(jnp.int32), validity, completion
