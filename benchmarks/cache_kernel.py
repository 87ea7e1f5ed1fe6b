"""The Pallas cache read (`rollout.cache_kernel`) against XLA's attention.

One call reads every layer's cache for a window of queries, as a step of
the cached `generate` does, at a model's attention shapes (default Qwen3-0.6B:
28 layers, 8 key heads of 128, 16 query heads, batch 128, a 4-slot window):

* `xla`: scores over all S slots, masked to each row's span, softmax and
  the weighted values (what `generate` does without `ragged_cache`);
* `kernel`: `cache_kernel.partial_attention` then `merge`, for each chunk
  size and rows per grid step asked for.

Rows' spans are drawn like a generation's: slots [shift, shift + written)
with the shift in [0, --max-shift] and `--written` slots written. Each
program is compiled by a warm-up call and timed as the median of
`--repeats` calls; the kernel's output is checked against `xla`'s (max
absolute difference, float32). The floor is the bytes of the rows' spans
(keys and values, all layers) over the HBM bandwidth, and `all slots` the
bytes of the whole cache.

    python benchmarks/cache_kernel.py                       # on a TPU
    python benchmarks/cache_kernel.py --batch 8 --layers 2 --slots 64 \\
        --written 40 --chunks 16,32 --repeats 1             # CPU (interpret)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff.rollout import cache_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import median_seconds  # pylint: disable=g-import-not-at-top,wrong-import-position


def xla_attention(q, keys, values, lo, hi, scale):
  """Every layer: q [B, K, Q, H] over each layer's [B, K, S, H], masked."""
  slot = jnp.arange(keys[0].shape[2])
  valid = ((slot >= lo[:, None]) & (slot < hi[:, None]))[:, None, None, :]
  out = []
  for k, v in zip(keys, values):
    s = jnp.einsum("bkqh,bksh->bkqs", q, k,
                   preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(valid, s, -1e30), axis=-1)
    out.append(jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), v,
                          preferred_element_type=jnp.float32))
  return jnp.stack(out)


def kernel_attention(q, keys, values, lo, hi, scale, chunk, row_block):
  """Every layer through the kernel; keys [L, B, K, S, H] passed whole."""
  return jnp.stack([cache_kernel.merge([cache_kernel.partial_attention(
      q, keys, values, layer, lo, hi, scale=scale, chunk=chunk,
      row_block=row_block)]) for layer in range(keys.shape[0])])


def measure(args, slots: int) -> list[dict]:
  """The xla row and a kernel row per (chunk, row block) for one S."""
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  b, kh, h, layers = args.batch, args.kv_heads, args.head_dim, args.layers
  q_len = args.q_heads // kh * args.window
  shape = (layers, b, kh, slots, h)
  keys = jnp.asarray(rng.normal(size=shape), dtype)
  values = jnp.asarray(rng.normal(size=shape), dtype)
  q = jnp.asarray(rng.normal(size=(b, kh, q_len, h)), dtype)
  shift = rng.integers(0, args.max_shift + 1, size=b)
  written = min(args.written, slots - args.max_shift)
  lo = jnp.asarray(shift, jnp.int32)
  hi = jnp.asarray(shift + written, jnp.int32)
  scale = h ** -0.5
  per_slot = layers * b * kh * h * 2 * dtype.itemsize  # keys and values
  floor_ms = written * per_slot / (args.hbm_gbps * 1e9) * 1e3
  all_ms = slots * per_slot / (args.hbm_gbps * 1e9) * 1e3
  listed = [keys[i] for i in range(layers)], [values[i] for i in range(layers)]
  # Timed programs return a sum per layer (fetching the whole output to the
  # host would take longer than the attention); checked ones return it all.
  full = jax.jit(lambda q, ks, vs, lo, hi: xla_attention(q, ks, vs, lo, hi,
                                                         scale))
  xla = jax.jit(lambda *a: full(*a).sum(axis=(1, 2, 3, 4)))
  want = full(q, *listed, lo, hi)
  median_seconds(lambda: xla(q, *listed, lo, hi), 1)  # compile
  _, xla_s = median_seconds(lambda: xla(q, *listed, lo, hi), args.repeats)
  error = jax.jit(lambda a, b: jnp.max(jnp.abs(a - b)))
  base = dict(slots=slots, batch=b, written=written, floor_ms=floor_ms,
              all_slots_ms=all_ms)
  rows = [dict(base, program="xla", ms=xla_s * 1e3, err=0.0)]
  _print(rows[-1])
  sizes = [cache_kernel.chunk_size(slots) if c == "auto" else int(c)
           for c in args.chunks.split(",")]
  for size in dict.fromkeys(s for s in sizes if slots % s == 0):
    for row_block in (int(r) for r in args.row_blocks.split(",")):
      row = dict(base, program=f"kernel c{size} r{row_block}", ms=None,
                 err=None)
      try:
        whole = jax.jit(lambda q, k, v, lo, hi, c=size, r=row_block:
                        kernel_attention(q, k, v, lo, hi, scale, c, r))
        run = jax.jit(lambda *a, f=whole: f(*a).sum(axis=(1, 2, 3, 4)))
        err = float(error(whole(q, keys, values, lo, hi), want))
        median_seconds(lambda: run(q, keys, values, lo, hi), 1)
        _, seconds = median_seconds(lambda: run(q, keys, values, lo, hi),
                                    args.repeats)
        row.update(ms=seconds * 1e3, err=err)
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      rows.append(row)
      _print(row)
  return rows


def _print(row: dict) -> None:
  ms = "failed" if row["ms"] is None else f"{row['ms']:.3f}"
  print(f"| {row['slots']} | {row['program']} | {ms} |"
        f" {row['floor_ms']:.3f} | {row['all_slots_ms']:.3f} |"
        f" {row['err']} | {row.get('error', '')}", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--layers", type=int, default=28)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--q-heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--window", type=int, default=4)
  parser.add_argument("--slots", default="336")
  parser.add_argument("--written", type=int, default=192,
                      help="slots each row has written")
  parser.add_argument("--max-shift", type=int, default=48)
  parser.add_argument("--chunks", default="auto")
  parser.add_argument("--row-blocks", default="8")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--hbm-gbps", type=float, default=819.0)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}: batch {args.batch}, {args.layers}"
        f" layers, {args.kv_heads} key heads of {args.head_dim}, window"
        f" {args.window}, {args.written} slots written")
  print("| slots | program | ms | floor ms | all slots ms | max err | |")
  print("|---:|---|---:|---:|---:|---:|---|")
  rows = []
  for slots in (int(s) for s in args.slots.split(",")):
    rows += measure(args, slots)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0 if all(r["ms"] is not None for r in rows) else 1


if __name__ == "__main__":
  raise SystemExit(main())
