"""Splash kernels over the block-causal masks: tiles and construction.

`block_sizes` picks the forward and backward tiles, `make_block_causal_kernel`
builds a multi-head kernel over a lazy mask of `splash_masks`,
`make_splash_kernel` one over any Splash mask, and `tile_counts` says how
many tiles a mask lets the kernel skip. Off a TPU the kernels run in Pallas
interpret mode (`default_interpret`).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as splash_mask_info
import numpy as np

from tunix_blockdiff import arrays
from tunix_blockdiff.attention.splash_masks import _check_int
from tunix_blockdiff.attention.splash_masks import block_causal_splash_mask

# Splash computes key tiles in chunks of 128 lanes.
KV_TILE_MULTIPLE = 128


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
    return jax.tree.map(arrays.asarray, mask_info), mask_function

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
