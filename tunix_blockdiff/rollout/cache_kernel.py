"""A window's attention over the cached slots each row uses: a Pallas kernel.

The cached driver's attention (`window_attention.attend`) reads every slot
of the cache at every step (or of a phase's segments), also the slots a row
does not use: left of its shifted prompt and right of what it has written.
On a TPU that read is the largest term of a call at batch 128 (Qwen3-0.6B,
block 4: 6.8 of 18.3 ms at the bandwidth, with another 1.3 ms of softmax
passes over the materialised scores). `partial_attention` reads, per block
of rows, only the chunks of slots that some row of the block uses (the
chunk range is prefetched; a chunk outside it is neither fetched nor
computed), and keeps the softmax online in float32 (flash attention's
running maximum and sum), so no score or probability leaves the kernel.

It returns the unnormalised partial result of the cache part (`Partial`:
maximum, sum of exponentials, weighted values); `merge` joins it with the
attention over the other parts (the block not yet written, the window's
own keys), as a log-sum-exp. The rounding differs from Tunix's attention
(the probabilities are not normalised before the values are weighted), so
the driver uses it only when asked (`generate(ragged_cache=True)`).

Measured on a v5e (2026-12-06, `python benchmarks/cache_kernel.py`: batch
128, Qwen3-0.6B's 28 layers, a 4-slot window, rows using about 200 of 336
slots) it is **slower than XLA's attention over every slot**: 14.6 ms
against 8.3 (chunks of 112 slots, blocks of 8 rows), 24.1 ms with chunks of
48; blocks of 32 rows do not fit the default scoped VMEM. Each (row, key
head) runs its own small matrix products (a few query rows against a chunk),
which the MXU runs far from the bandwidth. So it stays opt-in, for study.

Off a TPU it runs in Pallas interpret mode (the tests). Shapes: B batch, K
key heads, Q queries per key head (query heads per key head times window
slots), S cache slots, H head dim, L layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

# Masked scores (finite, so a row with no slot in a chunk stays finite).
_NEG = -1e30
# Slots per chunk at most (a multiple of a bf16 tile's 16 rows).
MAX_CHUNK = 128


class Partial(NamedTuple):
  """Attention over some keys, not yet normalised.

  Attributes:
    m: float32 [B, K, Q, 1] the maximum score (-1e30 where no key is valid).
    l: float32 [B, K, Q, 1] the sum of exp(score - m) over the valid keys.
    acc: float32 [B, K, Q, H] the sum of exp(score - m) * value.
  """

  m: jax.Array
  l: jax.Array
  acc: jax.Array


def chunk_size(slots: int) -> int:
  """The chunk: the largest multiple of 16 dividing `slots`, <= MAX_CHUNK."""
  if slots % 16:
    raise ValueError(f"cache slots must be a multiple of 16, got {slots}")
  units = slots // 16
  best = max(d for d in range(1, min(units, MAX_CHUNK // 16) + 1)
             if units % d == 0)
  return 16 * best


def check_batch(batch: int) -> None:
  """Raises ValueError unless rows split into blocks the kernel can take.

  A block of rows is 8 (an int32 tile's rows) or the whole batch; a whole
  batch of more than 8 rows would not fit the kernel's buffers on a TPU.
  """
  if batch > 8 and batch % 8:
    raise ValueError(
        f"ragged_cache: the batch must be at most 8 rows or a multiple of 8,"
        f" got {batch}")


def _row_block(batch: int, row_block: int) -> int:
  """Rows per grid step: `row_block` where it divides, else the batch."""
  check_batch(batch)
  if row_block < 1 or row_block % 8:
    raise ValueError(f"row_block must be a positive multiple of 8, got"
                     f" {row_block}")
  if batch % row_block == 0:
    return row_block
  return 8 if batch % 8 == 0 else batch


def _kernel(layer_ref, first_ref, count_ref, lo_ref, hi_ref, q_ref, k_ref,
            v_ref, m_ref, l_ref, acc_ref, *, chunk: int, scale: float):
  """One block of rows against one chunk of slots: 2-D products per head.

  The outputs stay in VMEM across the chunk axis (their block does not
  move), so they carry the running maximum, sum and weighted values.
  """
  del layer_ref  # read by the index maps
  i, j = pl.program_id(0), pl.program_id(1)
  rb, kh, q_len, _ = q_ref.shape

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(j < count_ref[i])
  def _step():
    slot = (first_ref[i] + j) * chunk + jax.lax.broadcasted_iota(
        jnp.int32, (q_len, chunk), 1)
    for r in range(rb):
      row = i * rb + r
      valid = (slot >= lo_ref[row]) & (slot < hi_ref[row])  # [Q, chunk]
      for k in range(kh):
        s = jnp.einsum("qh,sh->qs", q_ref[r, k], k_ref[r, k],
                       preferred_element_type=jnp.float32) * scale
        s = jnp.where(valid, s, _NEG)
        m_old = m_ref[r, k]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_old - m_new)
        l_ref[r, k] = alpha * l_ref[r, k] + jnp.sum(p, axis=-1,
                                                    keepdims=True)
        acc_ref[r, k] = alpha * acc_ref[r, k] + jnp.dot(
            p.astype(v_ref.dtype), v_ref[r, k],
            preferred_element_type=jnp.float32)
        m_ref[r, k] = m_new


def partial_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                      layer: int, lo: jax.Array, hi: jax.Array, *,
                      scale: float = 1.0, chunk: int | None = None,
                      row_block: int = 8,
                      interpret: bool | None = None) -> Partial:
  """Queries against each row's cached slots [lo, hi) of one layer.

  Args:
    q: [B, K, Q, H] queries (rotated; any scale folded in or in `scale`).
    keys: [L, B, K, S, H] every layer's cached keys (read in place: a
      layer's slice passed alone would be copied); S a multiple of 16.
    values: Likewise.
    layer: The layer to read (prefetched, so every layer runs one kernel).
    lo, hi: int32 [B] each row's valid slots [lo, hi) (empty if hi <= lo).
    scale: Multiplies the query-key products.
    chunk: Slots per grid step, a multiple of 16 dividing S; None:
      `chunk_size(S)`.
    row_block: Rows per grid step (a multiple of 8 dividing B; else 8, or
      the whole batch of at most 8 rows).
    interpret: Pallas interpret mode; None: off a TPU.

  Returns:
    `Partial` over the valid slots (scores in float32).
  """
  batch, kh, q_len, h = q.shape
  slots = keys.shape[3]
  if keys.shape != (keys.shape[0], batch, kh, slots, h) or (
      values.shape != keys.shape):
    raise ValueError(
        f"keys and values must be [L, {batch}, {kh}, S, {h}], got"
        f" {keys.shape} and {values.shape}")
  if chunk is None:
    chunk = chunk_size(slots)
  elif chunk % 16 or slots % chunk:
    raise ValueError(f"chunk must be a multiple of 16 dividing the {slots}"
                     f" cache slots, got {chunk}")
  rb = _row_block(batch, row_block)
  blocks, chunks = batch // rb, slots // chunk
  if interpret is None:
    interpret = jax.devices()[0].platform != "tpu"
  lo = jnp.clip(lo.astype(jnp.int32), 0, slots)
  hi = jnp.clip(hi.astype(jnp.int32), 0, slots)
  used = hi > lo
  # Per block of rows: the first chunk any row uses and how many follow.
  block_lo = jnp.min(jnp.where(used, lo, slots).reshape(blocks, rb), axis=1)
  block_hi = jnp.max(jnp.where(used, hi, 0).reshape(blocks, rb), axis=1)
  first = jnp.minimum(block_lo // chunk, chunks - 1)
  count = jnp.maximum(-(-block_hi // chunk) - first, 0)

  def kv_map(i, j, layer_ref, first_ref, count_ref, *_):
    # Past the block's chunks the index repeats: nothing is fetched.
    last = first_ref[i] + jnp.maximum(count_ref[i] - 1, 0)
    return (layer_ref[0], i, 0, jnp.minimum(first_ref[i] + j, last), 0)

  out_map = lambda i, j, *_: (i, 0, 0, 0)
  kv_spec = pl.BlockSpec((None, rb, kh, chunk, h), kv_map)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(blocks, chunks),
      in_specs=[pl.BlockSpec((rb, kh, q_len, h), out_map), kv_spec, kv_spec],
      out_specs=[
          pl.BlockSpec((rb, kh, q_len, 1), out_map),
          pl.BlockSpec((rb, kh, q_len, 1), out_map),
          pl.BlockSpec((rb, kh, q_len, h), out_map),
      ],
  )
  stat = jax.ShapeDtypeStruct((batch, kh, q_len, 1), jnp.float32)
  m, l, acc = pl.pallas_call(
      functools.partial(_kernel, chunk=chunk, scale=float(scale)),
      grid_spec=grid_spec,
      out_shape=[stat, stat,
                 jax.ShapeDtypeStruct((batch, kh, q_len, h), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="ragged_cache_attention",
  )(jnp.full((1,), layer, jnp.int32), first, count, lo, hi, q, keys,
    values)
  return Partial(m, l, acc)


def partial_dense(q: jax.Array, keys: jax.Array, values: jax.Array,
                  valid: jax.Array, scale: float = 1.0) -> Partial:
  """`Partial` of [B, K, Q, H] queries over [B, K, S, H] keys, in XLA.

  For the small parts (the block not yet written, the window's own keys);
  `valid` bool, broadcastable to [B, K, Q, S].
  """
  s = jnp.einsum("bkqh,bksh->bkqs", q, keys,
                 preferred_element_type=jnp.float32) * scale
  valid = jnp.broadcast_to(valid, s.shape)
  s = jnp.where(valid, s, _NEG)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(valid, jnp.exp(s - m), 0.0)
  acc = jnp.einsum("bkqs,bksh->bkqh", p.astype(values.dtype), values,
                   preferred_element_type=jnp.float32)
  return Partial(m, jnp.sum(p, axis=-1, keepdims=True), acc)


def attend(q, window_k, window_v, window_mask, spans, parts,
           scale: float, interpret: bool | None = None) -> jax.Array:
  """A window's attention over cached spans, other parts and itself.

  Args:
    q: [B, T, N, H] the window's queries.
    window_k, window_v: [B, T, K, H] the window's own keys and values.
    window_mask: bool [B, T, T] window slot q attends window slot k.
    spans: (keys [L, B, K, S, H], values, layer, lo [B], hi [B]) per cached
      segment, read by the kernel (slots [lo, hi) of each row).
    parts: (keys [B, K, S_i, H], values, valid bool [B, S_i]) per other
      cached part (the block not yet written).
    scale: Multiplies the query-key products.
    interpret: Pallas interpret mode; None: off a TPU.

  Returns:
    [B, T, N, H] in the values' dtype.
  """
  b, t, n, h = q.shape
  kh = window_k.shape[2]
  g = n // kh
  # Queries per key head, ordered (query head in the group, window slot).
  qk = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(
      b, kh, g * t, h)
  pieces = [partial_attention(qk, keys, values, layer, lo, hi, scale=scale,
                              interpret=interpret)
            for keys, values, layer, lo, hi in spans]
  for keys, values, valid in parts:
    pieces.append(partial_dense(qk, keys, values, valid[:, None, None, :],
                                scale))
  own = jnp.broadcast_to(window_mask[:, None, None],
                         (b, 1, g, t, t)).reshape(b, 1, g * t, t)
  pieces.append(partial_dense(qk, window_k.transpose(0, 2, 1, 3),
                              window_v.transpose(0, 2, 1, 3), own, scale))
  out = merge(pieces).reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, n, h).astype(window_v.dtype)


def merge(parts: list[Partial]) -> jax.Array:
  """The attention output of the parts together: float32 [B, K, Q, H]."""
  m = functools.reduce(jnp.maximum, [p.m for p in parts])
  l = sum(p.l * jnp.exp(p.m - m) for p in parts)
  acc = sum(p.acc * jnp.exp(p.m - m) for p in parts)
  return acc / jnp.where(l > 0, l, 1.0)


__all__ = ["MAX_CHUNK", "Partial", "attend", "check_batch", "chunk_size",
           "merge", "partial_attention", "partial_dense"]
