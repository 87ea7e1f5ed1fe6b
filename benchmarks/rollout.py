"""Rollout benchmark: cached vs cacheless block diffusion vs Tunix's AR sampler.

One process, one tiny Qwen3 (4 layers, width 256, 4 query heads of 64, 2 KV
heads; random weights, float32), the same left-padded prompts of different
lengths for every program:

* `cached`: `tunix_blockdiff.generate(..., use_cache=True)`, the exact
  block-KV-cached driver;
* `cacheless`: `generate(..., use_cache=False)`, `denoise` over full-sequence
  block-causal logits every step;
* `tunix AR`: Tunix's own `Sampler` (greedy, one token per model call, its
  KV cache), with a tiny in-code tokenizer over space-separated ids;
* `transition`: `denoise` with a logits function that returns precomputed
  logits, i.e. the transition program's own cost per step.

Block diffusion runs in static mode (`steps_per_block = block / 4`, four
tokens per step) and threshold mode. Every program is compiled by a warm-up
call, then timed over `--repeats` calls; the table reports medians.

    python benchmarks/rollout.py               # the README table
    python benchmarks/rollout.py --repeats 1 --new-tokens 64   # quick
    tunix-blockdiff bench rollout [flags]       # the same, via the CLI
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import denoise as denoise_lib

NUM_LAYERS, EMBED, HIDDEN, HEADS, HEAD_DIM, KV_HEADS = 4, 256, 1024, 4, 64, 2


class IdTokenizer:
  """Space-separated integer ids <-> text; id 0 is padding, no BOS."""

  def __init__(self, eos: int):
    self._eos = eos

  def encode(self, text: str, **unused) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **unused) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self) -> int:
    return 0  # falsy: the sampler then adds no BOS

  def eos_id(self) -> int:
    return self._eos

  def pad_id(self) -> int:
    return 0


class _Program(NamedTuple):
  name: str
  mode: str
  run: Callable[[], Any]  # returns something to block on
  calls: Callable[[Any], int]  # model calls (or steps) of one run's output
  tokens_per_call: Callable[[Any], float]
  repeats: int


def _time_round_robin(programs, repeats: int):
  """Warm every program up, then time them in turns (fair under CPU noise)."""
  outputs = {}
  for program in programs:
    outputs[program.name, program.mode] = jax.block_until_ready(program.run())
    print(f"  compiled {program.name} / {program.mode}", flush=True)
  times = {(p.name, p.mode): [] for p in programs}
  for turn in range(repeats):
    for program in programs:
      if turn >= program.repeats:
        continue
      start = time.perf_counter()
      jax.block_until_ready(program.run())
      times[program.name, program.mode].append(time.perf_counter() - start)
  return {
      key: statistics.median(value) for key, value in times.items()
  }, outputs


def _prompts(batch: int, max_prompt: int, vocab: int, seed: int):
  """Left-padded prompts of distinct lengths in (max_prompt/4, max_prompt]."""
  rs = np.random.RandomState(seed)
  lengths = np.linspace(max_prompt, max(1, max_prompt // 4 + 1), batch).astype(
      int
  )
  lengths = np.maximum(lengths - np.arange(batch) % 2, 1)  # mix even and odd
  tokens = np.zeros((batch, max_prompt), np.int32)
  for b, length in enumerate(lengths):
    tokens[b, max_prompt - length :] = rs.randint(1, vocab - 1, size=length)
  return tokens, lengths.astype(np.int32)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
      "--cacheless-repeats",
      type=int,
      default=1,
      help="timed runs of the (slow) cacheless program after its warm-up",
  )
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--max-prompt", type=int, default=64)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--threshold", type=float, default=0.9)
  parser.add_argument("--skip-cacheless", action="store_true")
  args = parser.parse_args(argv)

  vocab, block, new = args.vocab, args.block_size, args.new_tokens
  mask = vocab - 1
  model = tiny_models.tiny_qwen3(
      vocab,
      num_layers=NUM_LAYERS,
      embed_dim=EMBED,
      hidden_dim=HIDDEN,
      num_heads=HEADS,
      head_dim=HEAD_DIM,
      num_kv_heads=KV_HEADS,
  )
  prompts, lengths = _prompts(args.batch, args.max_prompt, vocab, seed=0)
  tokens_out = args.batch * new
  modes = {
      "static (4 tok/step)": config_lib.DenoiseConfig(
          block_size=block,
          mask_token_id=mask,
          steps_per_block=max(1, block // 4),
      ),
      f"threshold {args.threshold}": config_lib.DenoiseConfig(
          block_size=block, mask_token_id=mask, threshold=args.threshold
      ),
  }

  def generation(config, use_cache):
    return lambda: cached.generate(
        model, prompts, lengths, config, max_new_tokens=new, use_cache=use_cache
    )

  def steps(result):
    return int(result.num_steps)

  def per_step(result):
    return new / int(result.num_steps)

  programs = []
  for mode, config in modes.items():
    programs.append(
        _Program(
            "cached",
            mode,
            generation(config, True),
            steps,
            per_step,
            args.repeats,
        )
    )
    if not args.skip_cacheless:
      programs.append(
          _Program(
              "cacheless",
              mode,
              generation(config, False),
              steps,
              per_step,
              args.cacheless_repeats,
          )
      )

  # Tunix's autoregressive sampler on the same model and prompts (greedy). The
  # mask id doubles as its EOS and is forbidden, so every row decodes `new`.
  tokenizer = IdTokenizer(eos=mask)
  sampler = sampler_lib.Sampler(
      model,
      tokenizer,
      sampler_lib.CacheConfig(
          cache_size=args.max_prompt + new + 8,
          num_layers=NUM_LAYERS,
          num_kv_heads=KV_HEADS,
          head_dim=HEAD_DIM,
      ),
  )
  texts = [
      tokenizer.decode(p[args.max_prompt - n :])
      for p, n in zip(prompts, lengths)
  ]
  programs.append(
      _Program(
          "tunix AR Sampler",
          "greedy",
          lambda: sampler(
              texts,
              max_generation_steps=new,
              max_prompt_length=args.max_prompt,
              eos_tokens=[mask],
              forbidden_tokens=[mask],
          ).tokens,
          lambda out: max(len(t) for t in out),
          lambda out: 1.0,
          args.repeats,
      )
  )

  # The transition program alone: denoise over precomputed logits.
  static_mode = "static (4 tok/step)"
  tokens, positions, validity, completion = cached.sequence_layout(
      prompts, lengths, np.zeros((args.batch, new), np.int32)
  )
  logits = 3.0 * jax.random.normal(
      jax.random.key(1), tokens.shape + (vocab,), jnp.float32
  )
  transition = jax.jit(
      lambda t, p, c, v, lg: denoise_lib.denoise(
          lambda *_: lg, t, p, c, v, modes[static_mode]
      )
  )
  programs.append(
      _Program(
          "transition only",
          "static, precomputed logits",
          lambda: transition(tokens, positions, completion, validity, logits),
          steps,
          per_step,
          args.repeats,
      )
  )

  seconds, outputs = _time_round_robin(programs, args.repeats)
  rows = []
  for p in programs:
    out = outputs[p.name, p.mode]
    rows.append((
        p.name,
        p.mode,
        seconds[p.name, p.mode],
        p.calls(out),
        p.tokens_per_call(out),
    ))
  table = {(name, mode): (secs, calls) for name, mode, secs, calls, _ in rows}

  print()
  print(
      f"Tiny Qwen3 ({NUM_LAYERS} layers, width {EMBED}, vocab {vocab}), batch"
      f" {args.batch}, prompt lengths {lengths.tolist()}, {new} new tokens,"
      f" block {block}, median of {args.repeats} timed runs"
      f" ({args.cacheless_repeats} for cacheless) after a warm-up,"
      f" {jax.devices()[0].platform.upper()}"
  )
  print()
  print(
      "| program | mode | median s | tokens/s | model calls | ms/call |"
      " tokens/call/row |"
  )
  print("|---|---|---:|---:|---:|---:|---:|")
  for name, mode, seconds, calls, per_call in rows:
    print(
        f"| {name} | {mode} | {seconds:.3f} | {tokens_out / seconds:,.0f} |"
        f" {calls} | {1000 * seconds / calls:.2f} | {per_call:.2f} |"
    )

  print()
  cached_static, cached_static_steps = table["cached", static_mode]
  checks = []
  for mode in modes:
    if ("cacheless", mode) in table:
      ratio = table["cacheless", mode][0] / table["cached", mode][0]
      checks.append(
          (f"cached vs cacheless, {mode}", ratio, ">= 4x", ratio >= 4)
      )
  ratio = table["tunix AR Sampler", "greedy"][0] / cached_static
  checks.append((
      "cached (4 tok/step) vs Tunix AR Sampler",
      ratio,
      ">= 1.5x",
      ratio >= 1.5,
  ))
  transition_seconds, transition_steps = table[
      "transition only", "static, precomputed logits"
  ]
  overhead = (transition_seconds / transition_steps) / (
      cached_static / cached_static_steps
  )
  checks.append(
      ("transition step / cached step", overhead, "<= 10%", overhead <= 0.10)
  )
  print("| comparison | measured | target | met |")
  print("|---|---:|---|---|")
  for label, value, target, met in checks:
    shown = f"{100 * value:.1f}%" if "%" in target else f"{value:.2f}x"
    print(f"| {label} | {shown} | {target} | {'yes' if met else 'NO'} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
