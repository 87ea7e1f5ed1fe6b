"""Generation at real sizes: the cached `generate` against Tunix's `Sampler`.

For accelerators (and, with `--model tiny`, any CPU): one model with random
weights, left-padded prompts of lengths drawn in [P/4 + 1, P], N new tokens,
and at every batch size, side by side in one process:

* `tunix Sampler`: Tunix's autoregressive `Sampler` (greedy, its KV cache),
  one token per model call;
* `generate`: `tunix_blockdiff.generate` (the exact block-KV-cached driver)
  under static schedules (`b4s1`: block 4, one step per block; `b16s4`:
  block 16, four steps) and threshold decoding (`b4t0.9`);
* `raw call`: a jitted loop of the driver's model call on one window
  (`window_attention.window_call`, W slots, and 2W where a finished block is
  computed in the same call) against a full cache, without the transition:
  the cost a step of `generate` is measured against; and `write`, a fused
  step's cache write alone (one block per row into every layer's cache).
* `--cache-phases 1,4`: each schedule also with its loop in 4 phases, each
  reading only the prefix of the cache its steps use
  (`generate(cache_phases=)`).
* `--lockstep 0,1`: each also with the rows starting their blocks together
  (`generate(lockstep=)`), so a 2W-wide step comes once per block round.
* `--ragged-cache 0,1`: each also reading the cache with the Pallas kernel
  that fetches only the slots in use (`generate(ragged_cache=)`; interpret
  mode, so slow, off a TPU).
* `--fused-head 0,1`: each also taking the greedy proposals from the Pallas
  kernel that runs the head a vocabulary tile at a time, never writing the
  logits (`generate(fused_head=)`); the row's `agree` is the share of its
  tokens equal to the same program's without it.
* `--one-program 0,1`: each loop in more than one phase also as one program
  holding every phase, instead of one program per stage
  (`generate(one_program=)`).

Each program is compiled by a warm-up call and timed as the median of
`--repeats` calls. The table gives the whole call, the prefill, the model
calls, milliseconds per call (whole time minus prefill, over the calls),
tokens/s, the speed-up over the `Sampler` (same tokens), and the **floor**
of a call: the larger of (weights + the KV cache in use) / HBM bandwidth and
the FLOPs the call must do / peak (the window's tokens, the finished block's
once per block, attention over the cache in use; logits for the window
only). `--hbm-gbps` and `--peak-tflops` default to a TPU v5e chip (819 GB/s,
197 TFLOP/s bf16).

    python benchmarks/generation.py --model qwen3_0p6b --dtype bfloat16 \\
        --batch 1,32,128                       # the TPU table (docs)
    python benchmarks/generation.py --model tiny --batch 2 --new-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import kv_cache
from tunix_blockdiff.rollout import window_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rollout import IdTokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position

SCHEDULES = {
    "b4s1": dict(block_size=4, steps_per_block=1),
    "b16s4": dict(block_size=16, steps_per_block=4),
    "b4t0.9": dict(block_size=4, threshold=0.9),
}


def build_model(name: str, dtype: str):
  """(model, its ModelConfig): `qwen3_0p6b` (Tunix's config) or `tiny`."""
  dtype = jnp.dtype(dtype)
  if name == "qwen3_0p6b":
    config = dataclasses.replace(
        qwen3_lib.ModelConfig.qwen3_0p6b(), dtype=dtype, param_dtype=dtype
    )
    return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0)), config
  if name == "tiny":
    config = dataclasses.replace(
        tiny_models.qwen3_config(512, num_layers=2, embed_dim=64,
                                 hidden_dim=128, num_heads=4, head_dim=16,
                                 num_kv_heads=2),
        dtype=dtype, param_dtype=dtype,
    )
    return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0)), config
  raise ValueError(f"--model must be qwen3_0p6b or tiny, got {name!r}")


