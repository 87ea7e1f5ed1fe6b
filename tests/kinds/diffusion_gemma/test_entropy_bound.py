"""The entropy-bound sampler against the reference's step functions.

`tests/data/diffusion_gemma/sampler.npz` holds the reference's acceptance,
renoising, stopping and temperature outputs on fixed inputs (written by
`tools/diffusion_gemma_goldens.py`); the invariants are checked with
hypothesis.
"""

import pathlib

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.models.diffusion_gemma import SamplerConfig
from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound as eb

REF = np.load(pathlib.Path(__file__).resolve().parents[2]
              / "data/diffusion_gemma/sampler.npz")


@pytest.mark.parametrize("bound", [0.05, 0.3, 1.5])
def test_acceptance_and_renoise_match_the_reference(bound):
  entropy = eb.token_entropy(jnp.asarray(REF["accept_logits"]))
  mask = eb.accept_mask(entropy, bound)
  np.testing.assert_array_equal(mask, REF[f"accepted_mask_{bound}"])
  accepted = jnp.where(mask, REF["accept_denoiser"], REF["accept_current"])
  np.testing.assert_array_equal(accepted, REF[f"accepted_{bound}"])
  np.testing.assert_array_equal(
      eb.renoise(accepted, mask, jnp.asarray(REF["renoise_noise"])),
      REF[f"renoised_{bound}"])


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_adaptive_stop_matches_the_reference(stability):
  config = SamplerConfig(stability_threshold=stability,
                         confidence_threshold=0.5)
  s = max(stability, 1)
  argmax = REF["stop_argmax"]
  history = jnp.full((s,) + argmax.shape[1:], -1, jnp.int32)
  filled = jnp.zeros((), jnp.int32)
  flags = []
  for step in range(argmax.shape[0]):
    stop, history, filled = eb.stop_update(
        history, filled, jnp.asarray(argmax[step]),
        eb.token_entropy(jnp.asarray(REF["stop_logits"][step])), config)
    flags.append(np.asarray(stop))
  np.testing.assert_array_equal(np.stack(flags), REF[f"stop_{stability}"])
  assert np.asarray(flags).any() and not np.asarray(flags).all()


def test_linear_temperature_schedule_matches_the_reference():
  config = SamplerConfig(max_denoising_steps=5, t_min=0.3, t_max=0.9)
  got = [float(eb.temperature(jnp.float32(n), config)) for n in range(5, 0, -1)]
  np.testing.assert_allclose(got, REF["temperatures"], rtol=1e-6)


# Jitted, as the sampler runs it: one program per width, not op by op.
_accept_mask = jax.jit(eb.accept_mask)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 3.0, width=32), min_size=1, max_size=12),
    st.floats(0.01, 4.0),
)
def test_accepted_slots_follow_the_bound_exactly(entropies, bound):
  e = np.asarray(entropies, np.float32)[None]
  mask = np.asarray(_accept_mask(jnp.asarray(e), bound))[0]
  order = np.argsort(e[0], kind="stable")
  ranked = e[0][order]
  before = np.cumsum(ranked) - ranked
  np.testing.assert_array_equal(mask[order], before <= np.float32(bound))
  assert mask[order[0]]  # the most certain slot always goes in
  # Accepted slots are a lowest-entropy prefix.
  if (~mask).any():
    assert e[0][mask].max() <= e[0][~mask].min()


def _toy_decoder(vocab, sharpness):
  """Logits that favour token (slot + 1) % vocab, sharper every call."""

  def decoder_fn(canvas, sc_logits, sc_on):
    b, c = canvas.shape
    target = (jnp.arange(c) + 1) % vocab
    base = jax.nn.one_hot(target, vocab) * sharpness[:, None, None]
    bonus = jnp.where(sc_on[:, None, None], 0.5 * sc_logits, 0.0)
    return jnp.broadcast_to(base, (b, c, vocab)) + bonus

  return decoder_fn


def test_rows_stop_independently_and_never_change_after():
  config = SamplerConfig(max_denoising_steps=8, entropy_bound=0.5,
                         stability_threshold=1, confidence_threshold=0.05)
  # Row 0 is near-deterministic (stops early); row 1 stays uncertain.
  decoder = _toy_decoder(7, jnp.array([30.0, 0.5]))
  result = jax.jit(lambda k: eb.denoise_canvas(
      decoder, k, 2, 5, 7, config, record_trace=True))(jax.random.key(3))
  steps = np.asarray(result.steps)
  assert steps[0] < steps[1] == 8
  live = np.asarray(result.trace["live"])
  canvases = np.asarray(result.trace["canvas"])
  first_dead = int(np.argmin(live[:, 0]))
  assert not live[first_dead:steps[1], 0].any()
  for step in range(first_dead + 1, steps[1]):
    np.testing.assert_array_equal(canvases[step, 0], canvases[first_dead, 0])
  np.testing.assert_array_equal(np.asarray(result.tokens)[0],
                                (np.arange(5) + 1) % 7)
  assert not np.asarray(result.trace["accepted"])[first_dead:, 0].any()


