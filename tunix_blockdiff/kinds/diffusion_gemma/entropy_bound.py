"""DiffusionGemma's entropy-bound sampler: the step functions and one canvas.

A canvas of C slots starts uniform-random. Each step n (counting down from
N to 1) runs the decoder on the canvas (self-conditioned on the previous
step's temperature-scaled logits), and:

1. scales the logits by `1 / T(n)`, `T(n) = t_min + (t_max - t_min) n / N`;
2. samples a denoiser canvas from them and takes their argmax;
3. accepts the lowest-entropy slots while the sum of the accepted entropies
   minus the largest of them stays <= `entropy_bound` (`accept_mask`);
4. renoises every other slot with a uniform token (`renoise`);
5. stops the row once its argmax canvas equals each of the previous S
   steps' and its mean entropy is below `confidence_threshold`
   (`stop_update`); a stopped row keeps its canvas, argmax and logits.

The canvas's result is the last argmax. All functions are pure and
`jax.jit`-able; `denoise_canvas` takes any `decoder_fn(canvas, sc_logits,
sc_on) -> logits`, so it is independent of the model.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tunix_blockdiff.models.diffusion_gemma import config as config_lib

DecoderFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def token_entropy(logits: jax.Array) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis, float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def first_argmax(x: jax.Array, top: jax.Array | None = None) -> jax.Array:
  """`jnp.argmax(x, -1)` (ties: the lowest index), as max + min-index.

  Two plain reductions instead of XLA's variadic argmax reduce, which is
  several times slower on CPU over a large vocabulary. `top`: `x`'s max
  over the last axis (keepdims), where the caller already has it.
  """
  if top is None:
    top = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(x >= top, iota, x.shape[-1]), axis=-1)


_CDF_BLOCK = 128


def _blocks(x: jax.Array, fill: float) -> jax.Array:
  """`x` [..., V] as [..., ceil(V / 128), 128], the tail padded with `fill`."""
  pad = (-x.shape[-1]) % _CDF_BLOCK
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
  return x.reshape(x.shape[:-1] + (-1, _CDF_BLOCK))


def _draw(block_sums: jax.Array, inner_of, u: jax.Array) -> jax.Array:
  """The inverse-CDF draw from per-block masses and one block's entries.

  Args:
    block_sums: float [..., nb] each block's (unnormalised) mass.
    inner_of: int32 [...] chosen block -> float [..., 128] its entries.
    u: float [...] uniforms in [0, 1).
  """
  block_cdf = jnp.cumsum(block_sums, axis=-1)
  total = block_cdf[..., -1]
  # Strictly below the total, so the first block whose cdf exceeds it has
  # mass; likewise inside the block (its own cdf, not the outer one, so
  # rounding can never land on a zero-probability index).
  target = jnp.minimum(u * total, total * (1.0 - 1e-6))
  block = jnp.sum(block_cdf <= target[..., None], axis=-1)
  before = jnp.take_along_axis(block_cdf - block_sums, block[..., None],
                               axis=-1)[..., 0]
  inner_cdf = jnp.cumsum(inner_of(block), axis=-1)
  rest = jnp.clip(target - before, 0.0, inner_cdf[..., -1] * (1.0 - 1e-6))
  j = jnp.sum(inner_cdf <= rest[..., None], axis=-1)
  return (block * _CDF_BLOCK + j).astype(jnp.int32)


def _block_of(blocks: jax.Array, block: jax.Array) -> jax.Array:
  """blocks[..., block, :] per leading index: [..., 128]."""
  return jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[
      ..., 0, :]


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
  """The first index whose cumulative probability exceeds `u * total`.

  Two levels (blocks of 128, then within the chosen block), so the work is
  one pass over the vocabulary plus two short cumulative sums.

  Args:
    probs: float [..., V] non-negative.
    u: float [...] uniforms in [0, 1).

  Returns:
    int32 [...] sampled indices.
  """
  blocks = _blocks(probs, 0.0)
  return _draw(jnp.sum(blocks, axis=-1),
               lambda block: _block_of(blocks, block), u)


def sample_with_entropy(key: jax.Array, logits: jax.Array):
  """One categorical draw per slot, its distribution's entropy, the argmax.

  Inverse-CDF sampling (`inverse_cdf`): one uniform per slot against the
  cumulative probabilities (an exact categorical draw, with one random
  number per slot instead of Gumbel-max's one per vocabulary entry). One
  max and the unnormalised `e = exp(z - max)` serve all three, and `e` is
  never stored: one pass over the logits gives each 128-entry block's
  `sum e` and `sum e z` (the draw's block masses, and the entropy `log sum e
  + max - sum(e z) / sum e`), the draw recomputes `e` of its one chosen
  block, and the argmax is the first index at the max. So the sampler reads
  the [B, C, V] logits three times (max, block sums, argmax) and writes
  nothing of that size (`benchmarks/diffusion_gemma_sampler.py --draw-only`
  compares it with the earlier versions).

  Args:
    key: PRNG key.
    logits: float [B, C, V] (already temperature-scaled).

  Returns:
    (tokens int32 [B, C], entropy float32 [B, C], argmax int32 [B, C]).
  """
  z = logits.astype(jnp.float32)
  top = jnp.max(z, axis=-1, keepdims=True)
  z_blocks = _blocks(z, -jnp.inf)
  e = jnp.exp(z_blocks - top[..., None])
  block_sums = jnp.sum(e, axis=-1)
  # `-inf` logits (e = 0) add nothing, rather than 0 * -inf.
  block_ez = jnp.sum(jnp.where(e > 0, e * z_blocks, 0.0), axis=-1)
  total = jnp.sum(block_sums, axis=-1)
  entropy = jnp.log(total) + top[..., 0] - jnp.sum(block_ez, axis=-1) / total
  u = jax.random.uniform(key, z.shape[:-1], jnp.float32)
  tokens = _draw(block_sums,
                 lambda block: jnp.exp(_block_of(z_blocks, block) - top), u)
  return tokens, entropy, first_argmax(z, top)


def temperature(steps_left: jax.Array, config: config_lib.SamplerConfig):
  """T(n) of the step with `steps_left` = n steps left (N .. 1)."""
  frac = steps_left / config.max_denoising_steps
  return config.t_min + (config.t_max - config.t_min) * frac


def accept_mask(entropy: jax.Array, bound: float) -> jax.Array:
  """Entropy-bound acceptance, bool [B, C].

  In ascending entropy order, slot r is accepted iff the sum of the entropies
  before it is <= `bound` (equivalently, cumsum - max over the first r+1 <=
  bound). The lowest-entropy slot is always accepted.

  Args:
    entropy: float [B, C].
    bound: The entropy bound gamma (> 0).
  """
  order = jnp.argsort(entropy, axis=-1, stable=True)
  ranked = jnp.take_along_axis(entropy, order, axis=-1)
  before = jnp.cumsum(ranked, axis=-1) - ranked
  keep = before <= bound
  rows = jnp.arange(entropy.shape[0])[:, None]
  return jnp.zeros(entropy.shape, bool).at[rows, order].set(keep)


def renoise(accepted: jax.Array, mask: jax.Array, noise: jax.Array):
  """The next canvas: accepted slots kept, the others from `noise`."""
  return jnp.where(mask, accepted, noise)


def step_logprob(scaled: jax.Array, denoiser: jax.Array,
                 accepted: jax.Array) -> jax.Array:
  """log P of one step's renoised canvas given its input, float32 [B].

  The accepted slots' denoiser tokens under softmax(scaled), plus log(1/V)
  per renoised slot (`kinds.diffusion_gemma.likelihood` derives it).

  Args:
    scaled: float [B, C, V] the step's temperature-scaled logits.
    denoiser: int [B, C] the sampled denoiser canvas.
    accepted: bool [B, C] the accepted mask.
  """
  logp = jax.nn.log_softmax(scaled.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, denoiser[..., None], axis=-1)[..., 0]
  log_uniform = -jnp.log(jnp.float32(scaled.shape[-1]))
  return jnp.sum(jnp.where(accepted, chosen, log_uniform), axis=-1)


def stop_update(history: jax.Array, filled: jax.Array, argmax: jax.Array,
                entropy: jax.Array, config: config_lib.SamplerConfig):
  """The adaptive stop of one step.

  Args:
    history: int [S, B, C] the previous S argmax canvases (oldest first).
    filled: int [] how many of them exist (a missing one never matches).
    argmax: int [B, C] this step's argmax canvas.
    entropy: float [B, C] entropies of this step's temperature-scaled
      logits (`token_entropy`).
    config: Supplies S and the confidence threshold c.

  Returns:
    (stop bool [B], updated history, updated filled).
  """
  s = config.stability_threshold
  if s == 0:
    stable = jnp.ones(argmax.shape[:1], bool)
  else:
    same = jnp.all(history == argmax[None], axis=-1)          # [S, B]
    stable = jnp.all(same, axis=0) & (filled >= s)
    history = jnp.concatenate([history[1:], argmax[None]], axis=0)
    filled = jnp.minimum(filled + 1, s)
  confident = jnp.mean(entropy, -1) < config.confidence_threshold
  return stable & confident, history, filled


class CanvasResult(NamedTuple):
  """One denoised canvas.

  Attributes:
    tokens: int [B, C] the final argmax canvas.
    steps: int [B] decoder calls this canvas took per row (the reference's
      count: steps before the row's stop, the stopping step included).
    changed_at: int [B, C] the step (1-based) at which each final token last
      changed in the argmax canvas.
    trace: Optional per-step record (see `denoise_canvas`), else None.
  """

  tokens: jax.Array
  steps: jax.Array
  changed_at: jax.Array
  trace: dict[str, jax.Array] | None


def denoise_canvas(decoder_fn: DecoderFn, key: jax.Array, batch: int,
                   canvas_length: int, vocab_size: int,
                   config: config_lib.SamplerConfig, *,
                   active: jax.Array | None = None,
                   record_trace: bool = False) -> CanvasResult:
  """Denoises one canvas with the entropy-bound sampler (jit-able).

  Args:
    decoder_fn: `(canvas int [B, C], sc_logits float [B, C, V], sc_on bool
      [B]) -> logits [B, C, V]`; `sc_on` False means no self-conditioning
      (the first step).
    key: PRNG key (initial canvas, then per step a sample and a noise key).
    batch, canvas_length, vocab_size: B, C, V.
    config: The sampler settings.
    active: bool [B] rows that still generate (finished rows are not
      counted in `steps`); default all.
    record_trace: Also return, per step, the input canvas, the canvas it
      produced (after renoising), the sampled denoiser canvas, the accepted
      mask, the temperature, whether the row was still denoising, the
      self-conditioning switch, and the step's log-probability
      (`step_logprob`, 0 once the row stopped), for exact trajectory
      scoring.

  Returns:
    A `CanvasResult`.
  """
  n = config.max_denoising_steps
  s = max(config.stability_threshold, 1)
  key, init_key = jax.random.split(key)
  canvas = jax.random.randint(init_key, (batch, canvas_length), 0, vocab_size)
  if active is None:
    active = jnp.ones((batch,), bool)
  state = dict(
      step=jnp.zeros((), jnp.int32),
      key=key,
      canvas=canvas,
      argmax=canvas,
      sc_logits=jnp.zeros((batch, canvas_length, vocab_size), jnp.float32),
      done=jnp.zeros((batch,), bool),
      history=jnp.full((s, batch, canvas_length), -1, jnp.int32),
      filled=jnp.zeros((), jnp.int32),
      steps=jnp.zeros((batch,), jnp.int32),
      changed_at=jnp.zeros((batch, canvas_length), jnp.int32),
  )
  if record_trace:
    state["trace"] = dict(
        canvas=jnp.zeros((n, batch, canvas_length), jnp.int32),
        next_canvas=jnp.zeros((n, batch, canvas_length), jnp.int32),
        denoiser=jnp.zeros((n, batch, canvas_length), jnp.int32),
        accepted=jnp.zeros((n, batch, canvas_length), bool),
        temperature=jnp.zeros((n,), jnp.float32),
        live=jnp.zeros((n, batch), bool),
        sc_on=jnp.zeros((n, batch), bool),
        logprob=jnp.zeros((n, batch), jnp.float32),
    )

  def cond(st):
    return (st["step"] < n) & ~jnp.all(st["done"])

  def body(st):
    step = st["step"]
    key, sample_key, noise_key = jax.random.split(st["key"], 3)
    sc_on = jnp.broadcast_to(step > 0, (batch,))
    logits = decoder_fn(st["canvas"], st["sc_logits"], sc_on)
    temp = temperature((n - step).astype(jnp.float32), config)
    scaled = logits.astype(jnp.float32) / temp
    denoiser, entropy, new_argmax = sample_with_entropy(sample_key, scaled)
    if config.greedy:
      denoiser = new_argmax
    accepted = accept_mask(entropy, config.entropy_bound)
    noise = jax.random.randint(noise_key, (batch, canvas_length), 0,
                               vocab_size)
    new_canvas = renoise(jnp.where(accepted, denoiser, st["canvas"]),
                         accepted, noise)
    done = st["done"]
    if record_trace:
      logprob = jnp.where(done, 0.0, step_logprob(scaled, denoiser, accepted))
    new_argmax = jnp.where(done[:, None], st["argmax"], new_argmax)
    new_canvas = jnp.where(done[:, None], st["canvas"], new_canvas)
    scaled = jnp.where(done[:, None, None], st["sc_logits"], scaled)
    # A stopped row's flag is already set, so its entropies do not matter.
    stop, history, filled = stop_update(st["history"], st["filled"],
                                        new_argmax, entropy, config)
    changed = new_argmax != st["argmax"]
    out = dict(
        step=step + 1,
        key=key,
        canvas=new_canvas,
        argmax=new_argmax,
        sc_logits=scaled,
        done=done | stop,
        history=history,
        filled=filled,
        steps=st["steps"] + (~done & active).astype(jnp.int32),
        changed_at=jnp.where(changed, step + 1, st["changed_at"]),
    )
    if record_trace:
      tr = st["trace"]
      out["trace"] = dict(
          canvas=tr["canvas"].at[step].set(st["canvas"]),
          next_canvas=tr["next_canvas"].at[step].set(
              new_canvas.astype(jnp.int32)),
          denoiser=tr["denoiser"].at[step].set(denoiser.astype(jnp.int32)),
          accepted=tr["accepted"].at[step].set(accepted & ~done[:, None]),
          temperature=tr["temperature"].at[step].set(temp),
          live=tr["live"].at[step].set(~done),
          sc_on=tr["sc_on"].at[step].set(sc_on),
          logprob=tr["logprob"].at[step].set(logprob),
      )
    return out

  final = jax.lax.while_loop(cond, body, state)
  return CanvasResult(final["argmax"], final["steps"], final["changed_at"],
                      final.get("trace"))
