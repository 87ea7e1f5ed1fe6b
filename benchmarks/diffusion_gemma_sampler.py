"""DiffusionGemma sampler overhead: a sampler step vs the raw decoder call.

One process, one DiffusionGemma with random weights (float32), a prompt
prefilled into the cache; then, side by side in one run:

* `decoder`: a jitted `lax.fori_loop` of N raw `decode` calls on one canvas
  (each call's logits feed the next as self-conditioning, so none is
  dropped), i.e. what the sampler must pay per step at least;
* `sampler`: `entropy_bound.denoise_canvas` over the same decoder, N steps
  (the adaptive stop is disabled with a tiny confidence threshold, so every
  step runs): the decoder plus temperature, sampling, entropies, the sort of
  the entropy bound, renoising, the stop test and the bookkeeping.

Overhead = sampler time per step / decoder time per call - 1 (target <= 10%).
Each program is compiled by a warm-up call and timed over `--repeats` calls;
medians are reported. Two sizes: the tiny recipe's model, and a wider one
(vocabulary 8192) where the sampler's per-vocabulary work is larger.

    python benchmarks/diffusion_gemma_sampler.py
    tunix-blockdiff bench diffusion_gemma_sampler --repeats 3
    python benchmarks/diffusion_gemma_sampler.py --draw-only 2 256 65536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound

SIZES = {
    "tiny_recipe": dict(vocab_size=50, hidden_size=128, intermediate_size=256,
                        num_heads=4, num_kv_heads=2, head_dim=32,
                        global_num_kv_heads=1, global_head_dim=32,
                        sliding_window=16, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=64, canvas_length=8),
    "wide": dict(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                 num_heads=4, num_kv_heads=2, head_dim=64,
                 global_num_kv_heads=1, global_head_dim=64,
                 sliding_window=64, num_experts=8, top_k_experts=2,
                 moe_intermediate_size=256, canvas_length=32),
}
LAYERS = ("sliding_attention", "sliding_attention", "full_attention")
# DiffusionGemma-26B-A4B's real layer widths (Tunix's `gemma4_26b_a4b`:
# hidden 2816, 16 heads of 256, 8 / 2 KV heads, global head 512, 128 experts
# of 704, top-8, window 1024, vocabulary 262,144) at 2 layers, one sliding
# and one full: what one TPU chip holds. Not in the default `--sizes`.
REAL_WIDTHS = {
    "26b_a4b_2layers": (
        dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112,
             num_heads=16, num_kv_heads=8, head_dim=256,
             global_num_kv_heads=2, global_head_dim=512,
             sliding_window=1024, num_experts=128, top_k_experts=8,
             moe_intermediate_size=704, canvas_length=256),
        ("sliding_attention", "full_attention")),
}


def config_of(name: str, dtype: str = "float32") -> dg.DiffusionGemmaConfig:
  """The `DiffusionGemmaConfig` of a size name (`SIZES` or `REAL_WIDTHS`)."""
  if name in REAL_WIDTHS:
    sizes, layers = REAL_WIDTHS[name]
  else:
    sizes, layers = SIZES[name], LAYERS
  return dg.DiffusionGemmaConfig(layer_types=layers, dtype=dtype,
                                 param_dtype=dtype, **sizes)


def _median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(name: str, *, batch: int, prompt: int, steps: int,
            repeats: int, dtype: str = "float32") -> dict:
  config = config_of(name, dtype)
  model = dg.DiffusionGemma(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  c, v = config.canvas_length, config.vocab_size
  cache = model.init_cache(batch, prompt + c)
  tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 0, v)
  positions = jnp.broadcast_to(jnp.arange(prompt), (batch, prompt))
  _, cache = jax.jit(lambda s, t, p, k: nnx.merge(graphdef, s).encode(
      t, p, jnp.ones(t.shape, bool), k))(state, tokens, positions, cache)
  canvas_pos = jnp.broadcast_to(prompt + jnp.arange(c), (batch, c))
  sampler_cfg = dg.SamplerConfig(max_denoising_steps=steps,
                                 confidence_threshold=1e-30)

  def decoder_fn(s):
    m = nnx.merge(graphdef, s)

    def call(canvas, sc_logits, sc_on):
      return m.decode(canvas, canvas_pos, cache, sc_logits, sc_on)

    return call

  @jax.jit
  def raw(s, key):
    call = decoder_fn(s)
    canvas = jax.random.randint(key, (batch, c), 0, v)

    def body(i, sc):
      return call(canvas, sc, jnp.broadcast_to(i > 0, (batch,)))

    return jax.lax.fori_loop(0, steps, body,
                             jnp.zeros((batch, c, v), jnp.float32))

  @jax.jit
  def sample(s, key):
    return entropy_bound.denoise_canvas(decoder_fn(s), key, batch, c, v,
                                        sampler_cfg).tokens

  key = jax.random.key(2)
  raw_s = _median_seconds(lambda: raw(state, key), repeats)
  sample_s = _median_seconds(lambda: sample(state, key), repeats)
  return dict(
      size=name, batch=batch, canvas=c, vocab=v, prompt=prompt, steps=steps,
      decoder_ms_per_call=1e3 * raw_s / steps,
      sampler_ms_per_step=1e3 * sample_s / steps,
      overhead=sample_s / raw_s - 1.0,
  )


def stored_log_softmax_draw(key, logits):
  """The draw as it was: a stored log-softmax, its exponent, a separate
  argmax (`--draw-only`'s reference for `sample_with_entropy`)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  probs = jnp.exp(logp)
  entropy = -jnp.sum(probs * logp, axis=-1)
  u = jax.random.uniform(key, logits.shape[:-1], jnp.float32)
  return (entropy_bound.inverse_cdf(probs, u), entropy,
          entropy_bound.first_argmax(logits))


def stored_exponent_draw(key, logits):
  """The draw of 6270a44: one max and a stored `e = exp(z - max)` read by
  the entropy, the draw and a full-vocabulary sum (`--draw-only`'s second
  reference)."""
  z = logits.astype(jnp.float32)
  top = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.exp(z - top)
  total = jnp.sum(e, axis=-1)
  mean_z = jnp.sum(jnp.where(e > 0, e * z, 0.0), axis=-1) / total
  u = jax.random.uniform(key, z.shape[:-1], jnp.float32)
  return (entropy_bound.inverse_cdf(e, u), jnp.log(total) + top[..., 0] - mean_z,
          entropy_bound.first_argmax(z, top))


def measure_draw(batch: int, canvas: int, vocab: int, repeats: int) -> dict:
  """One step's draw alone (`sample_with_entropy`) against the earlier
  versions (a stored log-softmax; a stored exponent), on [batch, canvas,
  vocab] random logits, interleaved in one process."""
  logits = 3.0 * jax.random.normal(jax.random.key(1), (batch, canvas, vocab))
  key = jax.random.key(0)
  programs = {"sample_with_entropy": jax.jit(entropy_bound.sample_with_entropy),
              "stored exponent": jax.jit(stored_exponent_draw),
              "stored log-softmax": jax.jit(stored_log_softmax_draw)}
  times = {name: [] for name in programs}
  for program in programs.values():
    jax.block_until_ready(program(key, logits))  # compile
  for _ in range(repeats):
    for name, program in programs.items():
      start = time.perf_counter()
      jax.block_until_ready(program(key, logits))
      times[name].append(time.perf_counter() - start)
  ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
  return dict(batch=batch, canvas=canvas, vocab=vocab, ms=ms,
              speedup=ms["stored log-softmax"] / ms["sample_with_entropy"],
              speedup_exponent=ms["stored exponent"]
              / ms["sample_with_entropy"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--sizes", nargs="+", default=list(SIZES),
                      choices=[*SIZES, *REAL_WIDTHS])
  parser.add_argument("--dtype", default="float32",
                      choices=("float32", "bfloat16"))
  parser.add_argument("--out", default=None, help="write the rows as JSON")
  parser.add_argument("--draw-only", type=int, nargs=3, default=None,
                      metavar=("B", "C", "V"),
                      help="time one step's draw alone at [B, C, V] against"
                      " the earlier versions (stored exponent, log-softmax)")
  args = parser.parse_args()
  if args.draw_only:
    r = measure_draw(*args.draw_only, repeats=args.repeats)
    print(f"draw at [{r['batch']}, {r['canvas']}, {r['vocab']}]: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in r["ms"].items())
          + f"; {r['speedup_exponent']:.2f}x the stored exponent,"
          f" {r['speedup']:.2f}x the stored log-softmax")
    return
  rows = [measure(name, batch=args.batch, prompt=args.prompt,
                  steps=args.steps, repeats=args.repeats, dtype=args.dtype)
          for name in args.sizes]
  print(f"{'size':12s} {'B':>3s} {'C':>4s} {'V':>6s} {'decoder ms':>11s}"
        f" {'sampler ms':>11s} {'overhead':>9s}")
  for r in rows:
    print(f"{r['size']:12s} {r['batch']:3d} {r['canvas']:4d} {r['vocab']:6d}"
          f" {r['decoder_ms_per_call']:11.2f} {r['sampler_ms_per_step']:11.2f}"
          f" {100 * r['overhead']:8.1f}%")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
