"""Lazy block-causal masks for Splash attention.

Splash (JAX's TPU flash attention) skips every (q, kv) tile whose mask is all
False, so a block-causal mask costs about as much as a causal one. The masks
here are *lazy*: a mask function over query and key indices, evaluated on the
host to find the tiles to skip and inside the kernel for the partial tiles.
They are hashable and equal by value, so Splash's mask-info cache and `jit`
static arguments see two equal masks as one.

Index conventions (DESIGN.md 5.1). The kernel gives a mask function the
query's entry of `q_sequence` and the key's physical index. So:

* `BlockCausalMask`: row i is logical position `i + q_offset`, column j is
  logical position j (one document per row, or documents that start at block
  multiples plus segment ids).
* `LoadBalancedBlockCausalMask`: queries in load-balanced physical order (its
  `q_sequence` is `load_balance_order`); keys in logical order
  (`kv_reordered=False`, for kernels that restore K/V) or in the same
  physical order (`kv_reordered=True`, e.g. Tunix's flash path, which
  all-gathers K/V without un-permuting), mapped to logical positions with
  integer arithmetic that also runs inside the kernel.
"""

from __future__ import annotations

import numbers

from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return int(value)


def _check_shape(shape) -> tuple[int, int]:
  if not isinstance(shape, tuple) or len(shape) != 2:
    raise ValueError(f"shape must be a tuple (q_len, kv_len), got {shape!r}")
  return (
      _check_int("shape[0]", shape[0], 1),
      _check_int("shape[1]", shape[1], 1),
  )


def logical_index(physical, seq_len: int, cp_size: int):
  """Logical position of each physical index under `load_balance_order`.

  Integer arithmetic only (no gather), so it runs on NumPy arrays on the host
  and on `jnp` arrays inside a Pallas kernel alike.

  Args:
    physical: int array (NumPy or JAX) of physical indices in `[0, L)`.
    seq_len: L, a multiple of `2 * cp_size` when cp > 1.
    cp_size: Context-parallel shards (1 or even).

  Returns:
    int array of the same shape: `load_balance_order(L, cp)[physical]`.
  """
  context_parallel.load_balance_order(seq_len, cp_size)  # validates.
  if cp_size == 1:
    return physical
  num_chunks = 2 * cp_size
  chunk = seq_len // num_chunks
  physical_chunk = physical // chunk
  within = physical - physical_chunk * chunk
  shard = physical_chunk // 2
  is_second = physical_chunk % 2
  # Shard r holds logical chunk r first, then chunk 2 * cp - 1 - r.
  logical_chunk = shard + is_second * (num_chunks - 1 - 2 * shard)
  return logical_chunk * chunk + within


class _ValueMask(splash_mask._ComputableMask):  # pylint: disable=protected-access
  """A lazy mask equal to another of its class with the same `_FIELDS`.

  Splash caches mask info per mask and `jit` takes masks as static
  arguments, so two masks built alike must compare and hash equal. Each
  subclass names the attributes that define it in `_FIELDS`.
  """

  _FIELDS: tuple[str, ...] = ("shape",)

  def _key(self) -> tuple:
    return (type(self),) + tuple(getattr(self, f) for f in self._FIELDS)

  def __eq__(self, other: object):
    if type(other) is not type(self):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self):
    return hash(self._key())


class BlockCausalMask(_ValueMask):
  """Lazy block-causal mask: `(q + q_offset) // B >= kv // B`.

  Attributes:
    block_size: B, slots per block.
    q_offset: Logical position of query row 0 (rectangular masks, e.g. a
      chunk of queries against a longer key sequence); >= 0 so that every
      row attends at least one key.
  """

  _FIELDS = ("shape", "block_size", "q_offset")

  block_size: int
  q_offset: int

  def __init__(
      self, shape: tuple[int, int], block_size: int, *, q_offset: int = 0
  ):
    shape = _check_shape(shape)
    block_size = masks.check_block_size(block_size)
    q_offset = _check_int("q_offset", q_offset, 0)
    self.block_size = block_size
    self.q_offset = q_offset

    def block_causal(q_ids, kv_ids):
      if q_offset:
        q_ids = q_ids + q_offset
      return q_ids // block_size >= kv_ids // block_size

    super().__init__(shape=shape, mask_function=block_causal)

  def __repr__(self):
    return (
        f"BlockCausalMask(shape={self.shape}, block_size={self.block_size},"
        f" q_offset={self.q_offset})"
    )


