"""Target-aligned block-diffusion logits for Tunix causal LMs.

Tunix's Qwen3, Qwen2, Llama3 and Gemma3 models (and any `nnx.Module` with the
same call signature) are called as
`model(tokens [B, L], positions [B, L], cache, attention_mask [B, L, L'])`
and return `(logits [B, L, V], cache)`. This module turns such a model into
the block-diffusion logits functions used by training, rollout and scoring
alike: the attention mask is block-causal from logical positions (or the
two-stream mask), and the alignment is applied, so the result predicts each
slot's clean token at that slot.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff.attention import masks
from tunix_blockdiff.models import registry
from tunix_blockdiff.objective import alignment as alignment_lib

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]


def fresh_view(model):
  """The same model (same arrays) as a module owned by the current trace.

  Inside `lax.while_loop`/`scan` bodies a module built outside the loop
  belongs to an outer trace level, and modules that mutate themselves when
  called (qwix LoRA records attributes on its modules) raise
  `TraceContextError`. Re-merging its split state builds an equivalent module
  at the current level; gradients flow through the shared arrays as before.
  """
  return nnx.merge(*nnx.split(model))


@functools.cache
def _takes_segment_ids(model_type: type) -> bool:
  call = getattr(model_type, "__call__", None)
  try:
    return "segment_ids" in inspect.signature(call).parameters
  except (TypeError, ValueError):
    return False


class Picked(nnx.Module):
  """Stands in for the final norm: the norm, then only the slots picked.

  Every supported family decodes `final_norm(x)` to logits, so picking here
  computes the output head (a large share of a call at a real vocabulary)
  and its logits only for the slots wanted.
  """

  def __init__(self, inner, pick: Callable[[jax.Array], jax.Array]):
    self.inner = inner
    self.pick = pick

  def __call__(self, x):
    return self.pick(self.inner(x))


def picking(model, pick: Callable[[jax.Array], jax.Array] | None):
  """`model`, or a view of it whose logits are only the `pick`ed slots.

  Args:
    model: A Tunix causal LM.
    pick: None, or a function from the final hidden states [B, T, D] to the
      slots whose logits are wanted [B, T', D].
  """
  if pick is None:
    return model
  view = fresh_view(model)
  view.final_norm = Picked(view.final_norm, pick)
  return view


def call_model(model, tokens, positions, attention_mask, segment_ids=None,
               pick=None):
  """Runs a Tunix causal LM without a cache; returns float logits [B, L, V].

  `segment_ids` reach the model only if its `__call__` takes them (Qwen2,
  Qwen3: their flash path needs them); Llama3 and Gemma3 take none, and the
  attention masks built here already separate the documents. `pick`: the
  output head only on some slots (`picking`), logits [B, L', V].
  """
  model = picking(model, pick)
  if segment_ids is None or not _takes_segment_ids(type(model)):
    logits, _ = model(tokens, positions, None, attention_mask)
  else:
    logits, _ = model(
        tokens, positions, None, attention_mask, segment_ids=segment_ids
    )
  return logits


def block_diffusion_logits(
    model,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Single-stream target-aligned logits.

  Args:
    model: Tunix causal LM (see module docstring).
    tokens: int [B, L] canvas (clean and mask tokens), physical order.
    positions: int [B, L] logical positions.
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L] real slots.
    segment_ids: Optional int [B, L] document ids (packed rows).

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of slot i.
  """
  mask = masks.block_causal_mask(
      positions,
      positions,
      block_size,
      q_segment_ids=segment_ids,
      kv_segment_ids=segment_ids,
      kv_valid=validity,
  )
  logits = call_model(model, tokens, positions, mask)
  return alignment_lib.align_logits(
      logits, alignment, positions, validity, segment_ids=segment_ids
  )


def two_stream_source_index(
    positions: jax.Array,
    *,
    block_size: int,
    alignment: str,
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Index into the `[x0 | xt]` logits whose logit predicts each xt slot.

  `same_position`: the xt slot itself (L + i). `shifted`: the slot at logical
  `pos - 1`; inside a block that is the xt stream, but the first slot of a
  block is predicted from the end of the previous block, which at inference
  is clean, so its source is taken from the clean stream x0. A slot without a
  predecessor (logical 0, padding) keeps its own xt slot; it is never a target.

  Args:
    positions: int [B, L] logical positions.
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L].
    segment_ids: Optional int [B, L].

  Returns:
    int32 [B, L] indices into the length-2L axis.
  """
  positions = jnp.asarray(positions, jnp.int32)
  length = positions.shape[1]
  own = jnp.arange(length, dtype=jnp.int32)[None, :] + length
  if alignment == "same_position":
    return jnp.broadcast_to(own, positions.shape)
  if alignment != "shifted":
    raise ValueError(
        f"alignment must be one of {alignment_lib.ALIGNMENTS}, got {alignment!r}"
    )
  source = alignment_lib.shifted_source_index(positions, validity, segment_ids)
  # A slot without a predecessor (a document's logical 0, padding) keeps its
  # own noised-stream logit, as in single-stream alignment, not its clean one.
  has_source = source != jnp.arange(length, dtype=source.dtype)[None, :]
  from_clean = (positions % block_size == 0) & has_source
  return jnp.where(from_clean, source, source + length).astype(jnp.int32)


def two_stream_logits(
    model,
    clean_tokens: jax.Array,
    noised_tokens: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Two-stream (BD3-LM) target-aligned logits for the noised stream.

  The model runs once on `[x0 | xt]` (length 2L) under `masks.two_stream_mask`;
  each noised block sees the clean earlier blocks and itself, exactly the
  context of KV-cached inference.

  Args:
    model: Tunix causal LM.
    clean_tokens: int [B, L] clean sequence x0.
    noised_tokens: int [B, L] corrupted sequence xt.
    positions: int [B, L] logical positions (shared by both streams).
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L].
    segment_ids: Optional int [B, L].

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of xt slot i.
  """
  registry.check_window(
      model,
      2 * positions.shape[1],
      what="two-stream training ([x0 | xt], twice seq_len)",
      fix="Use the single stream, or a seq_len of at most half the window.",
  )
  mask = masks.two_stream_mask(
      positions, block_size, segment_ids=segment_ids, valid=validity
  )
  tokens = jnp.concatenate([clean_tokens, noised_tokens], axis=1)
  both_positions = jnp.concatenate([positions, positions], axis=1)
  source = two_stream_source_index(
      positions,
      block_size=block_size,
      alignment=alignment,
      validity=validity,
      segment_ids=segment_ids,
  )
  # The output head runs on the L source slots only, not on all 2L.
  return call_model(model, tokens, both_positions, mask,
                    pick=source_picker(source))


def source_picker(source: jax.Array) -> Callable[[jax.Array], jax.Array]:
  """Hidden states [B, 2L, D] -> the rows `source` [B, L] names."""
  return lambda hidden: jnp.take_along_axis(hidden, source[:, :, None],
                                            axis=1)


def make_logits_fn(
    model,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> LogitsFn:
  """A `logits_fn(tokens [B, L], positions [B, L]) -> [B, L, V]` for `denoise`.

  The model is closed over (never a static argument: its GraphDef is not
  hashable), so the returned function can be traced inside `jax.jit` and
  inside the denoising loop (see `fresh_view`).
  """
  masks.check_block_size(block_size)

  def logits_fn(tokens, positions):
    return block_diffusion_logits(
        fresh_view(model),
        tokens,
        positions,
        block_size=block_size,
        alignment=alignment,
        validity=validity,
        segment_ids=segment_ids,
    )

  return logits_fn
