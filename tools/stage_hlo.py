"""The compiled programs of a loop in phases: stages against one program.

Compiles `generate`'s staged programs (prefill, each phase, the result)
and the same loop as one program (`one_program=True`) for the
configuration of `benchmarks/generation.py`, writes each program's
compiled HLO text (`compiled.as_text()`) to OUT, and prints per program
what memory-space assignment did: the asynchronous copies to and from
the accelerator's fast memory (`copy-start`) and how many values it
placed there (shapes annotated `S(1)`), with the layouts of the loop
state's largest arrays at the program's entry. Made for a TPU (on a CPU
there is no fast memory to assign):

    python tools/stage_hlo.py OUT --model qwen3_0p6b --batch 32 \\
        --schedule b16s4 --cache-phases 4 --lockstep --fused-head

`--summarise OUT` prints the same counts from texts written before.
"""

from __future__ import annotations

import argparse
import collections
from concurrent import futures
import pathlib
import re
import sys

import generation_case


def summarise(text: str) -> dict:
  """Counts of memory-space assignment in one compiled program's HLO text."""
  entry = re.search(r"entry_computation_layout=\{\((.*?)\)->", text)
  params = re.findall(r"\w+\[[\d,]*\]\{[^}]*\}", entry.group(1)) if entry else []

  def elements(shape: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", shape).group(1)
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    return count

  largest = sorted(set(params), key=elements, reverse=True)[:3]
  in_fast_memory = collections.Counter(
      re.findall(r"(\w+\[[\d,]*\])\{[^}]*S\(1\)\}", text))
  return dict(
      copy_starts=len(re.findall(r" copy-start\(", text)),
      fast_memory_values=sum(in_fast_memory.values()),
      most_in_fast_memory=in_fast_memory.most_common(3),
      largest_entry_layouts=largest,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out")
  parser.add_argument("--summarise", action="store_true",
                      help="only summarise the texts already in OUT")
  generation_case.add_arguments(parser, cache_phases=4)
  args = parser.parse_args(argv)
  if args.cache_phases < 2:
    parser.error(f"--cache-phases: >= 2 (stages exist), got "
                 f"{args.cache_phases}")
  out = pathlib.Path(args.out)
  if not args.summarise:
    out.mkdir(parents=True, exist_ok=True)
    _compile_and_write(args, out)
  names = sorted(out.glob("*.txt"))
  if not names:
    parser.error(f"no compiled programs (*.txt) in {out}")
  for path in names:
    print(path.stem, summarise(path.read_text()))
  return 0


def _compile_and_write(args, out: pathlib.Path) -> None:
  """Compiles the stages (in threads) and the one program; writes texts."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]
                         / "benchmarks"))
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  import generation
  import jax
  import jax.numpy as jnp
  from tunix_blockdiff.rollout import cached
  from tunix_blockdiff.rollout import cached_state

  case = generation_case.build(args, generation)
  graphdef, state = nnx.split(case.model)
  inputs = (state, jnp.asarray(case.tokens, jnp.int32),
            jnp.asarray(case.lengths, jnp.int32), jax.random.key(0),
            cached.threshold_operand(case.config))
  init, phases, finish = cached.stage_programs(
      graphdef, cached.program_config(case.config), args.new_tokens,
      args.cache_phases, args.lockstep, False, args.fused_head)
  # A short case makes fewer phases than asked; `generate` runs those.
  phases = phases[:cached_state.num_phases(
      args.prompt_width, args.new_tokens, case.config.block_size,
      args.cache_phases)]
  lowered = cached.lower_stages([init, *phases, finish], inputs)
  names = ["stage_0_prefill",
           *[f"stage_{p + 1}_phase_{p}" for p in range(len(phases))],
           f"stage_{len(phases) + 1}_result"]

  def write(item):
    name, program = item
    (out / f"{name}.txt").write_text(program.compile().as_text())

  with futures.ThreadPoolExecutor(len(lowered)) as pool:
    list(pool.map(write, zip(names, lowered)))
  key = (case.config, args.new_tokens, True, args.cache_phases, args.lockstep,
         False, args.fused_head, True)
  one = cached._program(graphdef, key)  # pylint: disable=protected-access
  (out / "one_program.txt").write_text(
      one.lower(*inputs).compile().as_text())


if __name__ == "__main__":
  raise SystemExit(main())
