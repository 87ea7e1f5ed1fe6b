"""Hashes of the device programs a tree builds, to show a host-side change kept them.

For a change that should not touch what runs on the accelerator (host
conversions, checks, renames): run it in the tree before and after and
compare. Prints one `name hash` line per program: `generate`'s loop for
each schedule of `benchmarks/generation.py` (the case of
`generation_case.py`, one phase), and the attention programs of `attention/` (the
block-causal mask, Splash's static-mask check with context parallelism,
the load-balanced reorder). Each hash is of the lowered StableHLO without
debug information, so equal hashes are the same program:

    git archive COMMIT | tar -x -C /tmp/tree && cd /tmp/tree
    PYTHONPATH=$PWD python /path/to/tools/program_hashes.py --model tiny
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys

import generation_case


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  generation_case.add_arguments(parser)
  args = parser.parse_args(argv)
  if args.cache_phases != 1:
    parser.error("--cache-phases: 1 (a staged loop is several programs; "
                 f"tools/stage_hlo.py writes them), got {args.cache_phases}")
  sys.path.insert(0, str(pathlib.Path.cwd() / "benchmarks"))
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  import generation
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tunix_blockdiff.attention import context_parallel
  from tunix_blockdiff.attention import masks
  from tunix_blockdiff.attention import splash
  from tunix_blockdiff.rollout import cached

  def digest(lowered) -> str:
    text = lowered.as_text(debug_info=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  case = generation_case.build(args, generation)
  graphdef, state = nnx.split(case.model)
  inputs = (state, jnp.asarray(case.tokens, jnp.int32),
            jnp.asarray(case.lengths, jnp.int32), jax.random.key(0))
  for name in sorted(generation.SCHEDULES):
    config = generation_case.denoise_config(generation, name, case.vocab)
    key = (config, args.new_tokens, True, 1, args.lockstep, False,
           args.fused_head, False)
    program = cached._program(graphdef, key)  # pylint: disable=protected-access
    # A tree whose programs take the threshold as an operand (since the
    # threshold sweep shares one program) is passed it too.
    operand = getattr(cached, "threshold_operand", None)
    extra = () if operand is None else (operand(config),)
    print(f"generate_{name}", digest(program.lower(*inputs, *extra)))
  positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))
  print("block_causal_mask", digest(jax.jit(
      lambda p: masks.block_causal_mask(p, p, 4)).lower(positions)))
  print("static_mask_matches", digest(jax.jit(
      lambda p: splash.static_mask_matches(p, 4, cp_size=2)).lower(positions)))
  print("context_parallel_reorder", digest(jax.jit(
      lambda x: context_parallel.reorder_for_context_parallel(x, 2)).lower(
          jnp.ones((2, 16, 3)))))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
