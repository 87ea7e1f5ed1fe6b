"""Where a `generate` call spends its device time: a profile, summarised.

Builds the model and prompts of `benchmarks/generation.py`, compiles
`generate` under one schedule with a warm-up call, traces one more call with
`jax.profiler`, and sums the device time of every executed XLA op by name
(an op inside the loop counts once per execution; loops and conditionals
themselves are left out, their bodies' ops count). Prints the ops that took
the most, each with its executions, total and share of the call, and its
HLO category and the source line that made it where the profile has them;
with `--json`, writes them all.

    python benchmarks/profile_generation.py --model qwen3_0p6b \\
        --dtype bfloat16 --batch 128 --schedule b4s1        # on the TPU
    python benchmarks/profile_generation.py --batch 2 --new-tokens 16

On a CPU the ops are the host's XLA thunks; on a TPU, the `XLA Ops` line of
the device plane.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import pathlib
import re
import sys
import tempfile

import jax

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import cached

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import generation  # pylint: disable=g-import-not-at-top,wrong-import-position

_KEEP_STATS = ("hlo_category", "tf_op", "source", "long_name")
# Ops whose events span their bodies' ops (counted on their own): loops,
# conditionals (named `cond.N` on a TPU) and calls.
_CONTAINERS = ("while", "conditional", "cond.", "call")


def is_container(name: str) -> bool:
  """Whether an op's event spans other ops' events (its body's)."""
  return name.startswith(_CONTAINERS)


def device_ops(xspace_path: str) -> list[dict]:
  """Every executed XLA op of a trace: name, nanoseconds, and its stats."""
  data = jax.profiler.ProfileData.from_file(xspace_path)
  ops = []
  for plane in data.planes:
    on_device = plane.name.startswith("/device:")
    for line in plane.lines:
      if on_device and line.name != "XLA Ops":
        continue
      for event in line.events:
        name, shape = _split_hlo(event.name)
        if is_container(name):
          continue  # a loop's time is its body ops', counted on their own
        stats = dict(event.stats)
        if not on_device and "hlo_op" not in stats:
          continue
        ops.append(dict(
            name=name, shape=shape, ns=float(event.duration_ns),
            **{k: str(stats[k]) for k in _KEEP_STATS if k in stats}))
  return ops


def _split_hlo(text: str) -> tuple[str, str]:
  """(op name, its result type) of a TPU event named by its HLO text."""
  if " = " not in text:
    return text, ""
  name, rhs = text.split(" = ", 1)
  rhs = re.sub(r"\{[^}]*\}", "", rhs)  # layouts
  if rhs.startswith("("):  # a tuple result
    result = rhs[:rhs.find(")") + 1]
  else:
    result = rhs.split("(", 1)[0].strip().rsplit(" ", 1)[0]
  return name.lstrip("%"), result[:80]


def summarise(ops: list[dict]) -> list[dict]:
  """Ops grouped by name, most time first: count, ms, share of the total."""
  groups = collections.OrderedDict()
  for op in ops:
    group = groups.setdefault(op["name"], dict(op, count=0, ms=0.0))
    group["count"] += 1
    group["ms"] += op["ns"] / 1e6
  total = sum(g["ms"] for g in groups.values()) or 1.0
  rows = sorted(groups.values(), key=lambda g: -g["ms"])
  for row in rows:
    row.pop("ns", None)
    row["share"] = row["ms"] / total
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny",
                      choices=("tiny", "qwen3_0p6b"))
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--prompt-width", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--schedule", default="b4s1",
                      choices=tuple(generation.SCHEDULES))
  parser.add_argument("--cache-phases", type=int, default=1,
                      help="generate's cache_phases")
  parser.add_argument("--lockstep", action="store_true",
                      help="generate(lockstep=True)")
  parser.add_argument("--ragged-cache", action="store_true",
                      help="generate(ragged_cache=True): the Pallas kernel")
  parser.add_argument("--fused-head", action="store_true",
                      help="generate(fused_head=True): the head kernel")
  parser.add_argument("--one-program", action="store_true",
                      help="generate(one_program=True): every phase in one"
                      " program")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--trace-dir", default=None,
                      help="keep the trace here (default: a temp dir)")
  parser.add_argument("--json", default=None, help="write every op here")
  args = parser.parse_args(argv)
  if args.batch < 1 or args.new_tokens < 1 or args.cache_phases < 1:
    parser.error("--batch, --new-tokens and --cache-phases must be >= 1")

  model, model_config = generation.build_model(args.model, args.dtype)
  vocab = model_config.vocab_size
  tokens, lengths = generation.prompts(args.batch, args.prompt_width, vocab,
                                       seed=args.batch)
  config = config_lib.DenoiseConfig(mask_token_id=vocab - 1,
                                    **generation.SCHEDULES[args.schedule])

  def run():
    return cached.generate(model, tokens, lengths, config,
                           max_new_tokens=args.new_tokens,
                           cache_phases=args.cache_phases,
                           lockstep=args.lockstep,
                           ragged_cache=args.ragged_cache,
                           fused_head=args.fused_head,
                           one_program=args.one_program)

  result = jax.block_until_ready(run())  # compiles
  trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="profile_gen_")
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready(run())
  paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not paths:
    raise SystemExit(f"no .xplane.pb under {trace_dir}")
  rows = summarise(device_ops(max(paths, key=lambda p: pathlib.Path(p)
                                  .stat().st_mtime)))
  total = sum(r["ms"] for r in rows)
  calls = int(result.num_steps)
  print(f"{args.model} {args.dtype} batch {args.batch} {args.schedule}"
        f" cache_phases {args.cache_phases}"
        + (" lockstep" if args.lockstep else "")
        + (" ragged_cache" if args.ragged_cache else "")
        + (" fused_head" if args.fused_head else "")
        + (" one_program" if args.one_program else "") + ":"
        f" {total:.1f} ms of device ops, {calls} model calls"
        f" ({total / calls:.2f} ms/call), {jax.devices()[0].device_kind}\n")
  print("| op | result | runs | ms | share | ms/call | source |")
  print("|---|---|---:|---:|---:|---:|---|")
  for r in rows[:args.top]:
    print(f"| {r['name']} | {r['shape'] or '-'} | {r['count']} |"
          f" {r['ms']:.2f} | {100 * r['share']:.1f}% |"
          f" {r['ms'] / calls:.3f} | {r.get('source', '-')[-60:]} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(total_ms=total, calls=calls, ops=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
