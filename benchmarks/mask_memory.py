"""Splash mask modes: the memory a gradient through the model keeps.

One tiny Tunix Qwen3 on its flash branch (Pallas interpret mode off a TPU),
one batch of rows, the gradient of the sum of squared logits, compiled and
never run. XLA's memory analysis of each compiled program gives its
temporaries:

* single stream, `mask_mode` `auto` (a `lax.cond` over the whole model
  between the static and the per-example mask), `static` and `dynamic`;
* two-stream `[x0 | xt]`, `dynamic` (the per-example mask, materialised
  per head and layer) and `static` (the lazy `TwoStreamBlockMask`).

These are the figures behind the sft job's choice of mask
(`runs.model_setup.training_mask_mode`) and docs/attention.md.

    python benchmarks/mask_memory.py
    python benchmarks/mask_memory.py --length 1024 --heads 8
"""

from __future__ import annotations

import argparse

from flax import nnx
import jax
from jax.sharding import AxisType
import jax.numpy as jnp

from tunix_blockdiff.models import flash
from tunix_blockdiff.models import tiny as tiny_models

PROGRAMS = (("single", "auto"), ("single", "static"), ("single", "dynamic"),
            ("two_stream", "dynamic"), ("two_stream", "static"))


def temporaries_mib(args, stream: str, mask_mode: str) -> float:
  """MiB of temporaries of the compiled gradient of one (stream, mode)."""
  model = tiny_models.tiny_qwen3(
      256, num_layers=args.layers, embed_dim=args.width,
      hidden_dim=2 * args.width, num_heads=args.heads,
      head_dim=args.width // args.heads, num_kv_heads=max(1, args.heads // 2))
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((args.batch, args.length), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(args.length), tokens.shape)
  tiles = dict(block_size=args.block, mask_mode=mask_mode, q_tile=128,
               kv_tile=128)

  def loss(s, tokens, positions):
    m = nnx.merge(graphdef, s)
    with flash.splash_branch(m, 128):
      if stream == "single":
        out = flash.block_diffusion_logits(m, tokens, positions, **tiles)
      else:
        out = flash.two_stream_logits(m, tokens, tokens, positions, **tiles)
    return jnp.sum(out**2)

  compiled = jax.jit(jax.grad(loss)).lower(state, tokens, positions).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--length", type=int, default=512,
                      help="L (two-stream rows are 2L); a multiple of 128")
  parser.add_argument("--block", type=int, default=16)
  args = parser.parse_args(argv)
  if args.length % 128 or args.width % args.heads:
    parser.error("--length must be a multiple of 128 and --heads divide"
                 " --width")
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  rows = []
  print(f"Qwen3 {args.layers} layers, width {args.width}, {args.heads}"
        f" heads; batch {args.batch} x {args.length}, block {args.block};"
        f" {jax.default_backend()}\n")
  print("| stream | mask_mode | gradient temporaries MiB |\n|---|---|---:|")
  with mesh:  # Tunix's flash branch reads the legacy mesh context
    for stream, mode in PROGRAMS:
      mib = temporaries_mib(args, stream, mode)
      rows.append(dict(stream=stream, mask_mode=mode, temp_mib=mib))
      print(f"| {stream} | {mode} | {mib:.1f} |", flush=True)
  return rows


if __name__ == "__main__":
  main()