def prompts(batch: int, width: int, vocab: int, seed: int = 0):
  """Left-padded random prompts, lengths drawn in [width // 4 + 1, width]."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(width // 4 + 1, width + 1, size=batch).astype(np.int32)
  tokens = np.zeros((batch, width), np.int32)
  for b, n in enumerate(lengths):
    tokens[b, width - n:] = rng.integers(10, vocab - 10, size=n)
  return tokens, lengths


def median_seconds(run: Callable[[], Any], repeats: int) -> tuple[Any, float]:
  """(output of the warm-up call, median seconds of `repeats` calls)."""
  out = jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return out, statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What a floor needs to know about the model."""

  params: int
  embed_params: int
  param_bytes: int
  kv_bytes_per_token: int
  layers: int
  heads: int
  head_dim: int

  @classmethod
  def of(cls, model, config) -> "Sizes":
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    embed = config.vocab_size * config.embed_dim
    itemsize = jnp.dtype(config.dtype).itemsize
    return cls(
        params=int(sum(x.size for x in leaves)),
        embed_params=embed,
        param_bytes=int(sum(x.size * x.dtype.itemsize for x in leaves)),
        kv_bytes_per_token=(2 * config.num_layers * config.num_kv_heads
                            * config.head_dim * itemsize),
        layers=config.num_layers,
        heads=config.num_heads,
        head_dim=config.head_dim,
    )

  def call_floor(self, *, tokens: float, logit_tokens: float,
                 kv_tokens: float, rows: int, hbm: float,
                 peak: float) -> float:
    """Seconds: max(bytes / bandwidth, FLOPs / peak) of one model call.

    Args:
      tokens: Slots the call runs through the layers (all rows).
      logit_tokens: Slots whose logits it needs.
      kv_tokens: Cached tokens in use (all rows), read by attention.
      rows: Batch size (each query attends to its own row's cache).
      hbm: Bytes per second.
      peak: FLOP per second.
    """
    body = self.params - self.embed_params
    attention = (4 * self.layers * self.heads * self.head_dim
                 * (kv_tokens / rows) * tokens)
    flops = (2 * body * tokens + 2 * self.embed_params * logit_tokens
             + attention)
    data = self.param_bytes + self.kv_bytes_per_token * kv_tokens
    return max(data / hbm, flops / peak)


def raw_call_seconds(model, batch: int, cache_len: int, width: int,
                     calls: int, repeats: int) -> float:
  """Seconds of one window call as the driver makes it (a loop of them).

  `window_attention.window_call` on `width` slots against a full cache of
  `cache_len` slots, without the transition or the cache writes: what a
  step of `generate` costs at least.
  """
  graphdef, state = nnx.split(model)
  dtype = kv_cache.activation_dtype(model)
  tokens = jnp.full((batch, width), 7, jnp.int32)
  positions = jnp.broadcast_to(cache_len + jnp.arange(width), (batch, width))
  # The cache's whole chunks; the slots past `cache_len` hold no keys.
  slots = window_attention.chunked_size(cache_len)
  valid = jnp.broadcast_to(jnp.arange(slots) < cache_len, (batch, slots))
  mask = jnp.ones((batch, width, width), bool)

  @jax.jit
  def loop(state):
    m = nnx.merge(graphdef, state)
    cache = window_attention.init_cache(m, batch, cache_len, dtype)

    def body(i, acc):
      logits, _, _ = window_attention.window_call(
          m, tokens + i, positions, [(cache, valid)], mask)
      return acc + logits[:, 0, 0]

    return jax.lax.fori_loop(0, calls, body, jnp.zeros((batch,), jnp.float32))

  _, seconds = median_seconds(lambda: loop(state), repeats)
  return seconds / calls


