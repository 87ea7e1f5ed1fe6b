"""Dense block-causal and two-stream attention masks from logical positions.

Every mask here is computed from *logical* positions (a token's position in
its own document), never from physical array indices, so the same function is
right for packed documents that do not start at block multiples, for partial
final blocks, for left padding and after context-parallel reordering.

Shapes: B batch, Q query length, K key length, L sequence length.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from tunix_blockdiff import arrays


def check_block_size(block_size) -> int:
  """Returns `block_size` as an int or raises naming the rule."""
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
    raise TypeError(
        f"block_size must be an int, got {type(block_size).__name__}"
    )
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  return int(block_size)


def _as_batched_int(name: str, value) -> jax.Array:
  value = arrays.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
  if value.ndim == 1:
    value = value[None, :]
  if value.ndim != 2:
    raise ValueError(f"{name} must have shape [batch, length], got {value.shape}")
  return value


def _check_same_shape(name: str, value, reference_name: str, shape) -> jax.Array:
  value = arrays.asarray(value)
  if value.ndim == 1:
    value = value[None, :]
  if value.shape != tuple(shape):
    raise ValueError(
        f"{name} must have the shape of {reference_name} {tuple(shape)}, got"
        f" {value.shape}"
    )
  return value


def block_causal_mask(
    q_positions,
    kv_positions,
    block_size: int,
    *,
    q_segment_ids=None,
    kv_segment_ids=None,
    kv_valid=None,
) -> jax.Array:
  """Block-causal attention mask from logical positions.

  `attend[b, q, k] = same_doc & kv_valid[b, k] & (pos_q // block_size >=
  pos_k // block_size)`. `block_size=1` is causal; `block_size >= L` is
  bidirectional within each document.

  Args:
    q_positions: int [B, Q] (or [Q]) logical positions of the queries.
    kv_positions: int [B, K] (or [K]) logical positions of the keys.
    block_size: Slots per block, >= 1.
    q_segment_ids: Optional int [B, Q] document ids of the queries.
    kv_segment_ids: Optional int [B, K] document ids of the keys; required
      exactly when `q_segment_ids` is given.
    kv_valid: Optional bool [B, K]; False keys are never attended.

  Returns:
    bool [B, Q, K].
  """
  block_size = check_block_size(block_size)
  q_positions = _as_batched_int("q_positions", q_positions)
  kv_positions = _as_batched_int("kv_positions", kv_positions)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
        "q_segment_ids and kv_segment_ids must be given together or not at all"
    )
  batch = max(q_positions.shape[0], kv_positions.shape[0])
  for name, value in (("q_positions", q_positions), ("kv_positions", kv_positions)):
    if value.shape[0] not in (1, batch):
      raise ValueError(
          f"{name} batch size {value.shape[0]} does not broadcast to {batch}"
      )
  q_block = q_positions // block_size
  kv_block = kv_positions // block_size
  attend = q_block[:, :, None] >= kv_block[:, None, :]
  if q_segment_ids is not None:
    q_segment_ids = _check_same_shape(
        "q_segment_ids", q_segment_ids, "q_positions", q_positions.shape
    )
    kv_segment_ids = _check_same_shape(
        "kv_segment_ids", kv_segment_ids, "kv_positions", kv_positions.shape
    )
    attend &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if kv_valid is not None:
    kv_valid = _check_same_shape(
        "kv_valid", kv_valid, "kv_positions", kv_positions.shape
    ).astype(jnp.bool_)
    attend &= kv_valid[:, None, :]
  return jnp.broadcast_to(attend, (batch,) + attend.shape[1:])


def two_stream_mask(
    positions,
    block_size: int,
    *,
    segment_ids=None,
    valid=None,
) -> jax.Array:
  """Mask for the two-stream input `[x0 | xt]` of length 2L (BD3-LM).

  Query and key index i < L is the clean stream x0, i >= L the noised stream
  xt; both streams share `positions`. With `blk = pos // block_size`:

  * clean query -> clean key: block-causal (`blk_k <= blk_q`);
  * noised query -> clean key: strictly earlier blocks (`blk_k < blk_q`);
  * noised query -> noised key: the same block only (`blk_k == blk_q`);
  * clean query -> noised key: never.

  All of it within the same document and only to valid keys. So each noised
  block sees exactly what exact KV-cached inference sees: clean earlier
  blocks and itself.

  Args:
    positions: int [B, L] (or [L]) logical positions shared by both streams.
    block_size: Slots per block, >= 1.
    segment_ids: Optional int [B, L] document ids.
    valid: Optional bool [B, L] validity of both streams' slots.

  Returns:
    bool [B, 2L, 2L].
  """
  block_size = check_block_size(block_size)
  positions = _as_batched_int("positions", positions)
  block = positions // block_size
  q_block = block[:, :, None]
  k_block = block[:, None, :]
  same_doc = jnp.ones((1, 1, 1), jnp.bool_)
  if segment_ids is not None:
    segment_ids = _check_same_shape(
        "segment_ids", segment_ids, "positions", positions.shape
    )
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  key_ok = jnp.ones((1, 1, 1), jnp.bool_)
  if valid is not None:
    valid = _check_same_shape("valid", valid, "positions", positions.shape)
    key_ok = valid.astype(jnp.bool_)[:, None, :]
  clean_to_clean = (k_block <= q_block) & same_doc & key_ok
  noised_to_clean = (k_block < q_block) & same_doc & key_ok
  noised_to_noised = (k_block == q_block) & same_doc & key_ok
  clean_to_noised = jnp.zeros_like(noised_to_noised)
  top = jnp.concatenate([clean_to_clean, clean_to_noised], axis=2)
  bottom = jnp.concatenate([noised_to_clean, noised_to_noised], axis=2)
  return jnp.concatenate([top, bottom], axis=1)
