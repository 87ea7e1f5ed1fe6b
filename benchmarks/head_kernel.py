"""Greedy proposals: the fused head kernel against XLA's head and passes.

For N rows of final hidden states (a step's window slots over the batch)
and a model's output head (default Qwen3-0.6B: a tied [151936, 1024]
embedding, bf16), the greedy proposal and its log-probability of each row:

* `xla`: the head's logits [N, V] in its dtype, then `transition.propose`
  (the argmax, then the normaliser: two passes over the logits), what
  `generate` does without `fused_head`;
* `kernel`: `head_kernel.greedy_head`, for each vocabulary tile asked for.

Each program is compiled by a warm-up call and timed as the median of
`--repeats` calls. `same` is the share of rows whose proposal equals
XLA's, `err` the largest log-probability difference. The floor is the
larger of the head's bytes over the HBM bandwidth and its FLOPs over the
peak.

    python benchmarks/head_kernel.py                                  # TPU
    python benchmarks/head_kernel.py --rows 24 --vocab 700 --width 64 \\
        --tiles 128,256 --repeats 1                                   # CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import head_kernel
from tunix_blockdiff.rollout import transition

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import median_seconds  # pylint: disable=g-import-not-at-top,wrong-import-position


def measure(args, rows: int) -> list[dict]:
  """The xla row and a kernel row per vocabulary tile, for N rows."""
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  hidden = jnp.asarray(rng.normal(size=(rows, args.width)), dtype)
  weight = jnp.asarray(rng.normal(size=(args.vocab, args.width))
                       / np.sqrt(args.width), dtype)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=args.mask_id)
  head_bytes = args.vocab * args.width * dtype.itemsize
  floor_ms = 1e3 * max(head_bytes / (args.hbm_gbps * 1e9),
                       2 * rows * args.vocab * args.width
                       / (args.peak_tflops * 1e12))
  xla = jax.jit(lambda h, w: transition.propose((h @ w.T)[None], config))
  want_p, want_lp = xla(hidden, weight)
  median_seconds(lambda: xla(hidden, weight), 1)
  _, seconds = median_seconds(lambda: xla(hidden, weight), args.repeats)
  base = dict(rows=rows, floor_ms=floor_ms)
  out = [dict(base, program="xla", ms=1e3 * seconds, same=1.0, err=0.0)]
  _print(out[-1])
  for tile in (int(t) for t in args.tiles.split(",")):
    row = dict(base, program=f"kernel t{tile}", ms=None, same=None, err=None)
    try:
      run = jax.jit(lambda h, w, t=tile: head_kernel.greedy_head(
          h, w, vocab_major=True, mask_token_id=args.mask_id, vocab_tile=t))
      p, lp = run(hidden, weight)
      median_seconds(lambda: run(hidden, weight), 1)
      _, seconds = median_seconds(lambda: run(hidden, weight), args.repeats)
      row.update(ms=1e3 * seconds,
                 same=float(jnp.mean(p == want_p[0])),
                 err=float(jnp.max(jnp.abs(lp - want_lp[0]))))
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    out.append(row)
    _print(row)
  return out


def _print(row: dict) -> None:
  ms = "failed" if row["ms"] is None else f"{row['ms']:.3f}"
  print(f"| {row['rows']} | {row['program']} | {ms} | {row['floor_ms']:.3f}"
        f" | {row['same']} | {row['err']} | {row.get('error', '')}",
        flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", default="128,512",
                      help="comma-separated N (batch x window slots)")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--mask-id", type=int, default=151669)
  parser.add_argument("--tiles", default="1024,2048")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--hbm-gbps", type=float, default=819.0)
  parser.add_argument("--peak-tflops", type=float, default=197.0)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  if not 0 <= args.mask_id < args.vocab:
    parser.error(f"--mask-id must lie in [0, {args.vocab}), got"
                 f" {args.mask_id}")
  print(f"{jax.devices()[0].device_kind}: head [{args.vocab}, {args.width}]"
        f" {args.dtype}")
  print("| rows | program | ms | floor ms | same | max err | |")
  print("|---:|---|---:|---:|---:|---:|---|")
  rows = []
  for n in (int(r) for r in args.rows.split(",")):
    rows += measure(args, n)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0 if all(r["ms"] is not None for r in rows) else 1


if __name__ == "__main__":
  raise SystemExit(main())
