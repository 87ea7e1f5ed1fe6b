"""Load-balanced context-parallel ordering (MaxText's dual-chunk swap).

With a causal or block-causal mask, the later chunks of a sequence do more
attention work than the earlier ones. Splitting the sequence into `2 * cp`
chunks and giving context shard r the chunks r and `2 * cp - 1 - r` balances
the work. Every per-token array of a batch is permuted with the same order;
masks stay correct because they are computed from logical positions.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import arrays


def _check_cp(seq_len, cp_size) -> tuple[int, int]:
  for name, value in (("seq_len", seq_len), ("cp_size", cp_size)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if cp_size > 1 and cp_size % 2:
    raise ValueError(
        f"cp_size must be 1 or even for load balancing, got {cp_size}"
    )
  if cp_size > 1 and seq_len % (2 * cp_size):
    raise ValueError(
        f"seq_len must be divisible by 2 * cp_size = {2 * cp_size}, got"
        f" seq_len={seq_len}"
    )
  return int(seq_len), int(cp_size)


def load_balance_order(seq_len: int, cp_size: int) -> np.ndarray:
  """The logical index held at each physical index.

  Args:
    seq_len: Sequence length L; a multiple of `2 * cp_size` when cp > 1.
    cp_size: Context-parallel shards; 1 (identity) or even.

  Returns:
    int32 [L]: `order[physical] = logical`. Shard r holds logical chunks r and
    `2 * cp - 1 - r`, in that order.
  """
  seq_len, cp_size = _check_cp(seq_len, cp_size)
  if cp_size == 1:
    return np.arange(seq_len, dtype=np.int32)
  num_chunks = 2 * cp_size
  chunk = seq_len // num_chunks
  chunk_order = []
  for shard in range(cp_size):
    chunk_order += [shard, num_chunks - 1 - shard]
  chunks = np.arange(seq_len, dtype=np.int32).reshape(num_chunks, chunk)
  return chunks[np.asarray(chunk_order)].reshape(-1)


def inverse_order(order: np.ndarray) -> np.ndarray:
  """`inverse[logical] = physical` for `order[physical] = logical`."""
  order = np.asarray(order)
  inverse = np.empty_like(order)
  inverse[order] = np.arange(order.shape[0], dtype=order.dtype)
  return inverse


def _take(x, indices: np.ndarray, axis: int):
  if isinstance(x, (jax.Array, jax.core.Tracer)):
    return jnp.take(x, arrays.asarray(indices), axis=axis)
  return np.take(np.asarray(x), indices, axis=axis)


def _check_axis(x, axis: int) -> int:
  ndim = np.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
  return axis % ndim


def reorder_for_context_parallel(x, cp_size: int, axis: int = 1):
  """Permutes `x` from logical to load-balanced physical order along `axis`.

  Args:
    x: NumPy or JAX array whose `axis` has length L.
    cp_size: Context-parallel shards (1 or even).
    axis: The sequence axis.

  Returns:
    Array of the same type and shape: `out[..., p, ...] = x[..., order[p], ...]`.
  """
  axis = _check_axis(x, axis)
  order = load_balance_order(np.shape(x)[axis], cp_size)
  return _take(x, order, axis)


def restore_from_context_parallel(x, cp_size: int, axis: int = 1):
  """Inverse of `reorder_for_context_parallel`."""
  axis = _check_axis(x, axis)
  order = load_balance_order(np.shape(x)[axis], cp_size)
  return _take(x, inverse_order(order), axis)


def reorder_batch_for_context_parallel(
    batch: Mapping[str, Any],
    cp_size: int,
    *,
    seq_len: int | None = None,
    axis: int = 1,
) -> dict[str, Any]:
  """Reorders every per-token field of a batch with one permutation.

  A field is per-token when its `axis` has length `seq_len` (default: the
  length of `batch["tokens"]`). Other fields (scalars, per-example arrays) are
  passed through unchanged.

  Args:
    batch: Mapping of field name to NumPy/JAX array.
    cp_size: Context-parallel shards (1 or even).
    seq_len: The sequence length; defaults to `batch["tokens"].shape[axis]`.
    axis: The sequence axis of per-token fields.

  Returns:
    A new dict with per-token fields in load-balanced physical order.
  """
  if seq_len is None:
    if "tokens" not in batch:
      raise ValueError("seq_len is required when the batch has no 'tokens' field")
    seq_len = np.shape(batch["tokens"])[axis]
  order = load_balance_order(seq_len, cp_size)
  out = {}
  for name, value in batch.items():
    if np.ndim(value) > axis and np.shape(value)[axis] == seq_len:
      out[name] = _take(value, order, axis)
    else:
      out[name] = value
  return out
