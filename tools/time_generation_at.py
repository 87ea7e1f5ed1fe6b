"""Times and profiles one `generate` configuration in any commit's tree.

For bisecting a TPU regression: the same calls as `benchmarks/
generation.py` (its `build_model`, `prompts` and `SCHEDULES`), from the
tree in the current directory, so an old commit runs its own code:

    git archive COMMIT | tar -x -C /tmp/tree && cd /tmp/tree
    PYTHONPATH=$PWD python /path/to/tools/time_generation_at.py COMMIT OUT \\
        --model qwen3_0p6b --batch 32 --schedule b16s4 --cache-phases 4 \\
        --lockstep --fused-head

Prints the first call's seconds, the median of `--repeats` calls (and per
model call), then one traced call: each XLA program's device time in order
(the stages of a staged loop show one by one) and the total of the device
ops, whose table (`benchmarks/profile_generation.py`'s summary) goes to
OUT/TAG.json. A mode that the tree's `generate` lacks is left out at its
default (off, one phase) and refused otherwise.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import pathlib
import statistics
import sys
import tempfile
import time

import generation_case


def accepted_default(mode: str):
  """The value of `mode` that a `generate` without it behaves as."""
  return 1 if mode == "cache_phases" else False


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("tag")
  parser.add_argument("out")
  generation_case.add_arguments(parser)
  parser.add_argument("--one-program", action="store_true")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats: >= 1, got {args.repeats}")
  sys.path.insert(0, str(pathlib.Path.cwd() / "benchmarks"))
  # pylint: disable=g-import-not-at-top
  import jax
  import generation
  import profile_generation
  from tunix_blockdiff.rollout import cached

  case = generation_case.build(args, generation)
  modes = dict(cache_phases=args.cache_phases, lockstep=args.lockstep,
               fused_head=args.fused_head, one_program=args.one_program)
  accepted = inspect.signature(cached.generate).parameters
  missing = [k for k, v in modes.items()
             if k not in accepted and v != accepted_default(k)]
  if missing:
    parser.error(f"this tree's generate has no {missing}")
  modes = {k: v for k, v in modes.items() if k in accepted}

  def run():
    return cached.generate(case.model, case.tokens, case.lengths, case.config,
                           max_new_tokens=args.new_tokens, **modes)

  start = time.perf_counter()
  result = jax.block_until_ready(run())
  print(args.tag, "first call s", round(time.perf_counter() - start, 1))
  seconds = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    seconds.append(time.perf_counter() - start)
  calls = int(result.num_steps)
  median = statistics.median(seconds)
  print(args.tag, "calls", calls, "s", [round(s, 4) for s in seconds],
        "median ms/call", round(1e3 * median / calls, 3), flush=True)
  trace_dir = tempfile.mkdtemp(prefix="time_generation_at_")
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready(run())
  path = max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True),
             key=lambda p: pathlib.Path(p).stat().st_mtime)
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      if line.name != "XLA Modules":
        continue
      events = sorted((e.start_ns, e.duration_ns, e.name)
                      for e in line.events)
      for start_ns, duration_ns, name in events:
        print(args.tag, "program", name[:60], "at",
              round((start_ns - events[0][0]) / 1e6, 2), "ms, device",
              round(duration_ns / 1e6, 2), "ms")
  rows = profile_generation.summarise(profile_generation.device_ops(path))
  total = sum(r["ms"] for r in rows)
  print(args.tag, "device ops ms", round(total, 2), "per call",
        round(total / calls, 3))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{args.tag}.json").write_text(json.dumps(
      dict(total_ms=total, calls=calls, seconds=seconds, ops=rows)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
