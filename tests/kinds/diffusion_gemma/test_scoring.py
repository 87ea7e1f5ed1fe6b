"""The DiffusionGemma trajectory scorer on the Splash kernel, and its wiring.

`sequence_logprobs(splash_tile=)` runs the encoder's and every canvas
decoder's attention on Splash (Pallas interpret mode here); its log-probs
and gradients must equal the dense scorer's. The rl/opd jobs choose the
tile from `rollout.attention` (`rl.scoring_splash_tile`) and hand it to the
engine's scorers; the learner gives the GRPO loss the engine's tile.
"""

import functools
import types

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import omegaconf
import pytest
from tunix.rl.rollout import base_rollout

from tunix_blockdiff import errors
from tunix_blockdiff import tasks
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib
from tunix_blockdiff.kinds.diffusion_gemma import grpo as dg_grpo
from tunix_blockdiff.kinds.diffusion_gemma import rl as dg_rl
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.kinds.diffusion_gemma import scoring
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models import tiny

TOKENIZER = tasks.CharTokenizer(alphabet="0123456789rev >")
SAMPLER = dg.SamplerConfig(max_denoising_steps=2, entropy_bound=0.6,
                           t_min=0.5, t_max=1.0, confidence_threshold=0.5)
# Splash tiles are multiples of 128: a 128-slot prompt width, one canvas.
TILE = 128
ROLLOUT = base_rollout.RolloutConfig(max_tokens_to_generate=TILE,
                                     max_prompt_length=TILE)


@functools.lru_cache(maxsize=None)
def _rollout():
  model = tiny.tiny_diffusion_gemma(TOKENIZER.vocab_size, seed=1,
                                    embedding_scale=3.0, canvas_length=TILE)
  engine = engine_lib.DiffusionGemmaRollout(model, TOKENIZER,
                                            sampler_config=SAMPLER, seed=2)
  out = engine.generate(["rev 12>", "rev 4567>"], ROLLOUT)
  mask = dg_rollout.valid_mask(out.left_padded_prompt_tokens.shape[1],
                               out.prompt_lengths)
  return engine, out, mask


def test_splash_scores_and_gradients_equal_dense():
  engine, out, mask = _rollout()
  assert out.left_padded_prompt_tokens.shape[1] == TILE
  config = engine.sampler_config
  graphdef, params = nnx.split(engine.model(), nnx.Param)
  rest = nnx.state(engine.model(), nnx.Not(nnx.Param))

  def total(params, **splash):
    model = nnx.merge(graphdef, params, rest)
    return jnp.sum(scoring.sequence_logprobs(
        model, out.left_padded_prompt_tokens, mask, out.trace, config,
        per_canvas=True, **splash))

  # Each as one compiled program (op by op: ~330 programs).
  dense, dense_grads = jax.jit(jax.value_and_grad(total))(params)
  splash, splash_grads = jax.jit(jax.value_and_grad(
      functools.partial(total, splash_tile=TILE, splash_interpret=True)))(
          params)
  np.testing.assert_allclose(splash, dense, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(splash_grads),
                       jax.tree.leaves(dense_grads), strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  # The sampler's own log-probs (dense) are what both reproduce.
  np.testing.assert_allclose(dense, np.sum(out.sequence_logprobs),
                             rtol=2e-5, atol=2e-3)


def test_the_engine_scores_with_its_splash_tile():
  engine, out, mask = _rollout()
  splash = engine_lib.DiffusionGemmaRollout(
      engine.model(), TOKENIZER, sampler_config=SAMPLER, seed=2,
      splash_tile=TILE, splash_interpret=True)
  args = (out.left_padded_prompt_tokens, mask, out.trace)
  np.testing.assert_allclose(splash.score(engine.model(), *args),
                             engine.score(engine.model(), *args), rtol=1e-5)


def test_tiles_that_cannot_run_are_refused():
  with pytest.raises(ValueError, match="multiple of 128"):
    scoring.check_splash_tile(100)
  with pytest.raises(ValueError, match=r"divide the prompt_width 64"):
    scoring.check_splash_tile(128, prompt_width=64, canvas_length=128)
  scoring.check_splash_tile(None, prompt_width=3)
  with pytest.raises(ValueError, match="canvas_length 4"):
    engine_lib.DiffusionGemmaRollout(
        tiny.tiny_diffusion_gemma(TOKENIZER.vocab_size), TOKENIZER,
        splash_tile=TILE)
  with pytest.raises(ValueError, match="multiple of 128"):
    dg_grpo.DiffusionGemmaGRPOConfig(splash_tile=64)


def test_the_grpo_loss_scores_the_policy_with_its_tile(monkeypatch):
  seen = {}

  def fake(model, train_example, config, **splash):
    del model, train_example, config
    seen.update(splash)
    return jnp.zeros((2,))

  monkeypatch.setattr(dg_grpo, "policy_sequence_logprobs", fake)
  algo = dg_grpo.DiffusionGemmaGRPOConfig(sampler_config=SAMPLER,
                                          splash_tile=TILE)
  example = types.SimpleNamespace(old_per_token_logps=None,
                                  ref_per_token_logps=None,
                                  advantages=jnp.ones((2,)))
  dg_grpo.dg_grpo_loss_fn(None, example, algo)
  assert seen == {"splash_tile": TILE, "splash_interpret": None}


def _cfg(attention, width, tile=None, model_attention="dense"):
  cfg = omegaconf.OmegaConf.create({"rollout": {
      "attention": attention, "attention_tile": tile,
      "max_prompt_length": width}})
  policy_cfg = omegaconf.OmegaConf.create(
      {"model": {"attention": model_attention}})
  return cfg, policy_cfg


def _policy(canvas):
  return types.SimpleNamespace(config=types.SimpleNamespace(
      canvas_length=canvas))


def test_the_jobs_tile_comes_from_rollout_attention():
  tile = dg_rl.scoring_splash_tile
  assert tile(*_cfg("splash", 256), None, _policy(128)) == 128
  assert tile(*_cfg("splash", 512, 256), None, _policy(256)) == 256
  # Unset: the policy's SFT model.attention, as for block diffusion.
  assert tile(*_cfg(None, 256, model_attention="splash"), None,
              _policy(128)) == 128
  assert tile(*_cfg("dense", 256), None, _policy(128)) is None
  assert tile(*_cfg(None, 256), None, _policy(128)) is None
  # auto: Splash on a TPU only.
  assert tile(*_cfg("auto", 256), None, _policy(128)) is None
  with pytest.raises(errors.UsageError,
                     match=r"rollout.max_prompt_length \(64\).*canvas"):
    tile(*_cfg("splash", 64), None, _policy(128))
  with pytest.raises(errors.UsageError, match="rollout.attention"):
    tile(*_cfg("flash", 256), None, _policy(128))
  mesh = jax.make_mesh((2,), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with pytest.raises(errors.UsageError, match="one device"):
    tile(*_cfg("splash", 256), mesh, _policy(128))
