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
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import tiny_models
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


def _median_seconds(fn, repeats: int):
  jax.block_until_ready(fn())  # compile and warm up
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def _prompts(batch: int, max_prompt: int, vocab: int, seed: int):
  """Left-padded prompts of distinct lengths in (max_prompt/4, max_prompt]."""
  rs = np.random.RandomState(seed)
  lengths = np.linspace(max_prompt, max(1, max_prompt // 4 + 1), batch).astype(int)
  lengths = np.maximum(lengths - np.arange(batch) % 2, 1)  # mix even and odd
  tokens = np.zeros((batch, max_prompt), np.int32)
  for b, length in enumerate(lengths):
    tokens[b, max_prompt - length :] = rs.randint(1, vocab - 1, size=length)
  return tokens, lengths.astype(np.int32)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
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
      vocab, num_layers=NUM_LAYERS, embed_dim=EMBED, hidden_dim=HIDDEN,
      num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS,
  )
  prompts, lengths = _prompts(args.batch, args.max_prompt, vocab, seed=0)
  tokens_out = args.batch * new
  modes = {
      "static (4 tok/step)": config_lib.DenoiseConfig(
          block_size=block, mask_token_id=mask, steps_per_block=max(1, block // 4)
      ),
      f"threshold {args.threshold}": config_lib.DenoiseConfig(
          block_size=block, mask_token_id=mask, threshold=args.threshold
      ),
  }

  rows = []  # (program, mode, seconds, model calls, tokens per call)
  steps_of = {}
  for mode, config in modes.items():
    for use_cache in (True, False):
      if not use_cache and args.skip_cacheless:
        continue
      name = "cached" if use_cache else "cacheless"
      seconds, result = _median_seconds(
          lambda: cached.generate(
              model, prompts, lengths, config, max_new_tokens=new,
              use_cache=use_cache,
          ),
          args.repeats,
      )
      steps = int(result.num_steps)
      steps_of[(name, mode)] = (seconds, steps)
      rows.append((name, mode, seconds, steps, tokens_out / steps / args.batch))
      print(f"  measured {name:9s} {mode}: {seconds:.3f} s, {steps} steps", flush=True)

  # Tunix's autoregressive sampler on the same model and prompts (greedy). The
  # mask id doubles as its EOS and is forbidden, so every row decodes `new`.
  tokenizer = IdTokenizer(eos=mask)
  sampler = sampler_lib.Sampler(
      model,
      tokenizer,
      sampler_lib.CacheConfig(
          cache_size=args.max_prompt + new + 8, num_layers=NUM_LAYERS,
          num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
      ),
  )
  texts = [
      tokenizer.decode(p[args.max_prompt - n :]) for p, n in zip(prompts, lengths)
  ]
  seconds, out = _median_seconds(
      lambda: sampler(
          texts, max_generation_steps=new, max_prompt_length=args.max_prompt,
          eos_tokens=[mask], forbidden_tokens=[mask],
      ).tokens,
      args.repeats,
  )
  generated = max(len(t) for t in out)
  rows.append(("tunix AR Sampler", "greedy", seconds, generated, 1.0))
  ar_seconds = seconds
  print(f"  measured tunix AR: {seconds:.3f} s, {generated} tokens/row", flush=True)

  # The transition program alone: denoise over precomputed logits.
  static = modes["static (4 tok/step)"]
  tokens, positions, validity, completion = cached._sequence_layout(
      prompts, lengths, np.zeros((args.batch, new), np.int32)
  )
  logits = jax.random.normal(
      jax.random.key(1), tokens.shape + (vocab,), jnp.float32
  ) * 3.0
  transition = jax.jit(
      lambda t, p, c, v, lg: denoise_lib.denoise(
          lambda *_: lg, t, p, c, v, static
      )
  )
  seconds, result = _median_seconds(
      lambda: transition(tokens, positions, completion, validity, logits),
      args.repeats,
  )
  transition_steps = int(result.num_steps)
  rows.append(
      ("transition only", "static, precomputed logits", seconds, transition_steps,
       tokens_out / transition_steps / args.batch)
  )

  print()
  print(
      f"Tiny Qwen3 ({NUM_LAYERS} layers, width {EMBED}, vocab {vocab}), batch"
      f" {args.batch}, prompt lengths {lengths.tolist()}, {new} new tokens,"
      f" block {block}, {args.repeats} repeats, {jax.devices()[0].platform.upper()}"
  )
  print()
  print("| program | mode | median s | tokens/s | model calls | ms/call | tokens/call/row |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for name, mode, seconds, calls, per_call in rows:
    print(
        f"| {name} | {mode} | {seconds:.3f} | {tokens_out / seconds:,.0f} |"
        f" {calls} | {1000 * seconds / calls:.2f} | {per_call:.2f} |"
    )

  print()
  static_name = "static (4 tok/step)"
  cached_static, cached_static_steps = steps_of[("cached", static_name)]
  checks = []
  for mode in modes:
    if ("cacheless", mode) in steps_of:
      ratio = steps_of[("cacheless", mode)][0] / steps_of[("cached", mode)][0]
      checks.append((f"cached vs cacheless, {mode}", ratio, ">= 4x", ratio >= 4))
  ratio = ar_seconds / cached_static
  checks.append(("cached (4 tok/step) vs Tunix AR Sampler", ratio, ">= 1.5x", ratio >= 1.5))
  overhead = (seconds / transition_steps) / (cached_static / cached_static_steps)
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
