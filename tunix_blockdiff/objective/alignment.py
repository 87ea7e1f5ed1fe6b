"""Which logit predicts each target slot (DESIGN.md section 2).

`same_position`: the logit at slot i predicts slot i.
`shifted`: the logit at the slot whose logical position is `pos(i) - 1` (in
the same document) predicts slot i, as in models initialised from
autoregressive checkpoints. Slots without such a predecessor (logical position
0, padding) keep their own logit; they are never targets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ALIGNMENTS = ("same_position", "shifted")


def _check_alignment(alignment: str) -> None:
  if alignment not in ALIGNMENTS:
    raise ValueError(
        f"Unsupported alignment {alignment!r}: alignment must be one of"
        f" {ALIGNMENTS}"
    )


def shifted_source_index(
    positions: jax.Array,
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """For each slot, the physical index of the slot at logical `pos - 1`.

  Found by sorting each row by (invalid, segment, position), so it is
  O(L log L) with no L x L intermediate and follows logical positions after
  any physical permutation. Padding slots are never a source.

  Args:
    positions: int [B, L] logical positions.
    validity: Optional bool [B, L]; default all valid.
    segment_ids: Optional int [B, L] document ids; default one document.

  Returns:
    int32 [B, L]: the source slot, or the slot itself where no valid slot of
    the same document holds `pos - 1`.
  """
  positions = jnp.asarray(positions, jnp.int32)
  length = positions.shape[1]
  if validity is None:
    validity = jnp.ones(positions.shape, jnp.bool_)
  if segment_ids is None:
    segment_ids = jnp.zeros(positions.shape, jnp.int32)
  validity = jnp.asarray(validity, jnp.bool_)
  segment_ids = jnp.asarray(segment_ids, jnp.int32)

  def one_row(pos, valid, seg):
    invalid = (~valid).astype(jnp.int32)
    order = jnp.lexsort((pos, seg, invalid))  # last key is primary.
    sorted_pos = pos[order]
    sorted_seg = seg[order]
    sorted_valid = valid[order]
    prev_order = jnp.concatenate([order[:1], order[:-1]])
    has_prev = (
        (jnp.arange(length) > 0)
        & sorted_valid
        & jnp.concatenate([jnp.zeros((1,), bool), sorted_valid[:-1]])
        & (jnp.concatenate([sorted_seg[:1], sorted_seg[:-1]]) == sorted_seg)
        & (jnp.concatenate([sorted_pos[:1], sorted_pos[:-1]]) == sorted_pos - 1)
    )
    source_sorted = jnp.where(has_prev, prev_order, order)
    return jnp.zeros((length,), jnp.int32).at[order].set(
        source_sorted.astype(jnp.int32)
    )

  return jax.vmap(one_row)(positions, validity, segment_ids)


def align_logits(
    logits: jax.Array,
    alignment: str,
    positions: jax.Array | None = None,
    validity: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Returns logits aligned so that `out[:, i]` predicts target slot i.

  Args:
    logits: float [B, L, V] model logits in physical order.
    alignment: `same_position` (identity) or `shifted`.
    positions: Optional int [B, L] logical positions (default `arange(L)`).
    validity: Optional bool [B, L]; padding is never taken as a source.
    segment_ids: Optional int [B, L] document ids for packed rows.

  Returns:
    float [B, L, V], same dtype as `logits`.
  """
  _check_alignment(alignment)
  if logits.ndim != 3:
    raise ValueError(f"logits must have shape [batch, length, vocab], got {logits.shape}")
  if alignment == "same_position":
    return logits
  batch, length = logits.shape[:2]
  for name, value in (
      ("positions", positions),
      ("validity", validity),
      ("segment_ids", segment_ids),
  ):
    if value is not None and tuple(jnp.shape(value)) != (batch, length):
      raise ValueError(
          f"{name} must match logits [batch, length] {(batch, length)}, got"
          f" {tuple(jnp.shape(value))}"
      )
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  source = shifted_source_index(positions, validity, segment_ids)
  return jnp.take_along_axis(logits, source[:, :, None], axis=1)
