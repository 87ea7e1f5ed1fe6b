"""DiffusionGemma generation: canvases over the cache, per-row EOS stops."""

import dataclasses
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout

DATA = pathlib.Path(__file__).resolve().parents[2] / "data/diffusion_gemma"


def test_finish_canvas_pads_after_eos_and_for_finished_rows():
  tokens = jnp.array([[5, 3, 7, 3], [5, 6, 7, 8], [3, 1, 2, 2]])
  finished = jnp.array([False, False, True])
  out, done = dg_rollout.finish_canvas(tokens, finished, 3, 0)
  np.testing.assert_array_equal(out, [[5, 3, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
  np.testing.assert_array_equal(done, [True, False, True])
  out, done = dg_rollout.finish_canvas(tokens, finished, None, 0)
  np.testing.assert_array_equal(done, finished)


@pytest.fixture(scope="module")
def model_and_sampler():
  model, sampler, _ = dg.load(DATA / "moe_sliding")
  return model, sampler


def test_generate_shapes_counts_and_determinism(model_and_sampler):
  model, config = model_and_sampler
  config = dg.SamplerConfig(**{**config.__dict__, "eos_token_id": None})
  prompts = np.array([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])
  sampler = dg_rollout.DiffusionGemmaSampler(model, config)
  a = sampler.generate(prompts, [3, 5], max_new_tokens=10,
                       rng=jax.random.key(1))
  b = sampler.generate(prompts, [3, 5], max_new_tokens=10,
                       rng=jax.random.key(1))
  c = model.config.canvas_length
  assert a.tokens.shape == (2, 3 * c)  # ceil(10 / 4) canvases
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.canvas_steps.shape == (2, 3)
  assert np.all((a.canvas_steps >= 1)
                & (a.canvas_steps <= config.max_denoising_steps))
  np.testing.assert_array_equal(a.forward_passes, a.canvas_steps.sum(1))
  kept = (a.tokens != config.pad_token_id).sum(1)
  np.testing.assert_allclose(a.tokens_per_forward, kept / a.forward_passes)
  assert np.all((a.changed_at >= 0) & (a.changed_at <= 6))
  other = sampler.generate(prompts, [3, 5], max_new_tokens=10,
                           rng=jax.random.key(2))
  assert not np.array_equal(other.tokens, a.tokens)


def test_samplers_of_one_architecture_share_their_programs(model_and_sampler):
  """Keyed by GraphDef and settings: a new sampler (an evaluation's, a
  reloaded policy's) of a model of the same architecture traces nothing
  again and samples its own model, as a program traced for it alone does;
  other settings get their own programs."""
  model, config = model_and_sampler
  prompts, lengths = np.array([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]]), [3, 5]
  rng = jax.random.key(1)
  dg_rollout._PROGRAMS.clear()  # other tests' samplers may share them
  first = dg_rollout.DiffusionGemmaSampler(model, config)
  a = first.generate(prompts, lengths, max_new_tokens=8, rng=rng)
  other = dg.DiffusionGemma(model.config, rngs=nnx.Rngs(5))
  second = dg_rollout.DiffusionGemmaSampler(other, config)
  assert second._canvas is first._canvas
  assert second._prefill is first._prefill
  b = second.generate(prompts, lengths, max_new_tokens=8, rng=rng)
  assert first._canvas._cache_size() == 1
  assert not np.array_equal(a.tokens, b.tokens)  # its own weights
  dg_rollout._PROGRAMS.clear()
  alone = dg_rollout.DiffusionGemmaSampler(other, config)
  assert alone._canvas is not first._canvas
  c = alone.generate(prompts, lengths, max_new_tokens=8, rng=rng)
  for field in ("tokens", "changed_at", "canvas_steps"):
    np.testing.assert_array_equal(getattr(b, field), getattr(c, field))
  for changed in (
      dg_rollout.DiffusionGemmaSampler(
          other, dataclasses.replace(config, greedy=not config.greedy)),
      dg_rollout.DiffusionGemmaSampler(other, config, record_trace=True),
  ):
    assert changed._canvas is not alone._canvas
  assert len(dg_rollout._PROGRAMS) == 3


def test_rows_finish_independently(model_and_sampler):
  model, config = model_and_sampler
  prompts = np.tile(np.arange(1, 6), (6, 1))
  # Find, over seeds, a batch where some rows hit EOS early and others not.
  config_eos = dg.SamplerConfig(**{**config.__dict__, "eos_token_id": 7})
  sampler = dg_rollout.DiffusionGemmaSampler(model, config_eos)
  for seed in range(40):
    res = sampler.generate(prompts, [5] * 6, max_new_tokens=16,
                           rng=jax.random.key(seed))
    c = model.config.canvas_length
    has_eos = (res.tokens[:, :c] == 7).any(1)
    if has_eos.any() and not has_eos.all():
      break
  else:
    pytest.skip("no seed gave a mixed batch")
  stopped = np.flatnonzero(has_eos)
  running = np.flatnonzero(~has_eos)
  assert np.all(res.tokens[stopped, c:] == 0)
  assert np.all(res.canvas_steps[stopped, 1:] == 0)
  assert np.all(res.canvas_steps[running, 1] >= 1)
  for row in stopped:
    first = int(np.argmax(res.tokens[row, :c] == 7))
    assert np.all(res.tokens[row, first + 1:c] == 0)


def test_generate_validates_inputs(model_and_sampler):
  model, config = model_and_sampler
  with pytest.raises(ValueError, match="prompt_lengths"):
    dg_rollout.generate(model, np.zeros((2, 3), int), [1, 4], config,
                        max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    dg_rollout.generate(model, np.zeros((2, 3), int), [1, 3], config,
                        max_new_tokens=0)
  with pytest.raises(ValueError, match="prompt_tokens"):
    dg_rollout.generate(model, np.full((1, 3), 99), [3], config,
                        max_new_tokens=4)


def test_image_tokens_are_refused(model_and_sampler):
  import dataclasses  # pylint: disable=g-import-not-at-top

  model, config = model_and_sampler
  assert model.config.image_token_id == 258880  # from config.json
  model.config = dataclasses.replace(model.config, image_token_id=9)
  try:
    with pytest.raises(ValueError, match="image"):
      dg_rollout.generate(model, np.array([[0, 9, 5]]), [2], config,
                          max_new_tokens=4)
    # A padding slot holding the id is not an input.
    dg_rollout.generate(model, np.array([[9, 4, 5]]), [2], config,
                        max_new_tokens=4)
  finally:
    model.config = dataclasses.replace(model.config, image_token_id=258880)