def write_seconds(model, batch: int, cache_len: int, block: int,
                  calls: int, repeats: int) -> float:
  """Seconds of one fused step's cache write: a block per row, all layers.

  The rows in phase, as the driver's are under one step per block: one
  shared start (rows out of phase cost one such update per distinct start).
  """
  dtype = kv_cache.activation_dtype(model)
  graphdef, state = nnx.split(model)

  @jax.jit
  def loop(state):
    m = nnx.merge(graphdef, state)
    cache = window_attention.init_cache(m, batch, cache_len, dtype)
    fresh = window_attention.init_block(m, batch, block, dtype)
    rows = jnp.ones((batch,), bool)

    def body(i, cache):
      start = jnp.full((batch,), i % (cache_len // block) * block, jnp.int32)
      # Blocks that change every call, as a step's do (a constant block
      # lets XLA lower the write differently from the driver's).
      step = i.astype(dtype)
      block_i = window_attention.Cache(fresh.k + step, fresh.v - step)
      return window_attention.write_blocks(cache, block_i, start, rows,
                                           start_step=block)

    cache = jax.lax.fori_loop(0, calls, body, cache)
    return cache.k[0, :, 0, 0, 0]

  _, seconds = median_seconds(lambda: loop(state), repeats)
  return seconds / calls


def prefill_seconds(model, tokens, block: int, repeats: int) -> float:
  """The cached driver's prefill alone: the prompt's complete blocks."""
  batch, width = tokens.shape
  length = (width // block) * block
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, tokens):
    m = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = jnp.ones((batch, length, length), bool)
    logits, keys, values = window_attention.window_call(
        m, tokens[:, :length], positions, [], mask)
    cache = window_attention.cache_from_block(
        window_attention.as_block(keys, values, length), length + 4 * block)
    return logits[:, -1, 0], cache.k[0, :, 0, 0, 0]

  return median_seconds(lambda: prefill(state, tokens), repeats)[1]


def measure_batch(model, config, sizes: Sizes, args, batch: int) -> list[dict]:
  """Every program at one batch size; one row each."""
  vocab, new, width = config.vocab_size, args.new_tokens, args.prompt_width
  mask_id = vocab - 1
  tokens, lengths = prompts(batch, width, vocab, seed=batch)
  hbm, peak = args.hbm_gbps * 1e9, args.peak_tflops * 1e12
  kv_in_use = float(np.sum(lengths) + batch * new / 2)
  rows = []

  tokenizer = IdTokenizer(eos=mask_id)
  sampler = sampler_lib.Sampler(
      model, tokenizer,
      sampler_lib.CacheConfig(cache_size=width + new + 8,
                              num_layers=config.num_layers,
                              num_kv_heads=config.num_kv_heads,
                              head_dim=config.head_dim))
  texts = [tokenizer.decode(t[width - n:]) for t, n in zip(tokens, lengths)]

  def ar(steps):
    return lambda: sampler(texts, max_generation_steps=steps,
                           max_prompt_length=width, eos_tokens=[mask_id],
                           forbidden_tokens=[mask_id]).tokens

  _, ar_total = median_seconds(ar(new), args.repeats)
  _, ar_prefill = median_seconds(ar(1), args.repeats)
  ar_call = (ar_total - ar_prefill) / (new - 1)
  rows.append(dict(
      batch=batch, program="tunix Sampler", schedule="greedy",
      seconds=ar_total, prefill_s=ar_prefill, calls=new,
      ms_per_call=1e3 * ar_call, tokens_per_call=1.0,
      tokens_per_s=batch * new / ar_total, speedup=1.0,
      floor_ms=1e3 * sizes.call_floor(tokens=batch, logit_tokens=batch,
                                      kv_tokens=kv_in_use, rows=batch, hbm=hbm,
                                      peak=peak)))
  _progress(rows[-1])

  plain_tokens = {}
  for name, phases, lockstep, ragged, fused, one in [
      (n, p, lock, r, f, o) for n in args.schedules for p in args.cache_phases
      for lock in args.lockstep for r in args.ragged_cache
      for f in args.fused_head for o in args.one_program
      if p > 1 or not o]:  # one phase is one program already
    schedule = SCHEDULES[name]
    block = schedule["block_size"]
    denoise_config = config_lib.DenoiseConfig(mask_token_id=mask_id, **schedule)
    run = lambda c=denoise_config: cached.generate(
        model, tokens, lengths, c, max_new_tokens=new, cache_phases=phases,
        lockstep=lockstep, ragged_cache=ragged, fused_head=fused,
        one_program=one)
    start = time.perf_counter()
    # The first call: tracing and compiling; its result is the row's.
    result = jax.block_until_ready(run())
    first_s = time.perf_counter() - start
    _, total = median_seconds(lambda: run().tokens, args.repeats)
    same = (name, phases, lockstep, ragged, one)
    if not fused:
      plain_tokens[same] = np.asarray(result.tokens)
    agree = {}
    if fused and same in plain_tokens:
      agree["agree"] = float(np.mean(np.asarray(result.tokens)
                                     == plain_tokens[same]))
    calls = int(result.num_steps)
    prefill = prefill_seconds(model, tokens, block, args.repeats)
    call = (total - prefill) / calls
    blocks = -(-(width + new) // block)
    # Slots through the layers per call: the window, plus each finished
    # block once (written by the next block's first call).
    slots = batch * block * (calls + blocks) / calls
    floor = sizes.call_floor(tokens=slots, logit_tokens=batch * block,
                             kv_tokens=kv_in_use, rows=batch, hbm=hbm, peak=peak)
    raw = {}
    if args.raw_calls:
      cache_len = blocks * block
      raw = dict(
          raw_call_ms_w=1e3 * raw_call_seconds(
              model, batch, cache_len, block, args.raw_calls, args.repeats),
          raw_call_ms_2w=1e3 * raw_call_seconds(
              model, batch, cache_len, 2 * block, args.raw_calls,
              args.repeats),
          write_ms=1e3 * write_seconds(
              model, batch, cache_len, block, args.raw_calls, args.repeats))
    rows.append(dict(
        batch=batch,
        program="generate" + (f", {phases} cache phases" if phases > 1 else "")
        + (", lockstep" if lockstep else "")
        + (", ragged cache" if ragged else "")
        + (", fused head" if fused else "")
        + (", one program" if one else ""),
        schedule=name, seconds=total,
        prefill_s=prefill, calls=calls, ms_per_call=1e3 * call,
        tokens_per_call=new / calls, tokens_per_s=batch * new / total,
        speedup=ar_total / total, floor_ms=1e3 * floor, first_call_s=first_s,
        **raw, **agree))
    _progress(rows[-1])
  return rows


def _progress(row: dict) -> None:
  """Prints a row as soon as it is measured (a run cut short keeps it)."""
  first = (f" first call (compiling) {row['first_call_s']:.1f} s"
           if "first_call_s" in row else "")
  print(format_table([row]).splitlines()[-1] + first, flush=True)


def format_table(rows: list[dict]) -> str:
  lines = [
      "| batch | program | schedule | s | prefill ms | calls | ms/call |"
      " raw call ms (W / 2W) | write ms | floor ms | x floor | tokens/s |"
      " speed-up |",
      "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    raw = (f"{r['raw_call_ms_w']:.2f} / {r['raw_call_ms_2w']:.2f}"
           if "raw_call_ms_w" in r else "-")
    write = f"{r['write_ms']:.2f}" if "write_ms" in r else "-"
    agree = (f" ({100 * r['agree']:.1f}% same tokens)" if "agree" in r
             else "")
    lines.append(
        f"| {r['batch']} | {r['program']}{agree} | {r['schedule']} |"
        f" {r['seconds']:.3f} | {1e3 * r['prefill_s']:.1f} | {r['calls']} |"
        f" {r['ms_per_call']:.2f} | {raw} | {write} | {r['floor_ms']:.2f} |"
        f" {r['ms_per_call'] / r['floor_ms']:.2f} |"
        f" {r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny",
                      choices=("tiny", "qwen3_0p6b"))
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--batch", default="1,32")
  parser.add_argument("--prompt-width", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--schedules", default=",".join(SCHEDULES))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cache-phases", default="1",
                      help="comma-separated `generate(cache_phases=)` values,"
                      " each timed per schedule (e.g. 1,4)")
  parser.add_argument("--raw-calls", type=int, default=16,
                      help="window calls per raw-call timing (0: skip it)")
  parser.add_argument("--hbm-gbps", type=float, default=819.0)
  parser.add_argument("--peak-tflops", type=float, default=197.0)
  parser.add_argument("--lockstep", default="0",
                      help="comma-separated 0/1: `generate(lockstep=)`, each"
                      " timed")
  parser.add_argument("--ragged-cache", default="0",
                      help="comma-separated 0/1: `generate(ragged_cache=)`,"
                      " each timed")
  parser.add_argument("--fused-head", default="0",
                      help="comma-separated 0/1: `generate(fused_head=)`,"
                      " each timed")
  parser.add_argument("--one-program", default="0",
                      help="comma-separated 0/1: `generate(one_program=)`,"
                      " each timed (with --cache-phases > 1 only)")
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)
  args.schedules = args.schedules.split(",")
  for name in args.schedules:
    if name not in SCHEDULES:
      parser.error(f"--schedules: {name!r} is not one of {list(SCHEDULES)}")
  try:
    args.cache_phases = [int(p) for p in args.cache_phases.split(",")]
  except ValueError:
    parser.error(f"--cache-phases: integers, got {args.cache_phases!r}")
  if min(args.cache_phases) < 1:
    parser.error(f"--cache-phases: each >= 1, got {args.cache_phases}")
  for flag in ("lockstep", "ragged_cache", "fused_head", "one_program"):
    values = getattr(args, flag).split(",")
    if set(values) - {"0", "1"}:
      parser.error(f"--{flag.replace('_', '-')}: 0 or 1 (comma-separated),"
                   f" got {getattr(args, flag)!r}")
    setattr(args, flag, [x == "1" for x in values])
  if all(args.one_program) and max(args.cache_phases) == 1:
    parser.error("--one-program 1: needs a --cache-phases value > 1 (one"
                 " phase is one program already)")
  model, config = build_model(args.model, args.dtype)
  sizes = Sizes.of(model, config)
  rows = []
  for batch in (int(b) for b in args.batch.split(",")):
    rows.extend(measure_batch(model, config, sizes, args, batch))
    if args.json:  # after every batch, so that a run cut short keeps them
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
  print(f"\n{args.model} ({sizes.params / 1e6:.0f}M parameters, {args.dtype}),"
        f" prompts left-padded to {args.prompt_width},"
        f" {args.new_tokens} new tokens, median of {args.repeats},"
        f" {jax.devices()[0].device_kind}; floor at {args.hbm_gbps:g} GB/s,"
        f" {args.peak_tflops:g} TFLOP/s\n")
  print(format_table(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
