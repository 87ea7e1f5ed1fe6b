"""The cached generation loop (DESIGN.md 5.4): one jit-traced program.

`generate(model, prompt_tokens, prompt_lengths, config, max_new_tokens=N)`
runs the same transition as `denoise` (the pieces are shared), but each step
calls the model only on one block-wide window per row against a KV cache of
the row's clean earlier blocks, so the cost of a step is proportional to the
block, not the sequence.

Cache layout. The cache holds each row in *logical* order: cache slot k is
the row's logical position k, for k < T = ceil((P + N) / W) * W; the last
2W slots are scratch where the model writes the keys and values of the
current call (its shared write index `end_index` is set to T before every
call). Visibility comes only from the attention mask [B, Q, T + 2W], so rows
need not agree on anything: each row keeps its own logical block grid and its
own active block, exactly as in `denoise` (rows advance independently, so the
commit steps match the cacheless program).

Blocks. The grid is absolute from logical position 0. The complete prompt
blocks of each row (`floor(len / W)` of them) are prefilled once. A prompt
whose length is not a multiple of W shares its last block with the first
completion slots; under block-causal attention those prompt slots attend to
the (changing) completion slots, so that block is denoised like any other,
its prompt slots fixed clean. A block's clean keys and values are written
once, when it is final: the first step of the next block runs the model on
`[finished block | active block]` (2W slots), keeps the finished half's
keys and values in the cache and discards the rest; the other steps run on
the active block alone and keep nothing.

With `alignment='shifted'` the first slot of a block is predicted by the
logit of the previous block's last slot, which is computed (under clean
context, as in the cacheless program) when that block is written, and kept
per row.

Shapes: B batch, P prompt width, N `max_new_tokens`, W `block_size`, V vocab.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tunix_blockdiff import models
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.rollout import denoise as denoise_lib
from tunix_blockdiff.rollout import kv_cache
from tunix_blockdiff.rollout import result as result_lib


class _CachedState(NamedTuple):
  step: jax.Array
  tokens: jax.Array  # int32 [B, T] logical layout
  commit_step: jax.Array  # int32 [B, T]
  logprobs: jax.Array  # float32 [B, T]
  block_steps: jax.Array  # int32 [B]
  last_block: jax.Array  # int32 [B]
  cache: Any
  written: jax.Array  # int32 [B] cache slots [0, written) hold clean keys
  carry: jax.Array  # float32 [B, V] logit of slot written - 1 (shifted)


def cached_program(model, prompt_tokens, lengths, rng, config, num_new):
  """Traced body of the cached `generate`; see the module docstring."""
  width = config.block_size
  batch, prompt_width = prompt_tokens.shape
  total = -(-(prompt_width + num_new) // width) * width  # T
  cache_len = total + 2 * width
  slot = jnp.arange(total, dtype=jnp.int32)[None, :]
  lengths = lengths.astype(jnp.int32)
  ends = lengths + num_new  # logical end of each row

  # Logical layout [B, T]: prompt at [0, len), completion at [len, len + N).
  source = jnp.clip(prompt_width - lengths[:, None] + slot, 0, prompt_width - 1)
  prompt_logical = jnp.take_along_axis(prompt_tokens, source, axis=1)
  completion = (slot >= lengths[:, None]) & (slot < ends[:, None])
  tokens0 = jnp.where(
      slot < lengths[:, None],
      prompt_logical,
      jnp.where(completion, config.mask_token_id, config.pad_token_id),
  ).astype(jnp.int32)
  positions = jnp.broadcast_to(slot, (batch, total))
  offsets = jnp.arange(width, dtype=jnp.int32)
  kv_slot = jnp.arange(cache_len, dtype=jnp.int32)[None, None, :]

  def call(tokens, call_positions, cache, mask):
    logits, new_cache = modeling.fresh_view(model)(
        tokens, call_positions, cache, mask
    )
    return logits.astype(jnp.float32), new_cache

  try:
    vocab = models.model_vocab_size(model)
  except ValueError:  # A module without a config: trace one slot.
    vocab = jax.eval_shape(
        lambda: call(
            tokens0[:, :1],
            positions[:, :1],
            None,
            jnp.ones((batch, 1, 1), jnp.bool_),
        )[0]
    ).shape[-1]
  denoise_lib.check_vocab(vocab, config)

  # Prefill the complete prompt blocks: slots [0, floor(len / W) * W).
  cache = kv_cache.init_cache(model, batch, cache_len)
  written = (lengths // width) * width
  carry = jnp.zeros((batch, vocab), jnp.float32)
  prefill_len = (prompt_width // width) * width
  if prefill_len:
    q_block = jnp.arange(prefill_len, dtype=jnp.int32)[None, :, None] // width
    mask = (kv_slot < written[:, None, None]) & (kv_slot // width <= q_block)
    logits, cache = call(
        tokens0[:, :prefill_len],
        positions[:, :prefill_len],
        kv_cache.at_write_index(cache, 0),
        mask,
    )
    last = jnp.clip(written - 1, 0, prefill_len - 1)
    carry = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]

  def align(raw_logits, carry):
    if config.alignment == "same_position":
      return raw_logits
    return jnp.concatenate([carry[:, None], raw_logits[:, :-1]], axis=1)

  def plain_call(operands):
    """Active window only; the returned cache is dropped."""
    state, block_start, window_valid, _ = operands
    tokens = kv_cache.row_slice(state.tokens, block_start, width)
    mask = (kv_slot < state.written[:, None, None]) | (
        (kv_slot >= total)
        & (kv_slot < total + width)
        & kv_cache.scratch_valid(window_valid, total, cache_len)[:, None, :]
    )
    mask = jnp.broadcast_to(mask, (batch, width, cache_len))
    logits, _ = call(
        tokens,
        block_start[:, None] + offsets[None, :],
        kv_cache.at_write_index(state.cache, total),
        mask,
    )
    return align(logits, state.carry), state.cache, state.written, state.carry

  def fused_call(operands):
    """[finished block | active window]: keeps the finished block's keys."""
    state, block_start, window_valid, pending = operands
    write_start = state.written
    write_positions = write_start[:, None] + offsets[None, :]
    write_valid = pending[:, None] & (write_positions < ends[:, None])
    tokens = jnp.concatenate(
        [
            kv_cache.row_slice(state.tokens, write_start, width),
            kv_cache.row_slice(state.tokens, block_start, width),
        ],
        axis=1,
    )
    call_positions = jnp.concatenate(
        [write_positions, block_start[:, None] + offsets[None, :]], axis=1
    )
    prefix = kv_slot < state.written[:, None, None]
    write_keys = kv_cache.scratch_valid(write_valid, total, cache_len)[
        :, None, :
    ]
    active_keys = kv_cache.scratch_valid(
        window_valid, total + width, cache_len
    )[:, None, :]
    mask = jnp.concatenate(
        [
            jnp.broadcast_to(prefix | write_keys, (batch, width, cache_len)),
            jnp.broadcast_to(
                prefix | write_keys | active_keys, (batch, width, cache_len)
            ),
        ],
        axis=1,
    )
    logits, new_cache = call(
        tokens,
        call_positions,
        kv_cache.at_write_index(state.cache, total),
        mask,
    )
    cache = kv_cache.copy_scratch(
        state.cache, new_cache, total, width, write_start, pending
    )
    carry = jnp.where(pending[:, None], logits[:, width - 1], state.carry)
    written = jnp.where(pending, state.written + width, state.written)
    return align(logits[:, width:], carry), cache, written, carry

  def cond(state: _CachedState):
    return jnp.any(
        denoise_lib.row_status(
            state.tokens, state.commit_step, positions, completion, config
        ).live
    )

  def body(state: _CachedState) -> _CachedState:
    status = denoise_lib.row_status(
        state.tokens, state.commit_step, positions, completion, config
    )
    live = status.live
    block = jnp.where(live, status.active_block, 0)
    block_start = block * width
    window_positions = block_start[:, None] + offsets[None, :]
    window_valid = window_positions < ends[:, None]
    # The previous block of a live row is final but not yet in the cache.
    pending = live & (state.written < block_start)
    logits, cache, written, carry = jax.lax.cond(
        jnp.any(pending),
        fused_call,
        plain_call,
        (state, block_start, window_valid, pending),
    )
    noise = None
    if config.temperature > 0:
      noise = denoise_lib.sampling_noise(rng, state.step, batch, width, vocab)
    proposal, log_prob = denoise_lib.propose(logits, config, noise)
    eligible = (
        kv_cache.row_slice(status.masked, block_start, width) & live[:, None]
    )
    block_steps = jnp.where(block == state.last_block, state.block_steps, 0)
    commit = denoise_lib.select_commits(
        jnp.exp(log_prob), eligible, window_positions, block_steps, config
    )

    def merge(field, new):
      old = kv_cache.row_slice(field, block_start, width)
      return kv_cache.row_update(
          field, jnp.where(commit, new, old), block_start
      )

    return _CachedState(
        step=state.step + 1,
        tokens=merge(state.tokens, proposal),
        commit_step=merge(
            state.commit_step, jnp.full_like(proposal, state.step)
        ),
        logprobs=merge(state.logprobs, log_prob),
        block_steps=jnp.where(live, block_steps + 1, state.block_steps),
        last_block=jnp.where(live, block, state.last_block),
        cache=cache,
        written=written,
        carry=carry,
    )

  init = _CachedState(
      step=jnp.zeros((), jnp.int32),
      tokens=tokens0,
      commit_step=jnp.full((batch, total), -1, jnp.int32),
      logprobs=jnp.zeros((batch, total), jnp.float32),
      block_steps=jnp.zeros((batch,), jnp.int32),
      last_block=jnp.full((batch,), -1, jnp.int32),
      cache=cache,
      written=written,
      carry=carry,
  )
  final = jax.lax.while_loop(cond, body, init)
  padded = denoise_lib.pad_after_eos(
      final.tokens,
      final.commit_step,
      final.logprobs,
      positions,
      completion,
      config,
  )
  new_slots = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]

  def completion_of(x):
    return jnp.take_along_axis(x, new_slots, axis=1)

  return result_lib.GenerationResult(
      tokens=completion_of(padded[0]),
      commit_step=completion_of(padded[1]),
      logprobs=completion_of(padded[2]),
      num_steps=final.step,
      prompt_tokens=prompt_tokens,
      prompt_lengths=lengths,
      trace_tokens=completion_of(final.tokens),
      trace_commit_step=completion_of(final.commit_step),
      trace_logprobs=completion_of(final.logprobs),
  )
