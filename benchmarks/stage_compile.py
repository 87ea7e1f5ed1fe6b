"""Compile time of the cached loop's stage programs: in turn or in threads.

`generate(cache_phases=P)` with P > 1 runs one program per stage (the
prefill, each phase, the result; `rollout.cached.stage_programs`), each
holding a copy of the model. This times compiling those programs one after
another against compiling them from a thread pool (XLA's compiler releases
the GIL), each from a fresh `jax.jit` (the persistent compilation cache
off), so that one can tell whether compiling them in parallel pays.

    python benchmarks/stage_compile.py --model qwen3_0p6b --layers 7 \\
        --dtype bfloat16 --batch 32 --cache-phases 4
    python benchmarks/stage_compile.py --model tiny --batch 2
"""

from __future__ import annotations

import argparse
from concurrent import futures
import dataclasses
import pathlib
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import cached_state

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import generation  # pylint: disable=g-import-not-at-top,wrong-import-position


def lowered_stages(graphdef, state, tokens, lengths, config, new, phases):
  """[(name, lowered program)] of every stage that `generate` compiles.

  Fresh `jax.jit`s of `cached.stage_programs`, lowered in this thread.
  """
  init, phase_programs, finish = cached.stage_programs(
      graphdef, cached.program_config(config), new, phases)
  count = cached_state.num_phases(tokens.shape[1], new, config.block_size,
                                  phases)
  names = ["init", *(f"phase {p}" for p in range(count)), "finish"]
  lowered = cached.lower_stages([init, *phase_programs[:count], finish],
                                (state, tokens, lengths, jax.random.key(0),
                                 cached.threshold_operand(config)))
  return list(zip(names, lowered))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny",
                      choices=("tiny", "qwen3_0p6b"))
  parser.add_argument("--layers", type=int, default=0,
                      help="keep this many layers (0: the model's own)")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--prompt-width", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--cache-phases", type=int, default=4)
  parser.add_argument("--threads", type=int, default=0,
                      help="compile threads (0: one per stage)")
  args = parser.parse_args(argv)
  if args.cache_phases < 2:
    parser.error(f"--cache-phases: >= 2, got {args.cache_phases}")
  if args.layers < 0:
    parser.error(f"--layers: >= 0, got {args.layers}")
  model, model_config = generation.build_model(args.model, args.dtype)
  if args.layers:
    model_config = dataclasses.replace(model_config, num_layers=args.layers)
    model = qwen3_lib.Qwen3(model_config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens, lengths = generation.prompts(args.batch, args.prompt_width,
                                       model_config.vocab_size)
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
  config = config_lib.DenoiseConfig(
      mask_token_id=model_config.vocab_size - 1, block_size=4,
      steps_per_block=1)
  times = {}
  for mode in ("threads", "in turn"):
    start = time.perf_counter()
    lowered = lowered_stages(graphdef, state, tokens, lengths, config,
                             args.new_tokens, args.cache_phases)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    if mode == "in turn":
      each = []
      for _, program in lowered:
        begin = time.perf_counter()
        program.compile()
        each.append(time.perf_counter() - begin)
    else:
      with futures.ThreadPoolExecutor(args.threads or len(lowered)) as pool:
        list(pool.map(lambda named: named[1].compile(), lowered))
    times[mode] = time.perf_counter() - start
    detail = ("; each " + ", ".join(
        f"{name} {s:.1f}" for (name, _), s in zip(lowered, each))
              if mode == "in turn" else "")
    print(f"{mode}: {len(lowered)} programs lowered in {lower_s:.1f} s,"
          f" compiled in {times[mode]:.1f} s{detail}", flush=True)
  print(f"\n{args.model} ({args.layers or model_config.num_layers} layers,"
        f" {args.dtype}), batch {args.batch}, {args.cache_phases} phases,"
        f" {jax.devices()[0].device_kind}: compiling in threads took"
        f" {times['threads'] / times['in turn']:.2f}x the time in turn")
  return 0


if __name__ == "__main__":
  # Off before the first compilation (JAX reads the setting once per
  # process); not in `main`, so that a test calling it leaves its process's
  # cache alone.
  jax.config.update("jax_enable_compilation_cache", False)
  sys.exit(main())
