"""Block-causal Splash attention: lazy masks, kernels, packed sequences.

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

A static mask sees physical indices, not the batch's logical positions: it is
right only when every document's positions equal its row indices minus a
block multiple (`static_mask_matches`). Anything else (packed documents that
do not start at block multiples, left padding off the block grid) takes a
per-example dynamic mask, never a silently wrong static one.

Shapes: B batch, L length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import numbers

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as splash_mask_info
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks

MASK_MODES = ("auto", "static", "dynamic")
# Splash computes key tiles in chunks of 128 lanes.
KV_TILE_MULTIPLE = 128


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


class BlockCausalMask(splash_mask._ComputableMask):  # pylint: disable=protected-access
  """Lazy block-causal mask: `(q + q_offset) // B >= kv // B`.

  Attributes:
    block_size: B, slots per block.
    q_offset: Logical position of query row 0 (rectangular masks, e.g. a
      chunk of queries against a longer key sequence); >= 0 so that every
      row attends at least one key.
  """

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

  def _key(self) -> tuple:
    return (type(self), self.shape, self.block_size, self.q_offset)

  def __eq__(self, other: object):
    if not isinstance(other, BlockCausalMask):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    return (
        f"BlockCausalMask(shape={self.shape}, block_size={self.block_size},"
        f" q_offset={self.q_offset})"
    )


class LoadBalancedBlockCausalMask(splash_mask._ComputableMask):  # pylint: disable=protected-access
  """Block-causal mask over load-balanced (context-parallel) physical order.

  Query row i holds logical position `load_balance_order(L, cp)[i]` (carried
  into the kernel by `q_sequence`). Key column j is logical position j when
  `kv_reordered=False`, or `load_balance_order(L, cp)[j]` when True.

  Attributes:
    block_size: B, slots per block.
    cp_size: Context-parallel shards the order was built for.
    kv_reordered: Whether keys are in the same physical order as queries.
  """

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

  def _key(self) -> tuple:
    return (
        type(self),
        self.shape,
        self.block_size,
        self.cp_size,
        self.kv_reordered,
    )

  def __eq__(self, other: object):
    if not isinstance(other, LoadBalancedBlockCausalMask):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    return (
        f"LoadBalancedBlockCausalMask(seq_len={self.shape[0]},"
        f" block_size={self.block_size}, cp_size={self.cp_size},"
        f" kv_reordered={self.kv_reordered})"
    )


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


def default_interpret() -> bool:
  """Splash is a TPU kernel; elsewhere it runs in Pallas interpret mode."""
  return jax.default_backend() != "tpu"


def block_sizes(
    q_tile: int = 128, kv_tile: int = 128
) -> splash_kernel.BlockSizes:
  """Splash tile sizes for the forward and both backward kernels.

  Args:
    q_tile: Query rows per tile (a multiple of 8).
    kv_tile: Key columns per tile (a multiple of 128, a Splash requirement).
  """
  q_tile = _check_int("q_tile", q_tile, 1)
  kv_tile = _check_int("kv_tile", kv_tile, 1)
  if kv_tile % KV_TILE_MULTIPLE:
    raise ValueError(
        f"kv_tile must be a multiple of {KV_TILE_MULTIPLE}, got {kv_tile}"
    )
  return splash_kernel.BlockSizes(
      block_q=q_tile,
      block_kv=kv_tile,
      block_kv_compute=kv_tile,
      block_q_dkv=q_tile,
      block_kv_dkv=kv_tile,
      block_kv_dkv_compute=kv_tile,
      block_q_dq=q_tile,
      block_kv_dq=kv_tile,
  )


def _check_tiles(seq_len: int, q_len: int, q_tile: int, kv_tile: int) -> None:
  if q_len % q_tile:
    raise ValueError(f"q_tile={q_tile} must divide the query length {q_len}")
  if seq_len % kv_tile:
    raise ValueError(f"kv_tile={kv_tile} must divide the key length {seq_len}")


def make_block_causal_kernel(
    seq_len: int,
    num_heads: int,
    block_size: int,
    *,
    cp_size: int = 1,
    kv_reordered: bool = True,
    q_tile: int = 128,
    kv_tile: int = 128,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    interpret: bool | None = None,
) -> splash_kernel.SplashAttentionKernel:
  """A Splash multi-head kernel with a static block-causal mask.

  The kernel maps `q [N, L, H], k [K, L, H], v [K, L, H]` (one example; K
  divides N) to `[N, L, H]`; queries must be pre-scaled. Pass
  `segment_ids=SegmentIds(q=[L], kv=[L])` for packed rows.

  Args:
    seq_len: L.
    num_heads: N.
    block_size: B.
    cp_size: Load-balanced order of the rows (1: logical order).
    kv_reordered: Keys in the same physical order as queries (cp > 1 only).
    q_tile: Query tile; a multiple of 128 for gradients with segment ids.
    kv_tile: Key tile (multiple of 128).
    head_shards: Head shards of the mesh the kernel runs in.
    q_seq_shards: Query-sequence shards of the mesh the kernel runs in.
    interpret: Pallas interpret mode; default: True off TPU.

  Returns:
    A `SplashAttentionKernel` (a pytree, usable inside `jit` and `shard_map`).
  """
  num_heads = _check_int("num_heads", num_heads, 1)
  sizes = block_sizes(q_tile, kv_tile)
  _check_tiles(seq_len, seq_len // max(q_seq_shards, 1), q_tile, kv_tile)
  mask = block_causal_splash_mask(
      seq_len, block_size, cp_size=cp_size, kv_reordered=kv_reordered
  )
  return make_splash_kernel(
      splash_mask.MultiHeadMask([mask] * num_heads),
      block_sizes=sizes,
      head_shards=head_shards,
      q_seq_shards=q_seq_shards,
      interpret=default_interpret() if interpret is None else interpret,
  )


def _has_partial_tiles(mask: splash_mask.MultiHeadMask, sizes) -> bool:
  tiles = {
      (sizes.block_q, sizes.block_kv),
      (sizes.block_q_dq, sizes.block_kv_dq),
      (sizes.block_q_dkv, sizes.block_kv_dkv),
  }
  for tile in tiles:
    if None in tile:
      continue
    info, _ = splash_mask_info.process_mask(mask, tile)  # cached by value.
    if not np.any(np.asarray(info.block_mask) == 1):
      return False
  return True


def make_splash_kernel(
    mask: splash_mask.MultiHeadMask,
    *,
    block_sizes: splash_kernel.BlockSizes,  # pylint: disable=redefined-outer-name
    head_shards: int,
    q_seq_shards: int,
    interpret: bool,
) -> splash_kernel.SplashAttentionKernel:
  """`splash_kernel.make_splash_mha`, also for masks without partial tiles.

  In JAX 0.10, Splash's grid shrinking fails ("need at least one array to
  concatenate") for a mask with no partial tile (block sizes that are
  multiples of the tiles, bidirectional blocks) when the query sequence is
  sharded. Such masks get the same kernel built without grid shrinking,
  which only costs the grid steps over skipped tiles.

  Args:
    mask: Multi-head lazy mask [N, L, L].
    block_sizes: Splash tile sizes (forward and backward).
    head_shards: Head shards of the mesh the kernel runs in.
    q_seq_shards: Query-sequence shards of the mesh the kernel runs in.
    interpret: Pallas interpret mode.

  Returns:
    A `SplashAttentionKernel` (MHA).
  """
  if q_seq_shards == 1 or _has_partial_tiles(mask, block_sizes):
    return splash_kernel.make_splash_mha(
        mask,
        block_sizes=block_sizes,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        interpret=interpret,
    )
  shards = dict(head_shards=head_shards, q_seq_shards=q_seq_shards)

  def info(process, tile):
    mask_info, mask_function = process(mask, tile, shrink_grid=False, **shards)
    return jax.tree.map(jnp.array, mask_info), mask_function

  sizes = block_sizes
  fwd, mask_function = info(
      splash_mask_info.process_mask, (sizes.block_q, sizes.block_kv)
  )
  dq = dkv = None
  if sizes.has_backward_blocks:
    if not sizes.use_fused_bwd_kernel:
      dq, _ = info(
          splash_mask_info.process_mask, (sizes.block_q_dq, sizes.block_kv_dq)
      )
    dkv, _ = info(
        splash_mask_info.process_mask_dkv,
        (sizes.block_q_dkv, sizes.block_kv_dkv),
    )
  return splash_kernel.SplashAttentionKernel(
      fwd,
      dq,
      dkv,
      block_sizes=sizes,
      is_mqa=False,
      save_residuals=False,
      mask_value=splash_kernel.DEFAULT_MASK_VALUE,
      attn_logits_soft_cap=None,
      residual_checkpoint_name=None,
      mask_function=mask_function,
      interpret=interpret,
  )


def tile_counts(
    mask: splash_mask.Mask,
    q_tile: int,
    kv_tile: int,
    *,
    q_seq_shards: int = 1,
) -> np.ndarray:
  """How Splash classifies the (q, kv) tiles of a mask, per query shard.

  Read from Splash's own mask info (`process_mask`): an all-False tile is
  skipped, a partial tile is computed with the mask applied, a full tile is
  computed without it.

  Args:
    mask: A 2-D lazy mask [L, L].
    q_tile: Query tile (divides L / q_seq_shards).
    kv_tile: Key tile (divides L).
    q_seq_shards: Context shards of the query sequence.

  Returns:
    int64 [q_seq_shards, 3]: (skipped, partial, full) tiles of each shard.
  """
  q_len, kv_len = mask.shape
  _check_tiles(kv_len, q_len // q_seq_shards, q_tile, kv_tile)
  # Without grid shrinking, the block mask covers the whole (q, kv) grid.
  info, _ = splash_mask_info.process_mask(
      splash_mask.MultiHeadMask([mask]),
      (q_tile, kv_tile),
      q_seq_shards=q_seq_shards,
      shrink_grid=False,
  )
  block_mask = np.asarray(info.block_mask)[0]  # [q_tiles, kv_tiles]
  per_shard = block_mask.reshape(q_seq_shards, -1)
  return np.stack(
      [(per_shard == kind).sum(axis=1) for kind in (0, 1, 2)], axis=1
  )


def _batched(name: str, value, shape) -> jax.Array:
  value = jnp.asarray(value)
  if value.ndim == 1:
    value = jnp.broadcast_to(value[None, :], shape)
  if value.shape != tuple(shape):
    raise ValueError(
        f"{name} must have shape {tuple(shape)} [batch, length], got"
        f" {value.shape}"
    )
  return value


def combined_segment_ids(segment_ids, validity, shape) -> jax.Array | None:
  """One int32 id per slot for Splash: documents keep theirs, padding differs.

  Splash has no key-validity input, so invalid slots get an id below every
  document id of their row (the row minimum minus one): valid queries never
  attend them, and each padding query still attends itself.

  Args:
    segment_ids: Optional int [B, L] document ids.
    validity: Optional bool [B, L].
    shape: (B, L).

  Returns:
    int32 [B, L], or None when neither input is given.
  """
  if segment_ids is None and validity is None:
    return None
  if segment_ids is None:
    segment_ids = jnp.zeros(shape, jnp.int32)
  segment_ids = _batched("segment_ids", segment_ids, shape).astype(jnp.int32)
  if validity is None:
    return segment_ids
  validity = _batched("validity", validity, shape).astype(jnp.bool_)
  padding_id = jnp.min(segment_ids, axis=1, keepdims=True) - 1
  return jnp.where(validity, segment_ids, padding_id)


def static_or_dynamic(mask_mode: str, matches, static_fn, dynamic_fn):
  """Runs the static-mask kernel where it is right, else the dynamic one.

  Args:
    mask_mode: `static` or `auto` (`dynamic` callers skip this).
    matches: bool scalar from `static_mask_matches`, concrete or traced
      (inside jit even constant inputs give a traced answer).
    static_fn: `() -> out` with the static mask.
    dynamic_fn: `() -> out` with the per-example mask.

  Returns:
    `out`. Under `static` a mismatch raises when `matches` is concrete and
    gives NaN when it is traced: never silently wrong numbers.
  """
  traced = isinstance(matches, jax.core.Tracer)
  if mask_mode == "static":
    if not traced and not bool(matches):
      raise ValueError(
          "mask_mode='static' needs documents that start at block multiples of"
          " the physical grid (static_mask_matches is False); use"
          " mask_mode='auto' or 'dynamic'"
      )
    out = static_fn()
    return jnp.where(matches, out, jnp.nan) if traced else out
  if not traced:
    return static_fn() if bool(matches) else dynamic_fn()
  return jax.lax.cond(matches, static_fn, dynamic_fn)


def static_mask_matches(
    positions,
    block_size: int,
    *,
    segment_ids=None,
    validity=None,
    cp_size: int = 1,
) -> jax.Array:
  """Whether the static Splash mask equals the logical block-causal mask.

  The static mask compares the row indices `r` of the un-reordered row
  (`load_balance_order` when cp > 1). It equals the dense mask from logical
  positions (at every valid query) when, within each document of each row,
  `r - position` is one constant multiple of `block_size`: documents start
  at block multiples of the physical grid and their positions count up from
  there. Sufficient, not necessary: a False sends the batch to the dynamic
  mask, which is always right.

  Args:
    positions: int [B, L] logical positions, physical order.
    block_size: B.
    segment_ids: Optional int [B, L] document ids.
    validity: Optional bool [B, L].
    cp_size: The load-balanced order of the rows.

  Returns:
    bool scalar (a JAX array; traceable).
  """
  block_size = masks.check_block_size(block_size)
  positions = jnp.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None, :]
  if positions.ndim != 2 or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(
        "positions must be an int array [batch, length], got"
        f" {positions.dtype}{positions.shape}"
    )
  shape = positions.shape
  rows = jnp.asarray(context_parallel.load_balance_order(shape[1], cp_size))
  offset = rows[None, :] - positions.astype(jnp.int32)
  valid = (
      jnp.ones(shape, jnp.bool_)
      if validity is None
      else _batched("validity", validity, shape).astype(jnp.bool_)
  )
  docs = (
      jnp.zeros(shape, jnp.int32)
      if segment_ids is None
      else _batched("segment_ids", segment_ids, shape).astype(jnp.int32)
  )
  on_grid = jnp.all(jnp.where(valid, offset % block_size == 0, True))

  def one_row(offset_row, valid_row, doc_row):
    # Sorting by (invalid, document) puts each document's valid slots side by
    # side; the offset must not change between neighbours of one document.
    order = jnp.lexsort((doc_row, (~valid_row).astype(jnp.int32)))
    offset_row, valid_row, doc_row = (
        offset_row[order],
        valid_row[order],
        doc_row[order],
    )
    same_doc = (doc_row[1:] == doc_row[:-1]) & valid_row[1:] & valid_row[:-1]
    return jnp.all(jnp.where(same_doc, offset_row[1:] == offset_row[:-1], True))

  constant = jnp.all(jax.vmap(one_row)(offset, valid, docs))
  return on_grid & constant


def _mark_dynamic(kernel: splash_kernel.SplashAttentionKernel):
  # make_splash_mha turns every MaskInfo leaf into a jnp array, the
  # `is_dynamic_mask` flag included; under jit that is a tracer and the
  # kernel's `if is_dynamic_mask` fails. The flag is static: restore a bool.
  def fix(info):
    return None if info is None else info._replace(is_dynamic_mask=True)

  return splash_kernel.SplashAttentionKernel(
      fix(kernel.fwd_mask_info),
      fix(kernel.dq_mask_info),
      fix(kernel.dkv_mask_info),
      **kernel.kwargs,
  )


def dynamic_splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    *,
    q_tile: int = 128,
    kv_tile: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
  """Splash with a traced (per-example) mask; traceable under `jit`/`vmap`.

  Args:
    query: float [N, Q, H], pre-scaled.
    key: float [K, L, H].
    value: float [K, L, H].
    mask: bool [Q, L] (the same for every head); no all-False rows.
    q_tile: Query tile (divides Q).
    kv_tile: Key tile (multiple of 128, divides L).
    interpret: Pallas interpret mode; default: True off TPU.

  Returns:
    float [N, Q, H].
  """
  num_heads, q_len, _ = query.shape
  seq_len = key.shape[1]
  if mask.shape != (q_len, seq_len):
    raise ValueError(
        f"mask must have shape {(q_len, seq_len)} [Q, L], got {mask.shape}"
    )
  q_tile = min(q_tile, q_len)
  sizes = block_sizes(q_tile, kv_tile)
  _check_tiles(seq_len, q_len, q_tile, kv_tile)
  kernel = splash_kernel.make_splash_mha(
      jnp.broadcast_to(mask.astype(jnp.bool_), (num_heads, q_len, seq_len)),
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=default_interpret() if interpret is None else interpret,
  )
  return _mark_dynamic(kernel)(query, key, value)


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block_size: int,
    positions=None,
    segment_ids=None,
    validity=None,
    cp_size: int = 1,
    mask_mode: str = "auto",
    scale: float | None = None,
    q_tile: int = 128,
    kv_tile: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
  """Block-causal attention through Splash, for one device.

  Queries, keys and values share one physical order: logical, or the
  load-balanced order of `cp_size`. `mask_mode`:

  * `static`: the lazy mask plus segment ids. Requires `static_mask_matches`;
    concrete inputs that break it raise, traced ones give NaN outputs.
  * `dynamic`: a per-example mask from the logical positions (always right;
    the mask is materialised, so it costs memory and loses in-kernel masks).
  * `auto`: static when the batch allows it, else dynamic (a `lax.cond`
    when traced).

  For sharded use, call it inside `shard_map`, or use `shim` for Tunix
  models (whose flash path shards the query sequence).

  Args:
    query: float [B, L, N, H].
    key: float [B, L, K, H] (K divides N).
    value: float [B, L, K, H].
    block_size: B.
    positions: Optional int [B, L] logical positions; default: the logical
      index of each slot (one unpadded document per row).
    segment_ids: Optional int [B, L] document ids.
    validity: Optional bool [B, L]; invalid keys are never attended.
    cp_size: Load-balanced order of the rows (1: logical order).
    mask_mode: One of `MASK_MODES`.
    scale: Logit scale; default `H ** -0.5`.
    q_tile: Query tile; with segment ids (packing, padding) a multiple of
      128 for gradients (Splash's dK/dV kernel needs it).
    kv_tile: Key tile (multiple of 128).
    interpret: Pallas interpret mode; default: True off TPU.

  Returns:
    float [B, L, N, H]; rows of invalid queries are unspecified.
  """
  if mask_mode not in MASK_MODES:
    raise ValueError(
        f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}"
    )
  if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
    raise ValueError(
        "query must be [B, L, N, H] and key, value [B, L, K, H]; got"
        f" {query.shape}, {key.shape}, {value.shape}"
    )
  batch, seq_len, num_heads, head_dim = query.shape
  if key.shape[:2] != (batch, seq_len) or num_heads % key.shape[2]:
    raise ValueError(
        f"key {key.shape} must share [B, L] with query {query.shape} and its"
        " heads must divide the query heads"
    )
  block_size = masks.check_block_size(block_size)
  shape = (batch, seq_len)
  scale = head_dim**-0.5 if scale is None else scale
  q = jnp.swapaxes(query * scale, 1, 2)
  k = jnp.swapaxes(key, 1, 2)
  v = jnp.swapaxes(value, 1, 2)

  def static_path(q, k, v, segments):
    kernel = make_block_causal_kernel(
        seq_len,
        num_heads,
        block_size,
        cp_size=cp_size,
        q_tile=min(q_tile, seq_len),
        kv_tile=kv_tile,
        interpret=interpret,
    )
    if segments is None:
      return jax.vmap(kernel)(q, k, v)
    run = lambda q, k, v, s: kernel(
        q, k, v, segment_ids=splash_kernel.SegmentIds(s, s)
    )
    return jax.vmap(run)(q, k, v, segments)

  def dynamic_path(q, k, v, positions):
    mask = masks.block_causal_mask(
        positions,
        positions,
        block_size,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        kv_valid=validity,
    )
    # Each query attends itself, so no row is empty (Splash needs that).
    mask = mask | jnp.eye(seq_len, dtype=jnp.bool_)[None]
    run = lambda q, k, v, m: dynamic_splash_attention(
        q, k, v, m, q_tile=q_tile, kv_tile=kv_tile, interpret=interpret
    )
    return jax.vmap(run)(q, k, v, mask)

  segments = combined_segment_ids(segment_ids, validity, shape)
  if positions is None:
    out = static_path(q, k, v, segments)
    return jnp.swapaxes(out, 1, 2)
  positions = _batched("positions", positions, shape).astype(jnp.int32)
  if mask_mode == "dynamic":
    out = dynamic_path(q, k, v, positions)
    return jnp.swapaxes(out, 1, 2)
  matches = static_mask_matches(
      positions,
      block_size,
      segment_ids=segment_ids,
      validity=validity,
      cp_size=cp_size,
  )
  out = static_or_dynamic(
      mask_mode,
      matches,
      lambda: static_path(q, k, v, segments),
      lambda: dynamic_path(q, k, v, positions),
  )
  return jnp.swapaxes(out, 1, 2)
