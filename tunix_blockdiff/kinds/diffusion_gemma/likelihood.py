"""The exact log-probability of an entropy-bound (DiffusionGemma) trajectory.

A canvas's trajectory is its sequence of canvases x_0, x_1, ..., x_S (S the
row's steps). Its random choices are the uniform initial canvas, and at each
step n the sampled denoiser canvas and the uniform renoising. Given x_n (and
the self-conditioning logits of step n - 1, themselves a function of the
trajectory so far), step n computes logits, the temperature-scaled
distribution p_n, and the accepted set A_n, a deterministic function of p_n
(the entropy bound). Slot i of x_{n+1} is then the denoiser's draw from
p_n(.|i) if i is in A_n, else a uniform token, so

  log P(x_{n+1} | x_<=n) = sum_{i in A_n} log p_n(x_{n+1,i} | i)
                         + |not A_n| log(1/V),

and log P(trajectory) = C log(1/V) + sum over the row's steps. The
denoiser's draws at rejected slots are marginalised out (they are discarded),
so they contribute nothing. Scoring under other parameters replays the
chain: each step's self-conditioning input is the *scored* model's previous
scaled logits, and A_n is recomputed from the scored model's entropies, so
the set of slots that carry a model term can differ from the rollout's (the
uniform term covers the others; nothing is dropped).

The adaptive stop and the canvas's result (the last argmax) are
deterministic functions of the trajectory and the parameters. The exact
likelihood of the observed stop step under other parameters is an
indicator: 1 at the rollout's parameters, with zero gradient. The scorer
conditions on it (the rows' recorded `live` steps), which is exact at the
rollout's parameters (PPO ratio 1) and the only differentiable choice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tunix_blockdiff.models.diffusion_gemma import config as config_lib
from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound


def canvas_logprob(decoder_fn: entropy_bound.DecoderFn,
                   trace: dict[str, jax.Array],
                   config: config_lib.SamplerConfig, vocab_size: int, *,
                   per_step: bool = False) -> jax.Array:
  """log P(trajectory) of each row of one canvas under `decoder_fn`.

  Args:
    decoder_fn: The scored model's decoder (`denoise_canvas`'s signature).
    trace: `denoise_canvas(..., record_trace=True).trace`: `canvas`,
      `next_canvas` int [N, B, C], `live`, `sc_on` bool [N, B].
    config: The sampler settings of the rollout (temperature schedule,
      entropy bound).
    vocab_size: V.
    per_step: Return the per-step terms [N, B] (the initial canvas's
      C log(1/V) excluded) instead of the total [B].

  Returns:
    float32 [B] (or [N, B]).
  """
  n, b, c = trace["canvas"].shape
  log_uniform = -math.log(vocab_size)

  def step(sc_logits, inputs):
    index, canvas, nxt, live, sc_on = inputs
    logits = decoder_fn(canvas, sc_logits, sc_on)
    temp = entropy_bound.temperature(
        (config.max_denoising_steps - index).astype(jnp.float32), config)
    scaled = logits.astype(jnp.float32) / temp
    logp = jax.nn.log_softmax(scaled, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    accepted = entropy_bound.accept_mask(jax.lax.stop_gradient(entropy),
                                         config.entropy_bound)
    chosen = jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
    term = jnp.sum(jnp.where(accepted, chosen, log_uniform), axis=-1)
    # A stopped row keeps its logits as the next step's signal.
    sc_next = jnp.where(live[:, None, None], scaled, sc_logits)
    return sc_next, jnp.where(live, term, 0.0)

  init = jnp.zeros((b, c, vocab_size), jnp.float32)
  _, terms = jax.lax.scan(
      step, init,
      (jnp.arange(n), trace["canvas"], trace["next_canvas"], trace["live"],
       trace["sc_on"]))
  if per_step:
    return terms
  return c * log_uniform + jnp.sum(terms, axis=0)