def test_step_limit_and_self_conditioning_switch():
  config = SamplerConfig(max_denoising_steps=3, confidence_threshold=1e-9)
  result = eb.denoise_canvas(_toy_decoder(5, jnp.array([1.0])),
                             jax.random.key(0), 1, 4, 5, config,
                             record_trace=True)
  assert int(result.steps[0]) == 3
  np.testing.assert_array_equal(np.asarray(result.trace["sc_on"])[:, 0],
                                [False, True, True])
  np.testing.assert_allclose(result.trace["temperature"],
                             [0.8, 0.4 + 0.4 * 2 / 3, 0.4 + 0.4 / 3],
                             rtol=1e-6)


def test_inverse_cdf_sampling_matches_the_distribution():
  logits = jnp.log(jnp.array([[[0.5, 0.3, 0.15, 0.05, 0.0]]]) + 1e-30)
  keys = jax.random.split(jax.random.key(0), 20000)
  # Each vmap as one compiled program (op by op: ~140 programs).
  draws = jax.jit(jax.vmap(lambda k: eb.sample_with_entropy(k, logits)[0]))(
      keys)
  freq = np.bincount(np.asarray(draws).ravel(), minlength=5) / 20000
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05, 0.0], atol=0.012)
  _, entropy, top = eb.sample_with_entropy(keys[0], logits)
  np.testing.assert_allclose(entropy, eb.token_entropy(logits), rtol=1e-5)
  assert int(top[0, 0]) == 0
  # A -inf logit is never drawn and adds nothing to the entropy.
  masked = jnp.log(jnp.array([[[0.6, 0.4, 0.0]]]))
  draws, entropy, top = jax.jit(jax.vmap(
      lambda k: eb.sample_with_entropy(k, masked)))(keys[:2000])
  assert set(np.unique(np.asarray(draws))) <= {0, 1}
  want = -(0.6 * np.log(0.6) + 0.4 * np.log(0.4))
  np.testing.assert_allclose(np.asarray(entropy), want, rtol=1e-5)
  assert np.all(np.asarray(top) == 0)


# One program per vocabulary size (eager, every op compiled per size).
_inverse_cdf = jax.jit(eb.inverse_cdf)
_first_argmax = jax.jit(eb.first_argmax)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_inverse_cdf_and_argmax_match_their_definitions(vocab, seed):
  rng = np.random.default_rng(seed)
  probs = rng.random((3, vocab)).astype(np.float32) ** 3
  if vocab > 1:
    probs[:, rng.integers(0, vocab)] = 0.0
  u = rng.random(3).astype(np.float32)
  got = np.asarray(_inverse_cdf(jnp.asarray(probs), jnp.asarray(u)))
  cdf = np.cumsum(probs.astype(np.float64), -1)
  want = np.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(-1), vocab - 1)
  # Float32 block sums may move a draw that sits on a boundary by one.
  assert np.all(np.abs(got - want) <= 1)
  assert np.all(probs[np.arange(3), got] > 0)
  x = rng.integers(0, 3, (4, vocab)).astype(np.float32)  # many ties
  np.testing.assert_array_equal(_first_argmax(jnp.asarray(x)),
                                np.argmax(x, -1))


def test_greedy_steps_place_the_argmax_and_sampled_ones_draw():
  # An uncertain row (sharpness 0.5 over 7 tokens): sampled denoiser canvases
  # stray from the favoured token, greedy ones never do.
  decoder = _toy_decoder(7, jnp.array([0.5, 0.5]))
  target = (np.arange(5) + 1) % 7
  canvases = {}
  for greedy in (False, True):
    config = SamplerConfig(max_denoising_steps=6, entropy_bound=0.5,
                           confidence_threshold=1e-9, greedy=greedy)
    result = eb.denoise_canvas(decoder, jax.random.key(1), 2, 5, 7, config,
                               record_trace=True)
    live = np.asarray(result.trace["live"])
    canvases[greedy] = np.asarray(result.trace["denoiser"])[live]
  assert (canvases[False] != target).any()
  np.testing.assert_array_equal(
      canvases[True], np.broadcast_to(target, canvases[True].shape))
  with pytest.raises(TypeError, match="greedy must be a bool"):
    SamplerConfig(greedy=1)
