"""The cached generation loop (DESIGN.md 5.4): jit-traced stages.

`generate(model, prompt_tokens, prompt_lengths, config, max_new_tokens=N)`
runs the same transition as `denoise` (the pieces are shared), but each step
calls the model only on one block-wide window per row against a KV cache of
the row's clean earlier blocks, so the cost of a step is proportional to the
block, not the sequence.

Cache layout. The tokens are kept in each row's *logical* order (slot k is
the row's logical position k, k < T = ceil((P + N) / W) * W); the KV cache
(`[L, B, K, S / TILE, TILE, H]` for keys and for values,
`window_attention.Cache`) holds
them shifted by whole blocks, so that every row's first block after its
prefilled prompt blocks starts at the same cache slot: logical slot k of row
b is cache slot k + shift[b], shift[b] = floor(P / W) * W - floor(len[b] /
W) * W. Rows in phase (every row under one step per block, and most rows
under static schedules) then write their finished blocks at one shared slot,
one in-place update of all rows (`window_attention.write_blocks`). A row
attends to its own cached slots (`valid`) and to the call's own window
(`window_attention.window_call`, which reads the cache and returns the
window's keys instead of writing them), so rows need not agree on anything:
each row keeps its own logical block grid and its own active block, exactly
as in `denoise` (rows advance independently, so the commit steps match the
cacheless program).

Blocks. The grid is absolute from logical position 0. The complete prompt
blocks of each row (`floor(len / W)` of them) are prefilled once. A prompt
whose length is not a multiple of W shares its last block with the first
completion slots; under block-causal attention those prompt slots attend to
the (changing) completion slots, so that block is denoised like any other,
its prompt slots fixed clean. A block's clean keys and values are written
once, when it is final: the first step of the next block (a *fused* step)
runs the model on `[finished block | active block]` (2W slots), and the
finished half's keys and values go into the cache, in place, at the row's
slots [written, written + W) (shifted), before the next fused step reads
it; the other (*plain*) steps run on the active block alone and
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

import jax
import jax.numpy as jnp

from tunix_blockdiff import models
from tunix_blockdiff.rollout import cached_state
from tunix_blockdiff.rollout import head_kernel
from tunix_blockdiff.rollout import kv_cache
from tunix_blockdiff.rollout import result as result_lib
from tunix_blockdiff.rollout import slot_head
from tunix_blockdiff.rollout import transition
from tunix_blockdiff.rollout import window_attention

_State = cached_state.CachedState


def cached_program(model, prompt_tokens, lengths, rng, config, num_new,
                   cache_phases: int = 1, lockstep: bool = False,
                   ragged_cache: bool = False, fused_head: bool = False,
                   threshold: jax.Array | None = None):
  """Traced body of the cached `generate`: every stage in one program."""
  stages = cached_stages(model, prompt_tokens, lengths, rng, config, num_new,
                         cache_phases, lockstep, ragged_cache, fused_head,
                         threshold)
  state = stages.init()
  for phase in range(stages.num_phases):
    state = stages.run_phase(state, phase)
  return stages.finish(state)


def cached_stages(model, prompt_tokens, lengths, rng, config, num_new,
                  cache_phases: int = 1, lockstep: bool = False,
                  ragged_cache: bool = False,
                  fused_head: bool = False,
                  threshold: jax.Array | None = None) -> cached_state.Stages:
  """The cached `generate`'s stages; see the module docstring.

  Every stage recomputes the layout from the same inputs (cheap index
  arithmetic); only `init` calls the model on the prompt.

  `cache_phases` > 1 splits the loop into that many phases, each reading
  only the cache slots that its steps can use (a static prefix of the
  cache, kept as separate arrays: segments 0..p of phase p), instead of
  every slot at every step; the same outputs up to rounding.

  `lockstep` holds a row that has finished its block (its next block's
  first step is a fused one) while any live row is still inside its block,
  so that the rows move to their next blocks together and a fused (2W)
  call is made once per block round instead of at almost every step once
  rows fall out of phase. A held row's step does nothing (no commits; its
  window's logits are discarded), and commit steps count each row's own
  steps, so greedy outputs are those of the default loop (up to rounding);
  sampled ones are other exact draws (the noise is keyed by the program's
  step), and `num_steps` counts the program's steps (held ones included).

  `ragged_cache` reads the cache with `cache_kernel` (only the chunks of
  slots that each block of rows uses, float32 online softmax) instead of
  every slot of the segments: the same outputs up to the rounding of the
  softmax (near-ties aside).

  `fused_head` (greedy, same-position alignment) gets each step's proposals
  from `head_kernel`, which never writes the logits: the same proposals up
  to the rounding of the head's product, log-probs to float32 rounding.

  `threshold` (float32 [], traced) replaces `config.threshold`
  (`transition.select_commits`), so one program serves every threshold.
  """
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

  def call(tokens, call_positions, parts, window_mask, pick,
           head_apply=None):
    """(logits [B, Q', V], keys, values) of a window; the parts are read.

    `pick` selects the slots whose logits are needed (static slices here),
    so the output head runs on those alone; `head_apply` replaces the
    logits (`window_attention.window_call`).
    """
    return window_attention.window_call(
        model, tokens, call_positions, parts, window_mask, pick, head_apply)

  # The cache: logical slot k of row b at cache slot k + shift[b] (module
  # docstring), so every row's prefilled blocks end at `prefill_len`.
  written = (lengths // width) * width
  prefill_len, size, bounds = cached_state.cache_layout(
      prompt_width, num_new, width, cache_phases)
  shift = prefill_len - written
  cache_slot = jnp.arange(size, dtype=jnp.int32)[None, :]
  dtype = kv_cache.activation_dtype(model)

  shifted = config.alignment == "shifted"

  def cached(segments, limit, phase):
    """The `window_call` parts of segments 0..`phase`: logical [0, limit).

    Each part is a chunked segment and valid bool [B, its slots].
    """
    parts = []
    for segment, lo, hi in zip(segments[:phase + 1], bounds, bounds[1:]):
      if ragged_cache:  # the segment's slots [shift, limit + shift)
        parts.append((segment, window_attention.Span(shift - lo,
                                                     limit + shift - lo)))
        continue
      slots = cache_slot[:, lo:hi]
      valid = (slots >= shift[:, None]) & (slots < (limit + shift)[:, None])
      parts.append((segment, valid))
    return parts

  def write(segments, phase, block, start, rows):
    """`block` at the rows' cache slots `start`, in the segments they hit.

    Segment bounds are multiples of the block, so a block lies in one.
    """
    segments = list(segments)
    for i in range(phase + 1):
      lo, hi = bounds[i], bounds[i + 1]
      segments[i] = window_attention.write_blocks(
          segments[i], block, start - lo, rows & (start >= lo) & (start < hi),
          start_step=width)
    return tuple(segments)

  # Shifted: slot i of a block is predicted by the logit of slot i - 1, so a
  # call needs the logits of the W slots before the active block's last
  # (its first slot's comes from the carry, or from the finished block).
  def align(raw_logits, carry):
    """Target-aligned [B, W, V] from the window's needed logits."""
    if config.alignment == "same_position":
      return raw_logits
    return jnp.concatenate([carry[:, None], raw_logits], axis=1)

  def kernel_head(view):
    """`head_kernel`'s greedy proposals from hidden states, or None."""
    if not fused_head:
      return None
    return lambda hidden: head_kernel.greedy_proposals(
        view, hidden, mask_token_id=config.mask_token_id)

  def plain_call(state, block_start, window_valid, eligible, noise, phase):
    """Active window only, against the cache and the fresh block.

    Returns the proposals (proposal int32 [B, W], log_prob float32 [B, W])
    and the state. The head and the proposals run on the eligible slots
    only (`slot_head`): a plain step commits nowhere else.
    """
    tokens = kv_cache.row_slice(state.tokens, block_start, width)
    mask = jnp.broadcast_to(window_valid[:, None, :], (batch, width, width))
    parts = [
        *cached(state.cache, state.fresh_start, phase),
        (state.fresh,
         jnp.broadcast_to(state.fresh_valid[:, None], (batch, width))),
    ]
    proposals, _, _ = call(
        tokens, block_start[:, None] + offsets[None, :], parts, mask,
        (lambda x: x[:, :-1]) if shifted else None,
        lambda view, hidden: slot_head.propose_eligible(
            view.logits, hidden, eligible, config, noise,
            state.carry if shifted else None, kernel_head(view)))
    return proposals, state

  def fused_call(state, block_start, window_valid, pending, phase):
    """[finished block | active window]; the finished half becomes fresh."""
    # The previous fresh block goes into the cache first, so that the
    # cache is written only where nothing of this step has read it yet
    # (XLA then writes in place instead of copying the cache).
    cache = write(state.cache, phase, state.fresh, state.fresh_start + shift,
                  state.fresh_valid)
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
        tokens, call_positions, cached(cache, state.written, phase),
        mask, lambda x: x[:, first:first + width],
        (lambda view, hidden: kernel_head(view)(hidden)) if fused_head
        else None)  # then (proposal, log_prob) in place of the logits
    carry = state.carry
    if shifted:
      carry = jnp.where(pending[:, None], logits[:, 0].astype(jnp.float32),
                        carry)
      logits = logits[:, 1:]
    return align(logits, carry), state._replace(
        cache=cache,
        written=jnp.where(pending, state.written + width, state.written),
        fresh=window_attention.as_block(keys, values, width),
        fresh_start=write_start,
        fresh_valid=pending,
        carry=carry,
    )

  def status_of(state: _State):
    """(row status, active block start int32 [B], pending bool [B])."""
    status = transition.row_status(
        state.tokens, state.commit_step, positions, completion, config
    )
    block_start = jnp.where(status.live, status.active_block, 0) * width
    # The previous block of a live row is final but not yet in the cache.
    pending = status.live & (state.written < block_start)
    return status, block_start, pending

  def step(state: _State, fused: bool, phase: int) -> _State:
    status, block_start, pending = status_of(state)
    # A plain step runs while no row is pending, or (lockstep) with the
    # pending rows held: they act from the next fused step on.
    live = status.live if fused else (status.live & ~pending)
    block = block_start // width
    window_positions = block_start[:, None] + offsets[None, :]
    window_valid = window_positions < ends[:, None]
    eligible = (
        kv_cache.row_slice(status.masked, block_start, width) & live[:, None]
    )
    noise = None
    if config.temperature > 0:
      noise = transition.sampling_noise(rng, state.step, batch, width, vocab)
    if fused:
      logits, state = fused_call(state, block_start, window_valid, pending,
                                 phase)
      proposal, log_prob = (logits if fused_head else
                            transition.propose(logits, config, noise))
    else:
      (proposal, log_prob), state = plain_call(
          state, block_start, window_valid, eligible, noise, phase)
    block_steps = jnp.where(block == state.last_block, state.block_steps, 0)
    commit = transition.select_commits(
        jnp.exp(log_prob), eligible, window_positions, block_steps, config,
        threshold)

    def merge(field, new):
      return kv_cache.row_merge(field, new, commit, block_start)

    return state._replace(
        step=state.step + 1,
        row_step=state.row_step + live.astype(jnp.int32),
        tokens=merge(state.tokens, proposal),
        commit_step=merge(
            state.commit_step,
            jnp.broadcast_to(state.row_step[:, None], proposal.shape)
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
  def any_live(state: _State):
    return jnp.any(status_of(state)[0].live)

  def plain_steps_due(state: _State):
    """Plain steps go on while no row is pending (lockstep: while a live
    row is still inside its block; the pending ones wait)."""
    status, _, pending = status_of(state)
    if lockstep:
      return jnp.any(status.live & ~pending)
    return jnp.any(status.live) & ~jnp.any(pending)

  def outer_body(state: _State, phase: int) -> _State:
    state = step(state, True, phase)
    return jax.lax.while_loop(
        plain_steps_due, lambda s: step(s, False, phase), state
    )

  def init() -> _State:
    """The prefilled cache and the initial state."""
    cache = tuple(window_attention.init_cache(model, batch, hi - lo, dtype)
                  for lo, hi in zip(bounds, bounds[1:]))
    # The shifted alignment's carried logit; a placeholder otherwise.
    carry = jnp.zeros((batch, vocab if shifted else 1), jnp.float32)
    if prefill_len:
      # The complete prompt blocks, in the cache's order: cache slot p holds
      # logical slot p - shift (none where that is negative).
      logical = cache_slot[:, :prefill_len] - shift[:, None]
      keys_ok = logical >= 0
      logical = jnp.maximum(logical, 0)
      q_slot = jnp.arange(prefill_len, dtype=jnp.int32)
      mask = keys_ok[:, None, :] & (
          q_slot[None, None, :] // width <= q_slot[None, :, None] // width)
      # Logits only of the last prefilled slot, logical written - 1 in every
      # row (shifted; else unused): the whole prompt's would be [B, P, V].
      logits, keys, values = call(
          jnp.take_along_axis(tokens0, logical, axis=1), logical, [], mask,
          lambda x: x[:, -1:])
      cache = (window_attention.cache_from_block(
          window_attention.as_block(keys, values, prefill_len), bounds[1]),
               *cache[1:])
      if shifted:
        carry = logits[:, 0].astype(jnp.float32)

    return _State(
        step=jnp.zeros((), jnp.int32),
        row_step=jnp.zeros((batch,), jnp.int32),
        tokens=tokens0,
        commit_step=jnp.full((batch, total), -1, jnp.int32),
        logprobs=jnp.zeros((batch, total), jnp.float32),
        block_steps=jnp.zeros((batch,), jnp.int32),
        last_block=jnp.full((batch,), -1, jnp.int32),
        cache=cache,
        written=written,
        fresh=window_attention.init_block(model, batch, width, dtype),
        fresh_start=written,
        fresh_valid=jnp.zeros((batch,), bool),
        carry=carry,
    )

  # Phases: an outer iteration reads the cache slots of each row's logical
  # [0, written) (shifted) as they are at its start; a phase runs while
  # those lie in its segments.
  def run_phase(state: _State, phase: int) -> _State:
    extent = bounds[phase + 1]

    def phase_live(state: _State):
      live = any_live(state)
      if extent < size:
        live &= jnp.max(state.written + shift) <= extent
      return live

    return jax.lax.while_loop(
        phase_live, lambda s: outer_body(s, phase), state)

  def finish(final: _State) -> result_lib.GenerationResult:
    """The completions (padded after EOS) and the trace of `final`."""
    padded = transition.pad_after_eos(
        final.tokens,
        final.commit_step,
        final.logprobs,
        positions,
        completion,
        config,
    )
    new_slots = (lengths[:, None]
                 + jnp.arange(num_new, dtype=jnp.int32)[None, :])

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

  return cached_state.Stages(init, run_phase, finish, len(bounds) - 1)
