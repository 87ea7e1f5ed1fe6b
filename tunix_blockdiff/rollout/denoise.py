"""The model-independent low-confidence block denoiser (DESIGN.md 5.3).

`denoise` fills the completion slots of a fixed-shape canvas, block by block
in logical order, with one call of a target-aligned logits function per step,
inside a single `lax.while_loop` (no host round-trips; `jax.jit`-able with the
logits function closed over).

Every step works on a *window* per row: the `block_size` slots of the row's
active block, window slot j holding logical position `block * block_size + j`.
The transition pieces (`row_status`, `propose`, `select_commits`,
`sampling_noise`, `pad_after_eos`) act on such windows; they live in
`rollout/transition.py`, shared with the block-KV-cached driver
(`rollout/cached_loop.py`), so both make bit-for-bit the same decisions from
the same logits, and are re-exported here.

Shapes: B batch, L canvas length, V vocabulary, W = block_size.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import arrays
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import transition

RowStatus = transition.RowStatus
first_eos_position = transition.first_eos_position
row_status = transition.row_status
sampling_noise = transition.sampling_noise
proposal_log_probs = transition.proposal_log_probs
propose = transition.propose
select_commits = transition.select_commits
pad_after_eos = transition.pad_after_eos
check_vocab = transition.check_vocab
_BIG = transition._BIG

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]


class DenoiseResult(NamedTuple):
  """What `denoise` returns.

  Attributes:
    tokens: int32 [B, L]. Completion slots hold the committed tokens, or
      `pad_token_id` after a row's first committed EOS; every other slot holds
      the input canvas unchanged.
    commit_step: int32 [B, L]. The global step (0-based, the counter of
      `num_steps`) at which each completion slot was committed; -1 for prompt,
      padding and after-EOS slots.
    logprobs: float32 [B, L]. Log-probability of each committed token under
      the proposal distribution of its step (see `propose`); 0 where
      `commit_step` is -1.
    num_steps: int32 []. Calls of the logits function.
  """

  tokens: jax.Array
  commit_step: jax.Array
  logprobs: jax.Array
  num_steps: jax.Array


class DenoiseTrace(NamedTuple):
  """The raw state of a denoising run, before EOS padding.

  Identical to `DenoiseResult` except after a row's first EOS: completion slots
  that were committed there (in the EOS block, before the row stopped) keep
  their token, step and log-prob, and slots never committed hold the mask
  token with step -1. Each step's canvas, and so each recorded log-prob, can
  be rebuilt exactly from this trace (DESIGN.md 5.5): at step t a completion
  slot holds its token iff `0 <= commit_step < t`, else the mask token.

  Attributes:
    tokens: int32 [B, L].
    commit_step: int32 [B, L].
    logprobs: float32 [B, L].
  """

  tokens: jax.Array
  commit_step: jax.Array
  logprobs: jax.Array


# ----------------------------------------------------------------------------
# Input validation.
# ----------------------------------------------------------------------------


def _is_concrete(*values) -> bool:
  return not any(isinstance(a, jax.core.Tracer) for a in values)


def _as_array(name: str, value, kind: str) -> jax.Array:
  value = arrays.asarray(value)
  if value.ndim != 2:
    raise ValueError(
        f"{name} must have shape [batch, length], got {value.shape}"
    )
  if kind == "int" and not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
  if kind == "bool" and value.dtype != jnp.bool_:
    raise TypeError(f"{name} must have dtype bool, got {value.dtype}")
  return value


def check_canvas_values(
    positions: np.ndarray,
    completion: np.ndarray,
    validity: np.ndarray,
    config: config_lib.DenoiseConfig,
) -> None:
  """Data-dependent rules of DESIGN.md 5.3, on concrete (NumPy) arrays.

  Raises ValueError unless, per row: completion slots are valid; valid
  logical positions are non-negative and distinct; the completion is one
  contiguous suffix of the valid logical positions; and, with `shifted`
  alignment, a row with completion slots has logical position 0 as a prompt
  (valid, non-completion) slot.
  """
  if np.any(completion & ~validity):
    raise ValueError("completion slots must be valid (completion & ~validity)")
  for b in range(positions.shape[0]):
    pos = positions[b][validity[b]]
    comp = completion[b][validity[b]]
    if pos.size and pos.min() < 0:
      raise ValueError(f"row {b}: valid logical positions must be >= 0")
    if np.unique(pos).size != pos.size:
      raise ValueError(f"row {b}: valid logical positions must be distinct")
    order = np.argsort(pos, kind="stable")
    comp_sorted = comp[order]
    # Sorted by logical position, completion must be False...False True...True.
    if np.any(comp_sorted[:-1] & ~comp_sorted[1:]):
      raise ValueError(
          f"row {b}: completion must be one contiguous suffix of the row's"
          " valid logical positions (a prompt slot follows a completion slot)"
      )
    if config.alignment == "shifted" and comp.any():
      at_zero = pos == 0
      if not np.any(at_zero & ~comp):
        raise ValueError(
            f"row {b}: alignment='shifted' requires logical position 0 to be a"
            " prompt slot (valid and not completion)"
        )


def _check_inputs(canvas, positions, completion, validity, config, rng):
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  canvas = _as_array("canvas", canvas, "int")
  positions = _as_array("positions", positions, "int")
  completion = _as_array("completion", completion, "bool")
  validity = _as_array("validity", validity, "bool")
  for name, value in (
      ("positions", positions),
      ("completion", completion),
      ("validity", validity),
  ):
    if value.shape != canvas.shape:
      raise ValueError(
          f"{name} must have the shape of canvas {canvas.shape}, got"
          f" {value.shape}"
      )
  if config.temperature > 0 and rng is None:
    raise ValueError("rng (a PRNG key) is required when config.temperature > 0")
  if _is_concrete(positions, completion, validity):
    check_canvas_values(
        np.asarray(positions),
        np.asarray(completion),
        np.asarray(validity),
        config,
    )
  return canvas, positions, completion, validity


# ----------------------------------------------------------------------------
# The transition program.
# ----------------------------------------------------------------------------


def _window_index(
    sorted_index, sorted_positions, num_valid, start, block, block_size
):
  """Physical index of each window slot of each row's active block.

  Returns (index int32 [B, W], present bool [B, W]); absent slots get the
  out-of-range index L so scatters with mode='drop' skip them.
  """
  length = sorted_index.shape[1]
  offsets = jnp.arange(block_size, dtype=jnp.int32)
  rank = start[:, None] + offsets[None, :]  # [B, W] ranks in logical order
  clipped = jnp.minimum(rank, length - 1)
  cand_index = jnp.take_along_axis(sorted_index, clipped, axis=1)
  cand_pos = jnp.take_along_axis(sorted_positions, clipped, axis=1)
  cand_ok = (rank < num_valid[:, None]) & (
      cand_pos // block_size == block[:, None]
  )
  # A block's valid slots need not be contiguous logical positions, so place
  # each candidate at its in-block offset.
  match = cand_ok[:, :, None] & (
      (cand_pos % block_size)[:, :, None] == offsets[None, None, :]
  )
  present = jnp.any(match, axis=1)
  index = jnp.sum(jnp.where(match, cand_index[:, :, None], 0), axis=1)
  return jnp.where(present, index, length).astype(jnp.int32), present


class _LoopState(NamedTuple):
  step: jax.Array
  tokens: jax.Array
  commit_step: jax.Array
  logprobs: jax.Array
  block_steps: jax.Array
  last_block: jax.Array


def denoise_with_trace(
    logits_fn: LogitsFn,
    canvas,
    positions,
    completion,
    validity,
    config: config_lib.DenoiseConfig,
    rng: jax.Array | None = None,
    *,
    threshold: jax.Array | None = None,
) -> tuple[DenoiseResult, DenoiseTrace]:
  """`denoise`, also returning the raw pre-EOS-padding `DenoiseTrace`.

  `threshold` (float32 []) replaces `config.threshold` as a traced value
  (`transition.select_commits`), so one program serves every threshold.
  """
  canvas, positions, completion, validity = _check_inputs(
      canvas, positions, completion, validity, config, rng
  )
  block_size = config.block_size
  batch, length = canvas.shape
  positions = positions.astype(jnp.int32)
  # Completion slots may hold anything on input: they start as mask tokens.
  tokens0 = jnp.where(completion, config.mask_token_id, canvas).astype(
      jnp.int32
  )
  # Valid slots sorted by logical position, computed once: a block's slots are
  # then a contiguous run of ranks.
  sort_key = jnp.where(validity, positions, _BIG)
  sorted_index = jnp.argsort(sort_key, axis=1, stable=True).astype(jnp.int32)
  sorted_positions = jnp.take_along_axis(sort_key, sorted_index, axis=1)
  num_valid = jnp.sum(validity, axis=1, dtype=jnp.int32)
  if rng is None:
    rng = jax.random.key(0)  # unused: greedy proposals draw no noise.
  rows = jnp.arange(batch)[:, None]

  def status(state: _LoopState) -> RowStatus:
    return row_status(
        state.tokens, state.commit_step, positions, completion, config
    )

  def cond(state: _LoopState):
    return jnp.any(status(state).live)

  def body(state: _LoopState) -> _LoopState:
    current = status(state)
    block = jnp.where(current.live, current.active_block, 0)
    start = jnp.sum(
        validity & (positions < block[:, None] * block_size),
        axis=1,
        dtype=jnp.int32,
    )
    index, present = _window_index(
        sorted_index, sorted_positions, num_valid, start, block, block_size
    )
    safe_index = jnp.minimum(index, length - 1)
    window_masked = jnp.take_along_axis(current.masked, safe_index, axis=1)
    eligible = present & window_masked & current.live[:, None]
    window_positions = (
        block[:, None] * block_size + jnp.arange(block_size)[None, :]
    )

    logits = logits_fn(state.tokens, positions)
    if logits.ndim != 3 or logits.shape[:2] != (batch, length):
      raise ValueError(
          "logits_fn must return logits of shape [batch, length, vocab] with"
          f" [batch, length] = {(batch, length)}, got {logits.shape}"
      )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
      raise TypeError(
          f"logits_fn must return floating logits, got {logits.dtype}"
      )
    vocab = logits.shape[2]
    check_vocab(vocab, config)
    window_logits = jnp.take_along_axis(logits, safe_index[:, :, None], axis=1)
    noise = None
    if config.temperature > 0:
      noise = sampling_noise(rng, state.step, batch, block_size, vocab)
    proposal, log_prob = propose(window_logits, config, noise)

    block_steps = jnp.where(block == state.last_block, state.block_steps, 0)
    commit = select_commits(
        jnp.exp(log_prob), eligible, window_positions, block_steps, config,
        threshold,
    )
    # Non-committed window slots scatter to index L and are dropped.
    target = jnp.where(commit, index, length)
    new_tokens = state.tokens.at[rows, target].set(proposal, mode="drop")
    new_commit = state.commit_step.at[rows, target].set(state.step, mode="drop")
    new_logprobs = state.logprobs.at[rows, target].set(log_prob, mode="drop")
    return _LoopState(
        step=state.step + 1,
        tokens=new_tokens,
        commit_step=new_commit,
        logprobs=new_logprobs,
        block_steps=jnp.where(current.live, block_steps + 1, state.block_steps),
        last_block=jnp.where(current.live, block, state.last_block),
    )

  init = _LoopState(
      step=jnp.zeros((), jnp.int32),
      tokens=tokens0,
      commit_step=jnp.full((batch, length), -1, jnp.int32),
      logprobs=jnp.zeros((batch, length), jnp.float32),
      block_steps=jnp.zeros((batch,), jnp.int32),
      last_block=jnp.full((batch,), -1, jnp.int32),
  )
  final = jax.lax.while_loop(cond, body, init)
  trace = DenoiseTrace(final.tokens, final.commit_step, final.logprobs)
  tokens, commit_step, logprobs = pad_after_eos(
      final.tokens,
      final.commit_step,
      final.logprobs,
      positions,
      completion,
      config,
  )
  return DenoiseResult(tokens, commit_step, logprobs, final.step), trace


def denoise(
    logits_fn: LogitsFn,
    canvas,
    positions,
    completion,
    validity,
    config: config_lib.DenoiseConfig,
    rng: jax.Array | None = None,
) -> DenoiseResult:
  """Low-confidence block denoising of a canvas (DESIGN.md 5.3).

  Each step calls `logits_fn` once on the whole canvas. Per row, the active
  block is the lowest logical block with a masked completion slot; its masked
  completion slots are eligible. Proposals come from `propose` (mask token
  removed; argmax when `temperature == 0`, else a sample of the temperature-
  scaled, top-k/top-p-filtered distribution drawn with Gumbel noise
  `jax.random.gumbel(fold_in(rng, step), (B, block_size, V))` indexed by the
  slot's in-block offset); confidence is the proposal's probability. The step
  commits every eligible slot above `threshold` (else the single most
  confident, ties to the lowest logical position), or with `steps_per_block`
  the k most confident, k = ceil(left in block / steps left). Rows stop when
  no masked completion slot is left, or with `eos_token_id` once every slot
  before their first committed EOS is committed; later completion slots then
  become `pad_token_id`. Rows advance independently: each row has its own
  active block, and rows of any prompt/completion lengths share the batch.

  Inputs are in physical order (any permutation, e.g. context-parallel load
  balancing); blocks follow logical positions. Completion slots are treated
  as masked whatever they hold: they are overwritten with the mask token
  before the first step. Invalid slots are passed to `logits_fn` unchanged
  and returned unchanged.

  Validation, before compute: shapes and dtypes (also at trace time under
  `jit`); the data rules of `check_canvas_values` when the arrays are
  concrete (under `jit` they are traced and cannot be inspected); the logits
  shape and vocabulary at trace time.

  Args:
    logits_fn: `logits_fn(tokens int32 [B, L], positions int32 [B, L])` ->
      float target-aligned logits [B, L, V] (e.g. `make_logits_fn`).
    canvas: int [B, L] prompt tokens (completion slots may hold anything).
    positions: int [B, L] logical positions, distinct among a row's valid
      slots.
    completion: bool [B, L] slots to generate: a contiguous suffix of each
      row's valid logical positions.
    validity: bool [B, L] real slots.
    config: `DenoiseConfig`.
    rng: PRNG key, required when `config.temperature > 0`.

  Returns:
    `DenoiseResult(tokens int32 [B, L], commit_step int32 [B, L], logprobs
    float32 [B, L], num_steps int32 [])`.
  """
  result, _ = denoise_with_trace(
      logits_fn, canvas, positions, completion, validity, config, rng
  )
  return result
