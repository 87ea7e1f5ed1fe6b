"""Block-causal Splash attention: lazy masks, kernels, packed sequences.

The entry points are `splash_attention` (a static or a per-example dynamic
mask, chosen by `static_or_dynamic`) and `dynamic_splash_attention`. The
masks live in `splash_masks` and the kernels and tiles in `splash_kernels`;
their public names are re-exported here, the one import path for users.

A static mask sees physical indices, not the batch's logical positions: it is
right only when every document's positions equal its row indices minus a
block multiple (`static_mask_matches`). Anything else (packed documents that
do not start at block multiples, left padding off the block grid) takes a
per-example dynamic mask, never a silently wrong static one.

Shapes: B batch, L length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations


import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
import jax.numpy as jnp

from tunix_blockdiff import arrays
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash_kernels
from tunix_blockdiff.attention import splash_masks

BlockCausalMask = splash_masks.BlockCausalMask
LoadBalancedBlockCausalMask = splash_masks.LoadBalancedBlockCausalMask
TwoStreamBlockMask = splash_masks.TwoStreamBlockMask
block_causal_splash_mask = splash_masks.block_causal_splash_mask
logical_index = splash_masks.logical_index
KV_TILE_MULTIPLE = splash_kernels.KV_TILE_MULTIPLE
block_sizes = splash_kernels.block_sizes
default_interpret = splash_kernels.default_interpret
make_block_causal_kernel = splash_kernels.make_block_causal_kernel
make_splash_kernel = splash_kernels.make_splash_kernel
tile_counts = splash_kernels.tile_counts
_check_tiles = splash_kernels._check_tiles  # pylint: disable=protected-access

MASK_MODES = config_lib.SPLASH_MASK_MODES


def _batched(name: str, value, shape) -> jax.Array:
  value = arrays.asarray(value)
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
  positions = arrays.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None, :]
  if positions.ndim != 2 or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(
        "positions must be an int array [batch, length], got"
        f" {positions.dtype}{positions.shape}"
    )
  shape = positions.shape
  rows = arrays.asarray(context_parallel.load_balance_order(shape[1], cp_size))
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