class LoadBalancedBlockCausalMask(_ValueMask):
  """Block-causal mask over load-balanced (context-parallel) physical order.

  Query row i holds logical position `load_balance_order(L, cp)[i]` (carried
  into the kernel by `q_sequence`). Key column j is logical position j when
  `kv_reordered=False`, or `load_balance_order(L, cp)[j]` when True.

  Attributes:
    block_size: B, slots per block.
    cp_size: Context-parallel shards the order was built for.
    kv_reordered: Whether keys are in the same physical order as queries.
  """

  _FIELDS = ("shape", "block_size", "cp_size", "kv_reordered")

  block_size: int
  cp_size: int
  kv_reordered: bool

  def __init__(
      self,
      seq_len: int,
      block_size: int,
      cp_size: int,
      *,
      kv_reordered: bool = True,
  ):
    order = context_parallel.load_balance_order(seq_len, cp_size)
    block_size = masks.check_block_size(block_size)
    if not isinstance(kv_reordered, bool):
      raise TypeError(
          f"kv_reordered must be a bool, got {type(kv_reordered).__name__}"
      )
    self.block_size = block_size
    self.cp_size = int(cp_size)
    self.kv_reordered = kv_reordered
    seq_len = int(seq_len)
    cp_size = self.cp_size

    def block_causal(q_logical, kv_ids):
      if kv_reordered:
        kv_ids = logical_index(kv_ids, seq_len, cp_size)
      return q_logical // block_size >= kv_ids // block_size

    super().__init__(shape=(seq_len, seq_len), mask_function=block_causal)
    self.q_sequence = order

  def __repr__(self):
    return (
        f"LoadBalancedBlockCausalMask(seq_len={self.shape[0]},"
        f" block_size={self.block_size}, cp_size={self.cp_size},"
        f" kv_reordered={self.kv_reordered})"
    )


class TwoStreamBlockMask(_ValueMask):
  """Lazy two-stream (BD3-LM) mask over `[x0 | xt]` rows of length 2L.

  Physical index i < L is clean slot i, i >= L noised slot i - L; a slot's
  block is `(i mod L) // B`. Clean queries attend clean keys of their own
  and earlier blocks; noised queries attend clean keys of strictly earlier
  blocks and noised keys of their own block; clean queries never see the
  noised half (`masks.two_stream_mask` on one document whose positions are
  its slots). With segment ids it is that mask for packed documents that
  start at block multiples (`splash.static_mask_matches` on the L row).
  Every query attends itself, so no row is empty.

  Attributes:
    block_size: B, slots per block.
  """

  _FIELDS = ("shape", "block_size")

  block_size: int

  def __init__(self, length: int, block_size: int):
    length = _check_int("length", length, 2)
    if length % 2:
      raise ValueError(f"length must be even ([x0 | xt]), got {length}")
    block_size = masks.check_block_size(block_size)
    self.block_size = block_size
    half = length // 2

    def two_stream(q_ids, kv_ids):
      q_noised, kv_noised = q_ids >= half, kv_ids >= half
      q_block = (q_ids - half * q_noised) // block_size
      kv_block = (kv_ids - half * kv_noised) // block_size
      clean_key = kv_ids < half
      return ((clean_key & (q_ids < half) & (kv_block <= q_block))
              | (clean_key & q_noised & (kv_block < q_block))
              | (kv_noised & q_noised & (kv_block == q_block)))

    super().__init__(shape=(length, length), mask_function=two_stream)

  def __repr__(self):
    return (f"TwoStreamBlockMask(length={self.shape[0]},"
            f" block_size={self.block_size})")


def block_causal_splash_mask(
    seq_len: int,
    block_size: int,
    *,
    cp_size: int = 1,
    kv_reordered: bool = True,
) -> BlockCausalMask | LoadBalancedBlockCausalMask:
  """The lazy mask for a length-L sequence in (load-balanced) physical order."""
  if cp_size == 1:
    return BlockCausalMask((seq_len, seq_len), block_size)
  return LoadBalancedBlockCausalMask(
      seq_len, block_size, cp_size, kv_reordered=kv_reordered
  )
