"""An evaluation's threshold sweep: one shared program against one each.

An sft job evaluates `generate` at every `eval.thresholds` value. The
threshold is a program operand (`rollout.cached.threshold_operand`), so the
whole sweep runs one compiled loop. This times the sweep that way and, in
the same run, with a fresh program per threshold (the programs dropped
before each threshold, the persistent compilation cache off: what each
threshold cost when it was a compile-time constant), and prints both with
their compile counts:

    python benchmarks/threshold_sweep.py --model tiny
    python benchmarks/threshold_sweep.py --model qwen3_0p6b --dtype bfloat16 \\
        --batch 32 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import cached

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import generation  # pylint: disable=g-import-not-at-top,wrong-import-position

MODES = ("shared", "one_per_threshold")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _thresholds(text: str) -> list[float]:
  try:
    values = [float(t) for t in text.split(",")]
  except ValueError:
    values = []
  if not values or not all(0.0 < t <= 1.0 for t in values):
    raise ValueError(
        f"--thresholds: comma-separated values in (0, 1], got {text!r}")
  return values


def sweep(model, tokens, lengths, configs, new_tokens: int,
          mode: str) -> dict:
  """One pass over `configs`: seconds and compilations per threshold.

  Args:
    model: a Tunix causal LM.
    tokens: int32 [B, P] left-padded prompts.
    lengths: int32 [B] their lengths.
    configs: `DenoiseConfig`s differing only in the threshold.
    new_tokens: completion slots per row.
    mode: `shared` (the programs dropped before the first threshold only)
      or `one_per_threshold` (dropped before each).

  Returns:
    {"mode", "seconds" (the whole pass), "compiles", "per_threshold":
    [{"threshold", "seconds", "compiles", "num_steps"}]}.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  compiles = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == _COMPILE_EVENT:
      compiles.append(event)

  rows = []
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    start = time.perf_counter()
    for i, config in enumerate(configs):
      if mode == "one_per_threshold" or not i:
        cached._PROGRAMS.clear()  # pylint: disable=protected-access
      before, begin = len(compiles), time.perf_counter()
      result = jax.block_until_ready(cached.generate(
          model, tokens, lengths, config, max_new_tokens=new_tokens))
      rows.append({"threshold": config.threshold,
                   "seconds": time.perf_counter() - begin,
                   "compiles": len(compiles) - before,
                   "num_steps": int(result.num_steps)})
    seconds = time.perf_counter() - start
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return {"mode": mode, "seconds": seconds,
          "compiles": sum(r["compiles"] for r in rows),
          "per_threshold": rows}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny",
                      choices=("tiny", "qwen3_0p6b"))
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-width", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--block-size", type=int, default=4)
  parser.add_argument("--thresholds", default="0.5,0.7,0.9,0.95,0.99,1.0",
                      help="the tiny recipe's eval.thresholds by default")
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)
  try:
    thresholds = _thresholds(args.thresholds)
  except ValueError as e:
    parser.error(str(e))
  for name in ("batch", "prompt_width", "new_tokens", "block_size"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')}: >= 1, got"
                   f" {getattr(args, name)}")
  model, model_config = generation.build_model(args.model, args.dtype)
  tokens, lengths = generation.prompts(args.batch, args.prompt_width,
                                       model_config.vocab_size)
  configs = [config_lib.DenoiseConfig(
      block_size=args.block_size, mask_token_id=model_config.vocab_size - 1,
      threshold=t) for t in thresholds]
  rows = [sweep(model, tokens, lengths, configs, args.new_tokens, mode)
          for mode in ("one_per_threshold", "shared")]
  for row in rows:
    each = ", ".join(f"{r['threshold']:g}: {r['seconds']:.2f} s"
                     for r in row["per_threshold"])
    print(f"{row['mode']}: {len(thresholds)} thresholds in"
          f" {row['seconds']:.2f} s, {row['compiles']} compilations ({each})",
          flush=True)
  one, shared = rows
  print(f"\n{args.model} ({args.dtype}), batch {args.batch}, prompt"
        f" {args.prompt_width}, {args.new_tokens} new tokens, block"
        f" {args.block_size}, {jax.devices()[0].device_kind}: the shared"
        f" program's sweep took {shared['seconds'] / one['seconds']:.2f}x the"
        f" time of one program per threshold")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  # Off before the first compilation (JAX reads the setting once per
  # process); not in `main`, so that a test calling it leaves its process's
  # cache alone.
  jax.config.update("jax_enable_compilation_cache", False)
  sys.exit(main())
