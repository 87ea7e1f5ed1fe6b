"""The cached generation loop (DESIGN.md 5.4): one jit-traced program.

`generate(model, prompt_tokens, prompt_lengths, config, max_new_tokens=N)`
runs the same transition as `denoise` (the pieces are shared), but each step
calls the model only on one block-wide window per row against a KV cache of
the row's clean earlier blocks, so the cost of a step is proportional to the
block, not the sequence.

Cache layout. The cache holds each row in *logical* order: slot k is the
row's logical position k, for k < T = ceil((P + N) / W) * W (`[L, B, K,
T, H]` for keys and for values, `window_attention.Cache`). A row attends to its slots
[0, written) and to the call's own window (`window_attention.window_call`,
which reads the cache and returns the window's keys instead of writing
them), so rows need not agree on anything: each row keeps its own logical
block grid and its own active block, exactly as in `denoise` (rows advance
independently, so the commit steps match the cacheless program).

Blocks. The grid is absolute from logical position 0. The complete prompt
blocks of each row (`floor(len / W)` of them) are prefilled once. A prompt
whose length is not a multiple of W shares its last block with the first
completion slots; under block-causal attention those prompt slots attend to
the (changing) completion slots, so that block is denoised like any other,
its prompt slots fixed clean. A block's clean keys and values are written
once, when it is final: the first step of the next block (a *fused* step)
runs the model on `[finished block | active block]` (2W slots) and writes
the finished half's keys and values at the row's slots [written, written +
W) in place; the other (*plain*) steps run on the active block alone and
write nothing.

Loop. No `lax.cond` picks between the two call shapes (a conditional that
updates the cache makes XLA copy all of it): each outer iteration makes one
fused step, then plain steps while no row has a finished block to write.

With `alignment='shifted'` the first slot of a block is predicted by the
logit of the previous block's last slot, which is computed (under clean
context, as in the cacheless program) when that block is written, and kept
per row.

Shapes: B batch, P prompt width, N `max_new_tokens`, W `block_size`, V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_blockdiff import models
from tunix_blockdiff.rollout import kv_cache
from tunix_blockdiff.rollout import result as result_lib
from tunix_blockdiff.rollout import transition
from tunix_blockdiff.rollout import window_attention


class _CachedState(NamedTuple):
  step: jax.Array
  tokens: jax.Array  # int32 [B, T] logical layout
  commit_step: jax.Array  # int32 [B, T]
  logprobs: jax.Array  # float32 [B, T]
  block_steps: jax.Array  # int32 [B]
  last_block: jax.Array  # int32 [B]
  cache: window_attention.Cache  # slots [0, fresh_start) hold clean keys
  written: jax.Array  # int32 [B] slots [0, written) are final, clean keys
  # The block finished by the last fused step, not yet in `cache`: its keys
  # [B, K, W, H] per layer, its slot and whether each row finished one.
  fresh: window_attention.Cache
  fresh_start: jax.Array  # int32 [B]
  fresh_valid: jax.Array  # bool [B]
  carry: jax.Array  # float32 [B, V] logit of slot written - 1 (shifted;
  # [B, 1] zeros otherwise)


def cached_program(model, prompt_tokens, lengths, rng, config, num_new):
  """Traced body of the cached `generate`; see the module docstring."""
  width = config.block_size
  batch, prompt_width = prompt_tokens.shape
  total = -(-(prompt_width + num_new) // width) * width  # T
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

  vocab = models.model_vocab_size(model)
  transition.check_vocab(vocab, config)

  def call(tokens, call_positions, parts, window_mask, pick):
    """(logits [B, Q', V], keys, values) of a window; the parts are read.

    `pick` selects the slots whose logits are needed (static slices here),
    so the output head runs on those alone.
    """
    return window_attention.window_call(
        model, tokens, call_positions, parts, window_mask, pick)

  # Prefill the complete prompt blocks: slots [0, floor(len / W) * W).
  cache = window_attention.init_cache(
      model, batch, total, kv_cache.activation_dtype(model))
  written = (lengths // width) * width
  # The shifted alignment's carried logit; a placeholder otherwise.
  shifted = config.alignment == "shifted"
  carry = jnp.zeros((batch, vocab if shifted else 1), jnp.float32)
  prefill_len = (prompt_width // width) * width
  if prefill_len:
    q_slot = jnp.arange(prefill_len, dtype=jnp.int32)
    keys_ok = q_slot[None, :] < written[:, None]
    mask = keys_ok[:, None, :] & (
        q_slot[None, None, :] // width <= q_slot[None, :, None] // width)
    # Logits only of each row's last prefilled slot (shifted; else one
    # unused slot): the whole prompt's would be [B, P, V] float32.
    last = jnp.clip(written - 1, 0, prefill_len - 1)
    logits, keys, values = call(
        tokens0[:, :prefill_len], positions[:, :prefill_len], [], mask,
        lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1))
    cache = window_attention.write_rows(
        cache, window_attention.as_block(keys, values, prefill_len),
        jnp.zeros_like(written))
    if shifted:
      carry = logits[:, 0]

  # Shifted: slot i of a block is predicted by the logit of slot i - 1, so a
  # call needs the logits of the W slots before the active block's last
  # (its first slot's comes from the carry, or from the finished block).
  def align(raw_logits, carry):
    """Target-aligned [B, W, V] from the window's needed logits."""
    if config.alignment == "same_position":
      return raw_logits
    return jnp.concatenate([carry[:, None], raw_logits], axis=1)

  def plain_call(state, block_start, window_valid, pending):
    """Active window only, against the cache and the fresh block."""
    del pending
    tokens = kv_cache.row_slice(state.tokens, block_start, width)
    mask = jnp.broadcast_to(window_valid[:, None, :], (batch, width, width))
    parts = [
        (state.cache, slot < state.fresh_start[:, None]),
        (state.fresh,
         jnp.broadcast_to(state.fresh_valid[:, None], (batch, width))),
    ]
    logits, _, _ = call(tokens, block_start[:, None] + offsets[None, :],
                        parts, mask,
                        (lambda x: x[:, :-1]) if shifted else None)
    return align(logits, state.carry), state

  def fused_call(state, block_start, window_valid, pending):
    """[finished block | active window]; the finished half becomes fresh."""
    # The previous fresh block goes into the cache first, so that the
    # cache is written only where nothing of this step has read it yet
    # (XLA then writes in place instead of copying the cache).
    cache = window_attention.write_rows(state.cache, state.fresh,
                                        state.fresh_start)
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
    keys_ok = jnp.concatenate([write_valid, window_valid], axis=1)
    # The finished half sees itself; the active half sees both halves.
    sees_active = jnp.arange(2 * width) >= width
    mask = keys_ok[:, None, :] & (
        sees_active[None, :, None] | ~sees_active[None, None, :])
    # The active half's logits; shifted: the W slots from the finished
    # block's last (the active block's first target) on.
    first = width - 1 if shifted else width
    logits, keys, values = call(
        tokens, call_positions, [(cache, slot < state.written[:, None])],
        mask, lambda x: x[:, first:first + width])
    carry = state.carry
    if shifted:
      carry = jnp.where(pending[:, None], logits[:, 0], carry)
      logits = logits[:, 1:]
    return align(logits, carry), state._replace(
        cache=cache,
        written=jnp.where(pending, state.written + width, state.written),
        fresh=window_attention.as_block(keys, values, width),
        fresh_start=write_start,
        fresh_valid=pending,
        carry=carry,
    )

  def status_of(state: _CachedState):
    """(row status, active block start int32 [B], pending bool [B])."""
    status = transition.row_status(
        state.tokens, state.commit_step, positions, completion, config
    )
    block_start = jnp.where(status.live, status.active_block, 0) * width
    # The previous block of a live row is final but not yet in the cache.
    pending = status.live & (state.written < block_start)
    return status, block_start, pending

  def step(state: _CachedState, fused: bool) -> _CachedState:
    status, block_start, pending = status_of(state)
    live = status.live
    block = block_start // width
    window_positions = block_start[:, None] + offsets[None, :]
    window_valid = window_positions < ends[:, None]
    call_fn = fused_call if fused else plain_call
    logits, state = call_fn(state, block_start, window_valid, pending)
    noise = None
    if config.temperature > 0:
      noise = transition.sampling_noise(rng, state.step, batch, width, vocab)
    proposal, log_prob = transition.propose(logits, config, noise)
    eligible = (
        kv_cache.row_slice(status.masked, block_start, width) & live[:, None]
    )
    block_steps = jnp.where(block == state.last_block, state.block_steps, 0)
    commit = transition.select_commits(
        jnp.exp(log_prob), eligible, window_positions, block_steps, config
    )

    def merge(field, new):
      return kv_cache.row_merge(field, new, commit, block_start)

    return state._replace(
        step=state.step + 1,
        tokens=merge(state.tokens, proposal),
        commit_step=merge(
            state.commit_step, jnp.full_like(proposal, state.step)
        ),
        logprobs=merge(state.logprobs, log_prob),
        block_steps=jnp.where(live, block_steps + 1, state.block_steps),
        last_block=jnp.where(live, block, state.last_block),
    )

  # No `lax.cond` between the two call shapes: a conditional that updates
  # the cache makes XLA copy the whole cache on entry and exit. Instead each
  # outer iteration makes one fused step (finished blocks written; none at
  # the very start), then plain steps while no row has a finished block to
  # write; the cache flows through both loops and is updated in place.
  def any_live(state: _CachedState):
    return jnp.any(status_of(state)[0].live)

  def nothing_pending(state: _CachedState):
    status, _, pending = status_of(state)
    return jnp.any(status.live) & ~jnp.any(pending)

  def outer_body(state: _CachedState) -> _CachedState:
    state = step(state, fused=True)
    return jax.lax.while_loop(
        nothing_pending, lambda s: step(s, fused=False), state
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
      fresh=window_attention.init_cache(
          model, batch, width, kv_cache.activation_dtype(model)),
      fresh_start=written,
      fresh_valid=jnp.zeros((batch,), bool),
      carry=carry,
  )
  final = jax.lax.while_loop(any_live, outer_body, init)
  padded = transition.pad_after_eos(
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
