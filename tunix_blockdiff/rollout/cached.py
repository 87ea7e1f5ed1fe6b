"""Exact block-KV-cached generation for Tunix models (DESIGN.md 5.4).

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

import numbers
from typing import Any, NamedTuple
import weakref

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import modeling
from tunix_blockdiff.rollout import denoise as denoise_lib


class GenerationResult(NamedTuple):
  """What `generate` returns (cached and cacheless alike).

  Completion slot n of row b is the row's logical position
  `prompt_lengths[b] + n`. Steps are global: one step is one model call of
  the denoising loop, shared by all rows (`num_steps` of them).

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
    layout = sequence_layout(self.prompt_tokens, self.prompt_lengths, completion)
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


# ----------------------------------------------------------------------------
# Model plumbing.
# ----------------------------------------------------------------------------


def model_vocab_size(model) -> int | None:
  """The logits width from a Tunix model's config, or None if it has none.

  Read from the config rather than traced with `jax.eval_shape`: a nested
  trace inside the jitted program breaks models that mutate themselves when
  called (qwix LoRA records state on its modules).
  """
  config = getattr(model, "config", None)
  for name in ("vocab_size", "num_embed"):
    value = getattr(config, name, None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
      return int(value)
  return None


def _activation_dtype(model):
  dtype = getattr(getattr(model, "config", None), "dtype", None)
  if dtype is not None:
    return dtype
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf.dtype
  return jnp.float32


def init_cache(model, batch: int, cache_len: int) -> dict[str, Any]:
  """An empty KV cache in Tunix's layout for `model`.

  Uses `model.init_cache` when the model has it (Qwen3, Gemma3); otherwise
  (Llama3, Qwen2 in Tunix 0.1.7) builds `{'layer_i': {'k', 'v': [B,
  cache_len, num_kv_heads, head_dim], 'end_index': int32 [B]}}` from the
  model's config, as those models read it.
  """
  dtype = _activation_dtype(model)
  if hasattr(model, "init_cache"):
    return model.init_cache(batch, cache_len, dtype)
  config = model.config
  num_layers = getattr(config, "num_layers", None) or len(model.layers)
  shape = (batch, cache_len, config.num_kv_heads, config.head_dim)
  return {
      f"layer_{i}": {
          "k": jnp.zeros(shape, dtype),
          "v": jnp.zeros(shape, dtype),
          "end_index": jnp.zeros((batch,), jnp.int32),
      }
      for i in range(num_layers)
  }


def _at_write_index(cache, index: int):
  """The cache with every layer's shared write index set to `index`."""
  return {
      name: dict(layer, end_index=jnp.full_like(layer["end_index"], index))
      for name, layer in cache.items()
  }


def _row_slice(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
  """x[b, start[b] : start[b] + size] for every row b."""
  return jax.vmap(
      lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, size, axis=0)
  )(x, start)


def _row_update(x: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
  """x with x[b, start[b] : start[b] + len] = update[b] for every row b."""
  return jax.vmap(
      lambda row, u, s: jax.lax.dynamic_update_slice_in_dim(row, u, s, axis=0)
  )(x, update, start)


def _copy_scratch(old_cache, new_cache, scratch: int, size: int, start, keep):
  """Copies new_cache[:, scratch:scratch+size] to row slots [start, start+size).

  Only rows with `keep` change; everything else is `old_cache`.
  """
  out = {}
  for name, layer in old_cache.items():
    updated = dict(layer)
    for key in ("k", "v"):
      fresh = jax.lax.dynamic_slice_in_dim(
          new_cache[name][key], scratch, size, 1
      )
      current = _row_slice(layer[key], start, size)
      chosen = jnp.where(keep[:, None, None, None], fresh, current)
      updated[key] = _row_update(layer[key], chosen, start)
    out[name] = updated
  return out


# ----------------------------------------------------------------------------
# The cached program.
# ----------------------------------------------------------------------------


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


def _cached_program(model, prompt_tokens, lengths, rng, config, num_new):
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

  vocab = model_vocab_size(model)
  if vocab is None:
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
  cache = init_cache(model, batch, cache_len)
  written = (lengths // width) * width
  carry = jnp.zeros((batch, vocab), jnp.float32)
  prefill_len = (prompt_width // width) * width
  if prefill_len:
    q_block = jnp.arange(prefill_len, dtype=jnp.int32)[None, :, None] // width
    mask = (kv_slot < written[:, None, None]) & (kv_slot // width <= q_block)
    logits, cache = call(
        tokens0[:, :prefill_len],
        positions[:, :prefill_len],
        _at_write_index(cache, 0),
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
    tokens = _row_slice(state.tokens, block_start, width)
    mask = (kv_slot < state.written[:, None, None]) | (
        (kv_slot >= total)
        & (kv_slot < total + width)
        & _scratch_valid(window_valid, total, cache_len)[:, None, :]
    )
    mask = jnp.broadcast_to(mask, (batch, width, cache_len))
    logits, _ = call(
        tokens,
        block_start[:, None] + offsets[None, :],
        _at_write_index(state.cache, total),
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
            _row_slice(state.tokens, write_start, width),
            _row_slice(state.tokens, block_start, width),
        ],
        axis=1,
    )
    call_positions = jnp.concatenate(
        [write_positions, block_start[:, None] + offsets[None, :]], axis=1
    )
    prefix = kv_slot < state.written[:, None, None]
    write_keys = _scratch_valid(write_valid, total, cache_len)[:, None, :]
    active_keys = _scratch_valid(window_valid, total + width, cache_len)[
        :, None, :
    ]
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
        tokens, call_positions, _at_write_index(state.cache, total), mask
    )
    cache = _copy_scratch(
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
    eligible = _row_slice(status.masked, block_start, width) & live[:, None]
    block_steps = jnp.where(block == state.last_block, state.block_steps, 0)
    commit = denoise_lib.select_commits(
        jnp.exp(log_prob), eligible, window_positions, block_steps, config
    )

    def merge(field, new):
      old = _row_slice(field, block_start, width)
      return _row_update(field, jnp.where(commit, new, old), block_start)

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

  return GenerationResult(
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


def _scratch_valid(valid: jax.Array, offset: int, cache_len: int) -> jax.Array:
  """bool [B, cache_len]: True at scratch slots offset + j where valid[b, j]."""
  width = valid.shape[1]
  return jnp.pad(valid, ((0, 0), (offset, cache_len - offset - width)))


def _cacheless_program(model, prompt_tokens, lengths, rng, config, num_new):
  """`denoise` over full-sequence block-causal logits, as a GenerationResult."""
  lengths = lengths.astype(jnp.int32)
  placeholder = jnp.zeros((prompt_tokens.shape[0], num_new), jnp.int32)
  tokens, positions, validity, completion = sequence_layout(
      prompt_tokens, lengths, placeholder
  )
  logits_fn = modeling.make_logits_fn(
      model,
      block_size=config.block_size,
      alignment=config.alignment,
      validity=validity,
  )
  result, trace = denoise_lib.denoise_with_trace(
      logits_fn, tokens, positions, completion, validity, config, rng
  )
  width = prompt_tokens.shape[1]
  return GenerationResult(
      tokens=result.tokens[:, width:],
      commit_step=result.commit_step[:, width:],
      logprobs=result.logprobs[:, width:],
      num_steps=result.num_steps,
      prompt_tokens=prompt_tokens,
      prompt_lengths=lengths,
      trace_tokens=trace.tokens[:, width:],
      trace_commit_step=trace.commit_step[:, width:],
      trace_logprobs=trace.logprobs[:, width:],
  )


# ----------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------

# model -> {(config, shapes, use_cache): (graphdef, jitted program)}. Keyed by
# the model object (never by its GraphDef, which is unhashable); the stored
# GraphDef is compared on every call so a structurally changed model is
# recompiled rather than merged into a stale graph.
_PROGRAMS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _program(model, graphdef, key, use_cache: bool):
  per_model = _PROGRAMS.setdefault(model, {})
  entry = per_model.get(key)
  if entry is not None and entry[0] == graphdef:
    return entry[1]
  config, num_new = key[0], key[1]
  build = _cached_program if use_cache else _cacheless_program

  def run(state, prompt_tokens, lengths, rng):
    merged = nnx.merge(graphdef, state)
    return build(merged, prompt_tokens, lengths, rng, config, num_new)

  jitted = jax.jit(run)
  per_model[key] = (graphdef, jitted)
  return jitted


def _check_generate_inputs(
    prompt_tokens, prompt_lengths, config, max_new_tokens, rng
):
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, numbers.Integral
  ):
    raise TypeError(
        f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}"
    )
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_lengths = jnp.asarray(prompt_lengths)
  if prompt_tokens.ndim != 2:
    raise ValueError(
        "prompt_tokens must have shape [batch, prompt_width], got"
        f" {prompt_tokens.shape}"
    )
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise TypeError(
        f"prompt_tokens must have an integer dtype, got {prompt_tokens.dtype}"
    )
  if prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(
        f"prompt_lengths must have shape [batch] = {prompt_tokens.shape[:1]},"
        f" got {prompt_lengths.shape}"
    )
  if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise TypeError(
        f"prompt_lengths must have an integer dtype, got {prompt_lengths.dtype}"
    )
  if config.temperature > 0 and rng is None:
    raise ValueError("rng (a PRNG key) is required when config.temperature > 0")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    lengths = np.asarray(prompt_lengths)
    minimum = 1 if config.alignment == "shifted" else 0
    if np.any(lengths < minimum) or np.any(lengths > prompt_tokens.shape[1]):
      raise ValueError(
          f"prompt_lengths must lie in [{minimum}, prompt_width ="
          f" {prompt_tokens.shape[1]}]"
          + (" (alignment='shifted' needs a prompt)" if minimum else "")
          + f", got {lengths.tolist()}"
      )
  return prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32)


def _check_model_for_cache(
    model, config, prompt_width: int, num_new: int
) -> None:
  """Raises for attention variants that ignore the explicit cache mask."""
  model_config = getattr(model, "config", None)
  if getattr(model_config, "use_flash_attention", False):
    raise ValueError(
        "generate(use_cache=True) needs the dense attention path (it passes an"
        " explicit block mask against the KV cache, which Tunix's flash branch"
        " ignores): build the rollout model with use_flash_attention=False, or"
        " pass use_cache=False"
    )
  window = getattr(model_config, "sliding_window_size", None)
  width = config.block_size
  cache_len = -(-(prompt_width + num_new) // width) * width + 2 * width
  if window is not None and cache_len > window:
    raise ValueError(
        "generate(use_cache=True) keeps the cache in logical order plus 2 *"
        f" block_size scratch slots ({cache_len} here); the model's sliding"
        f" window ({window}) indexes the cache by physical slot, so the cached"
        " driver is exact only while that length fits in the window. Shorten"
        " the rollout or pass use_cache=False"
    )


def generate(
    model,
    prompt_tokens,
    prompt_lengths,
    config: config_lib.DenoiseConfig,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    use_cache: bool = True,
) -> GenerationResult:
  """Block-diffusion generation with a Tunix model (DESIGN.md 5.4).

  The whole loop is one jitted program, compiled once per (model, config,
  shapes, `use_cache`) and reused; the model's current parameters are passed
  in on every call, so updated weights need no recompilation.

  With `use_cache=True` each step runs the model on one block-wide window per
  row against the row's clean earlier blocks in the KV cache (see the module
  docstring); with `use_cache=False` it runs `denoise` over full-sequence
  block-causal logits (`make_logits_fn`). Both give the same tokens and commit
  steps up to floating-point near-ties.

  Args:
    model: A Tunix causal LM called as `model(tokens, positions, cache,
      attention_mask)` (Qwen3, Qwen2, Llama3, ...). The cached driver needs
      dense attention (`use_flash_attention=False`) and, for models with a
      sliding window (Gemma3), a window of at least the cache length.
    prompt_tokens: int [B, P] prompts, LEFT-padded: row b's prompt is its last
      `prompt_lengths[b]` slots.
    prompt_lengths: int [B] in [0, P] ([1, P] with `shifted` alignment).
    config: `DenoiseConfig`.
    max_new_tokens: N >= 1 completion slots per row.
    rng: PRNG key; required when `config.temperature > 0`.
    use_cache: Cached driver (True) or cacheless `denoise` (False).

  Returns:
    `GenerationResult` (completion tokens, commit steps and log-probs [B, N],
    `num_steps`, the echoed prompts and the pre-padding trace).
  """
  prompt_tokens, prompt_lengths = _check_generate_inputs(
      prompt_tokens, prompt_lengths, config, max_new_tokens, rng
  )
  if use_cache:
    _check_model_for_cache(
        model, config, prompt_tokens.shape[1], int(max_new_tokens)
    )
  if rng is None:
    rng = jax.random.key(0)  # unused by greedy proposals
  graphdef, state = nnx.split(model)
  key = (config, int(max_new_tokens), bool(use_cache))
  program = _program(model, graphdef, key, use_cache)
  return program(state, prompt_tokens, prompt_lengths, rng)
