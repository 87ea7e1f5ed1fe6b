"""GRPO on DiffusionGemma rollouts: dg_grpo, its learner, a real run."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

import tunix_blockdiff
from tunix_blockdiff import tasks
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models import tiny
from tunix_blockdiff.kinds.diffusion_gemma import cluster as cluster_lib
from tunix_blockdiff.kinds.diffusion_gemma import grpo as dg_grpo
from tunix_blockdiff.kinds.diffusion_gemma import learner as learner_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import trainer as trainer_lib
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib

tunix_blockdiff.register()

TOKENIZER = tasks.CharTokenizer(alphabet="0123456789rev >")
SAMPLER = dg.SamplerConfig(max_denoising_steps=4, entropy_bound=0.6,
                           t_min=0.5, t_max=1.0, confidence_threshold=0.5)
ROLLOUT = base_rollout.RolloutConfig(max_tokens_to_generate=8,
                                     max_prompt_length=9)
PROMPTS = ["rev 12>", "rev 12>", "rev 345>", "rev 345>"]


def tiny_model(seed=0):
  return tiny.tiny_diffusion_gemma(TOKENIZER.vocab_size, seed=seed,
                                   embedding_scale=3.0)


@functools.lru_cache(maxsize=None)
def _rollout():
  engine = engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                            sampler_config=SAMPLER, seed=1)
  return engine, engine.generate(PROMPTS, ROLLOUT)


def _example(advantages, **kwargs):
  engine, out = _rollout()
  mask = dg_rollout.valid_mask(out.left_padded_prompt_tokens.shape[1],
                               out.prompt_lengths)
  return dg_grpo.DiffusionGemmaTrainExample(
      prompt_ids=jnp.asarray(out.left_padded_prompt_tokens),
      prompt_mask=jnp.asarray(mask),
      completion_ids=jnp.asarray(out.trace.tokens),
      completion_mask=jnp.ones(out.trace.tokens.shape, jnp.int32),
      advantages=jnp.asarray(advantages, jnp.float32),
      ref_per_token_logps=kwargs.pop("ref", None),
      old_per_token_logps=kwargs.pop("old", None),
      trace=jax.tree.map(jnp.asarray, out.trace),
  ), engine, out


def _algo(**kwargs):
  return dg_grpo.DiffusionGemmaGRPOConfig(
      num_generations=2, sampler_config=_rollout()[0].sampler_config,
      **kwargs)


def _loss_and_grad(model, example, algo):
  """The dg_grpo loss, its `LossOutput` and gradients, as the learner jits."""
  loss_fn = function_registry.get_policy_loss_fn("dg_grpo")

  def objective(m, example):
    out = loss_fn(m, example, algo)
    return out.primary_loss.compute(), out

  # One program (as in the learner's train step), not op-by-op dispatch,
  # which compiled each of the loss's hundreds of ops on its own.
  (loss, out), grads = nnx.jit(nnx.value_and_grad(objective, has_aux=True))(
      model, example)
  return loss, out, grads


def test_ratio_is_exactly_one_on_the_first_iteration():
  example, engine, out = _example([1.0, -1.0, 0.5, -0.5])
  model = engine.model()
  _, aux, grads = _loss_and_grad(model, example, _algo())
  # No old log-probs (num_iterations = 1): old = stop_gradient(policy).
  assert float(aux.aux_metrics["is_ratio/max"]) == 1.0
  assert float(aux.aux_metrics["is_ratio/min"]) == 1.0
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert any(np.abs(g).max() > 0 for g in leaves)
  # The old policy's scores (what the cluster computes for num_iterations
  # > 1) are the sampler's own: the ratio is 1 to float32 rounding.
  old = engine.score(model, example.prompt_ids, example.prompt_mask,
                     out.trace)
  np.testing.assert_allclose(old, out.sequence_logprobs, rtol=2e-5,
                             atol=2e-3)
  _, aux, _ = _loss_and_grad(model, example.replace(old_per_token_logps=old),
                             _algo(num_iterations=2))
  assert float(aux.aux_metrics["is_ratio/max"]) == pytest.approx(1.0, abs=1e-4)
  assert float(aux.aux_metrics["is_ratio/min"]) == pytest.approx(1.0, abs=1e-4)


def test_zero_advantage_groups_have_finite_gradients():
  # All rewards equal within each group: GRPO's advantages are all zero.
  advantages = function_registry.get_advantage_estimator("grpo")(
      rewards=np.array([3.0, 3.0, -1.0, -1.0]), num_generations=2)
  np.testing.assert_array_equal(advantages, 0.0)
  example, engine, _ = _example(advantages)
  loss, _, grads = _loss_and_grad(engine.model(), example, _algo(beta=0.0))
  assert float(loss) == 0.0
  assert all(np.all(np.isfinite(g)) and not np.any(g)
             for g in jax.tree.leaves(grads))
  # With a KL penalty to another reference the gradient is the KL's: finite.
  ref = engine.score(tiny_model(seed=1), example.prompt_ids,
                     example.prompt_mask, example.trace)
  loss, aux, grads = _loss_and_grad(engine.model(),
                                    example.replace(ref_per_token_logps=ref),
                                    _algo(beta=0.04))
  assert np.isfinite(float(loss)) and float(aux.aux_metrics["kl"].compute())
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert any(np.abs(g).max() > 0 for g in leaves)


def test_config_and_missing_trace_are_refused():
  with pytest.raises(ValueError, match="loss_agg_mode"):
    dg_grpo.DiffusionGemmaGRPOConfig(num_generations=2,
                                     loss_agg_mode="token-mean")
  with pytest.raises(ValueError, match="loss_algo"):
    dg_grpo.DiffusionGemmaGRPOConfig(num_generations=2,
                                     loss_algo="gspo-token")
  with pytest.raises(TypeError, match="sampler_config"):
    dg_grpo.DiffusionGemmaGRPOConfig(num_generations=2, sampler_config={})
  example, engine, _ = _example([0.0] * 4)
  loss_fn = function_registry.get_policy_loss_fn("dg_grpo")
  with pytest.raises(ValueError, match="DiffusionGemmaTrace"):
    loss_fn(engine.model(), example.replace(trace=None), _algo())
  with pytest.raises(ValueError, match="sampler_config"):
    loss_fn(engine.model(), example,
            dg_grpo.DiffusionGemmaGRPOConfig(num_generations=2))


def _cluster(policy, mesh, num_iterations=2):
  return cluster_lib.DiffusionGemmaRLCluster(
      actor=policy,
      reference=nnx.clone(policy),
      tokenizer=TOKENIZER,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
          rollout_engine=functools.partial(
              engine_lib.DiffusionGemmaRollout, sampler_config=SAMPLER),
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=optax.adam(1e-2),
              eval_every_n_steps=1000,
              max_steps=2,
              mini_batch_size=2,
              train_micro_batch_size=1,
          ),
          rollout_config=ROLLOUT,
      ),
  )


def test_two_grpo_steps_inside_a_real_rlcluster():
  policy = tiny_model()
  before = jax.tree.map(np.array, nnx.state(policy, nnx.Param))
  mesh = rl_common.rl_mesh(None)
  cluster = _cluster(policy, mesh)
  assert isinstance(cluster.actor_trainer, trainer_lib.BlockDiffusionRLTrainer)
  calls = []

  def reward(prompts, completions, **unused):
    calls.append(len(completions))
    return [float(c.count("1")) + 0.1 * len(c) for c in completions]

  learner = learner_lib.DiffusionGemmaGRPOLearner(
      cluster, dg_grpo.DiffusionGemmaGRPOConfig(
          num_generations=2, num_iterations=2, beta=0.04),
      reward_fns=[reward])
  assert learner.algo_config.sampler_config == cluster.rollout.sampler_config
  data = [{"prompts": np.array(["rev 12>", "rev 345>"])} for _ in range(3)]
  with mesh:
    learner.train(data)
  assert cluster.actor_trainer.train_steps == 2
  after = nnx.state(cluster.actor_trainer.model, nnx.Param)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, after)
  assert any(jax.tree.leaves(changed))
  # One rollout batch (2 prompts x 2 generations) trained twice: the first
  # iteration's ratio is 1 (old = rollout policy), the second's is not.
  assert sum(calls) == 4
  trainer = cluster.actor_trainer
  ratios = trainer.metric_history("is_ratio/mean")
  assert abs(ratios[0] - 1.0) < 1e-4
  assert ratios[1] != pytest.approx(1.0, abs=1e-6)
  logger = trainer.metrics_logger
  losses = logger.get_metric_history("actor", "loss", "train")
  assert len(losses) >= 1 and np.all(np.isfinite(losses))
  assert np.all(np.isfinite(trainer.metric_history("kl")))


def test_the_learner_refuses_other_clusters_configs_and_engines():
  mesh = rl_common.rl_mesh(None)
  cluster = _cluster(tiny_model(), mesh)
  with pytest.raises(TypeError, match="DiffusionGemmaGRPOConfig"):
    learner_lib.DiffusionGemmaGRPOLearner(
        cluster, grpo.BlockDiffusionGRPOConfig(num_generations=2),
        reward_fns=[lambda **k: 0])
  other = dg.SamplerConfig(max_denoising_steps=3)
  with pytest.raises(ValueError, match="sampler_config differs"):
    learner_lib.DiffusionGemmaGRPOLearner(
        cluster, dg_grpo.DiffusionGemmaGRPOConfig(
            num_generations=2, sampler_config=other),
        reward_fns=[lambda **k: 0])
  with pytest.raises(ValueError, match="splash_tile 128 differs"):
    learner_lib.DiffusionGemmaGRPOLearner(
        cluster, dg_grpo.DiffusionGemmaGRPOConfig(
            num_generations=2, splash_tile=128),
        reward_fns=[lambda **k: 0])
  with pytest.raises(TypeError, match="sequence-level"):
    cluster.get_ref_per_token_logps(None, None)



def test_a_small_step_along_the_gradient_raises_the_advantaged_logprobs():
  # dg_grpo at ratio 1 is -sum_i A_i log P(tau_i) / B: a step of L2 length
  # 1e-5 along -grad must raise sum_i A_i log P (to first order, > 0), row by
  # row in the sign of A_i, with the scorer recomputing the acceptance.
  advantages = np.array([1.0, -1.0, 0.5, -0.5])
  example, engine, out = _example(advantages)
  model = engine.model()
  _, _, grads = _loss_and_grad(model, example, _algo(beta=0.0))
  norm = np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads)))
  graphdef, state = nnx.split(model)
  moved = nnx.merge(graphdef, jax.tree.map(
      lambda p, g: p - 1e-5 * g / norm, state, nnx.state(grads)))
  before = np.asarray(engine.score(model, example.prompt_ids,
                                   example.prompt_mask, out.trace))
  after = np.asarray(engine.score(moved, example.prompt_ids,
                                  example.prompt_mask, out.trace))
  change = after - before
  assert float((advantages * change).sum()) > 0
  np.testing.assert_array_equal(np.sign(change), np.sign(advantages))
