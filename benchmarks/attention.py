"""Attention benchmark: Splash tile skipping, load balance, dense step time.

1. For L=8192, the fraction of (q, kv) tiles Splash computes (partial or
   full) vs skips, read from Splash's own mask info, for the causal mask and
   block-causal masks (block sizes 4, 16, 64, 512, 1000), square tiles 128
   and 512.
2. Per context shard (cp 2 and 4, query-sequence sharding as in Tunix's
   flash path), the tiles each shard computes, with the logical order and
   with the load-balanced order (K/V kept in physical order).
3. Wall time of a dense-path training step (loss + grads) of a small Tunix
   Qwen3 on CPU with a block-causal vs a causal mask.

Run: python benchmarks/attention.py [--seq-len 8192] [--skip-timing]
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
import numpy as np

from tunix_blockdiff.attention import splash

BLOCK_SIZES = (4, 16, 64, 512, 1000)
TILES = (128, 512)
CP_SIZES = (2, 4)


def _mask(seq_len: int, block_size: int | None, cp_size: int = 1):
  """Causal (block_size None) or block-causal lazy mask, physical order."""
  if cp_size == 1:
    if block_size is None:
      return splash_mask.CausalMask((seq_len, seq_len))
    return splash.BlockCausalMask((seq_len, seq_len), block_size)
  return splash.LoadBalancedBlockCausalMask(seq_len, block_size or 1, cp_size)


def _name(block_size: int | None) -> str:
  return "causal" if block_size is None else f"block {block_size}"


def tile_fraction_table(seq_len: int) -> str:
  rows = [
      (
          "| mask | tile | computed tiles | skipped | computed fraction | of"
          " which partial | mask density |"
      ),
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for block_size in (None,) + BLOCK_SIZES:
    mask = _mask(seq_len, block_size)
    # Exact density of a (block-)causal mask, without materialising it.
    blocks = np.arange(seq_len) // (block_size or 1)
    attended = np.searchsorted(blocks, blocks, side="right").sum()
    density = attended / seq_len**2
    for tile in TILES:
      skipped, partial, full = splash.tile_counts(mask, tile, tile)[0]
      total = skipped + partial + full
      rows.append(
          f"| {_name(block_size)} | {tile} | {partial + full} | {skipped} |"
          f" {(partial + full) / total:.3f} | {partial} | {density:.3f} |"
      )
  return "\n".join(rows)


def shard_table(seq_len: int, tile: int = 128) -> str:
  rows = [
      "| mask | cp | order | computed tiles per shard | max / mean |",
      "|---|---:|---|---|---:|",
  ]
  for block_size in (None, 16, 512, 1000):
    for cp in CP_SIZES:
      for balanced in (False, True):
        mask = _mask(seq_len, block_size, cp if balanced else 1)
        counts = splash.tile_counts(mask, tile, tile, q_seq_shards=cp)
        computed = counts[:, 1] + counts[:, 2]
        rows.append(
            f"| {_name(block_size)} | {cp} |"
            f" {'load-balanced' if balanced else 'logical'} |"
            f" {', '.join(str(c) for c in computed)} |"
            f" {computed.max() / computed.mean():.2f} |"
        )
  return "\n".join(rows)


def dense_step_table(lengths=(256, 1024), batch=4, repeats=7) -> str:
  """Wall time of a jitted loss + grads step on the dense path.

  The masks are timed in interleaved rounds so that load from other
  processes hits them alike; the table gives the median and the minimum.
  """
  # Imported here so the tile tables need no model code.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff.models import logits as modeling  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.models import tiny as tiny_models  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.objective import loss as loss_lib  # pylint: disable=g-import-not-at-top

  model = tiny_models.tiny_qwen3(
      256,
      embed_dim=256,
      hidden_dim=512,
      num_heads=4,
      head_dim=64,
      num_kv_heads=2,
  )
  graphdef, state = nnx.split(model)
  rows = [
      f"| L | batch | mask | median ms ({repeats} rounds) | min ms |",
      "|---:|---:|---|---:|---:|",
  ]
  rng = np.random.default_rng(0)
  block_sizes = (1, 16, 64)
  for length in lengths:
    tokens = rng.integers(0, 256, (batch, length)).astype(np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
    weights = (rng.random((batch, length)) < 0.5).astype(np.float32)
    args = (state, tokens, positions, weights)
    steps = {}
    for block_size in block_sizes:

      def loss(state, tokens, positions, weights, block_size=block_size):
        logits = modeling.block_diffusion_logits(
            nnx.merge(graphdef, state), tokens, positions, block_size=block_size
        )
        return loss_lib.diffusion_loss(
            logits, tokens, weights
        ).primary_loss.compute()

      steps[block_size] = jax.jit(jax.value_and_grad(loss))
      jax.block_until_ready(steps[block_size](*args))
    times = {block_size: [] for block_size in block_sizes}
    for _ in range(repeats):
      for block_size, step in steps.items():
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times[block_size].append(time.perf_counter() - start)
    for block_size in block_sizes:
      name = "causal" if block_size == 1 else f"block {block_size}"
      rows.append(
          f"| {length} | {batch} | {name} |"
          f" {1e3 * statistics.median(times[block_size]):.1f} |"
          f" {1e3 * min(times[block_size]):.1f} |"
      )
  return "\n".join(rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--skip-timing", action="store_true")
  args = parser.parse_args(argv)
  print(f"## Splash tiles computed vs skipped, L={args.seq_len}\n")
  print(tile_fraction_table(args.seq_len))
  print(f"\n## Computed tiles per context shard, L={args.seq_len}, tile 128\n")
  print(shard_table(args.seq_len))
  if not args.skip_timing:
    import jax  # pylint: disable=g-import-not-at-top

    print(f"\n## Dense-path training step on {jax.default_backend()}\n")
    print(dense_step_table())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
