"""The entropy-bound trajectory likelihood is the sampler's (chi-square).

Thousands of identical rows of one `denoise_canvas` call on a tiny
DiffusionGemma (vocabulary 3, canvas 2, two steps: 729 possible canvas
sequences) give empirical trajectory frequencies; `canvas_logprob` under the
rollout's parameters must explain them. Two scorers that leave something
out must not: one that drops the uniform renoising terms, one that scores
every slot as if accepted.
"""

import collections
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import likelihood as lik
from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound

V, C, ROWS = 3, 2, 24000


def _setup(bound, t_min, t_max):
  config = dg.DiffusionGemmaConfig(
      vocab_size=V, hidden_size=8, intermediate_size=16,
      layer_types=("full_attention",), num_heads=2, num_kv_heads=1,
      head_dim=4, global_num_kv_heads=1, global_head_dim=4, canvas_length=C)
  model = dg.DiffusionGemma(config, rngs=nnx.Rngs(3))
  model.embedding[...] = model.embedding[...] * 4.0  # sharper distributions
  cache = model.init_cache(ROWS, 2 + C)
  _, cache = model.encode(jnp.ones((ROWS, 2), jnp.int32),
                          jnp.broadcast_to(jnp.arange(2), (ROWS, 2)),
                          jnp.ones((ROWS, 2), bool), cache)
  positions = jnp.broadcast_to(jnp.arange(2, 2 + C), (ROWS, C))

  def decoder_fn(canvas, sc_logits, sc_on):
    return model.decode(canvas, positions, cache, sc_logits, sc_on)

  sampler = dg.SamplerConfig(max_denoising_steps=2, entropy_bound=bound,
                             t_min=t_min, t_max=t_max,
                             confidence_threshold=1e-30)
  return decoder_fn, sampler


def _chi_square_p(trace, logprob):
  seqs = np.concatenate([np.asarray(trace["canvas"][0]),
                         np.asarray(trace["next_canvas"]).transpose(1, 0, 2)
                         .reshape(ROWS, -1)], axis=1)
  keys = [tuple(r) for r in seqs]
  counts = collections.Counter(keys)
  first = {}
  for i, k in enumerate(keys):
    first.setdefault(k, i)
  logprob = np.asarray(logprob, np.float64)
  observed, expected = [], []
  for k, count in counts.items():
    observed.append(count)
    expected.append(ROWS * math.exp(logprob[first[k]]))
  observed, expected = np.asarray(observed), np.asarray(expected)
  # Never-seen trajectories hold the remaining mass, pooled with the rare.
  rest_expected = ROWS - expected.sum()
  small = expected < 5.0
  pooled_obs = observed[small].sum()
  pooled_exp = expected[small].sum() + max(rest_expected, 0.0)
  obs = np.append(observed[~small], pooled_obs)
  exp = np.append(expected[~small], pooled_exp)
  statistic = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
  return float(stats.chi2.sf(statistic, obs.size - 1)), float(
      np.exp(logprob[[first[k] for k in counts]]).sum())


@pytest.mark.parametrize("bound, t_min, t_max", [(0.4, 0.5, 1.0),
                                                 (0.3, 0.9, 1.8)])
def test_exact_logprob_explains_the_sampler_and_controls_fail(bound, t_min,
                                                              t_max):
  decoder_fn, sampler = _setup(bound, t_min, t_max)
  result = jax.jit(lambda k: entropy_bound.denoise_canvas(
      decoder_fn, k, ROWS, C, V, sampler, record_trace=True))(
          jax.random.key(0))
  trace = result.trace
  assert np.asarray(trace["live"]).all()
  exact = lik.canvas_logprob(decoder_fn, trace, sampler, V)
  p_exact, mass = _chi_square_p(trace, exact)
  assert mass <= 1.0 + 1e-4
  assert p_exact > 1e-3, p_exact
  # Control 1: drop the renoising terms (only accepted slots scored).
  steps = lik.canvas_logprob(decoder_fn, trace, sampler, V, per_step=True)
  accepted = np.asarray(trace["accepted"]).sum(-1)
  assert 0.05 < float(np.mean(accepted < C)) < 0.95  # both cases occur
  no_renoise = C * -math.log(V) + np.sum(
      np.asarray(steps) - (C - accepted) * -math.log(V), axis=0)
  p_control, _ = _chi_square_p(trace, no_renoise)
  assert p_control < 1e-6, p_control
  # Control 2: the final canvas only (every step's terms left out).
  p_final, _ = _chi_square_p(trace, np.full((ROWS,), C * -math.log(V)))
  assert p_final < 1e-6, p_final


def test_scoring_replays_the_self_conditioning_chain():
  decoder_fn, sampler = _setup(0.4, 0.5, 1.0)
  result = entropy_bound.denoise_canvas(decoder_fn, jax.random.key(1), ROWS,
                                        C, V, sampler, record_trace=True)
  exact = lik.canvas_logprob(decoder_fn, result.trace, sampler, V)
  assert bool(jnp.all(jnp.isfinite(exact)))
  # Without the self-conditioning chain the second step's terms change.
  no_sc = dict(result.trace, sc_on=jnp.zeros_like(result.trace["sc_on"]))
  other = lik.canvas_logprob(decoder_fn, no_sc, sampler, V)
  assert float(jnp.abs(other - exact).max()) > 1e-4
