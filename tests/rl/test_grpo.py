"""Tests for block-diffusion GRPO: the bd_grpo loss, exact accumulation and
two GRPO steps of the rollout engine inside a real Tunix RLCluster."""

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
from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import tasks
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import learners
from tunix_blockdiff.rl import likelihood
from tunix_blockdiff.rl import trainer as trainer_lib
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rl import engine as engine_lib

tunix_blockdiff.register()

VOCAB, MASK, EOS = 40, 3, 2
CONFIG = config_lib.DenoiseConfig(
    block_size=4,
    mask_token_id=MASK,
    threshold=0.3,
    temperature=1.0,
    eos_token_id=EOS,
)


@functools.lru_cache(maxsize=None)
def _model():
  return tiny_models.tiny_qwen3(VOCAB, seed=3, num_layers=1)


def _trajectories(seed=0, batch=4, width=7, num_new=9):
  """Left-padded prompts and sampled denoising traces of the policy.

  Real rollouts (the exact likelihood scores what the sampler can do);
  threshold 0.3 gives multi-commit and forced steps, EOS early stops.
  """
  rs = np.random.RandomState(seed)
  lengths = rs.randint(1, width + 1, size=batch)
  prompt_mask = np.arange(width)[None] >= width - lengths[:, None]
  prompts = np.where(prompt_mask, rs.randint(4, VOCAB, size=(batch, width)), 0)
  result = cached.generate(
      _model(),
      prompts.astype(np.int32),
      lengths,
      CONFIG,
      max_new_tokens=num_new,
      rng=jax.random.key(seed),
      use_cache=False,
  )
  return (
      prompts.astype(np.int32),
      prompt_mask,
      np.asarray(result.trace_tokens),
      np.asarray(result.trace_commit_step),
  )


@functools.lru_cache(maxsize=None)
def _example():
  prompts, prompt_mask, tokens, steps = _trajectories()
  ref = likelihood.score_trajectories_jit(
      _model(), prompts, prompt_mask, tokens, steps, CONFIG
  )
  return grpo.BlockDiffusionTrainExample(
      prompt_ids=jnp.asarray(prompts),
      prompt_mask=jnp.asarray(prompt_mask),
      completion_ids=jnp.asarray(tokens),
      completion_mask=jnp.asarray((steps >= 0).astype(np.int32)),
      advantages=jnp.array([1.0, -1.0, 0.5, -0.5]),
      ref_per_token_logps=ref - 0.1,
      old_per_token_logps=None,
      commit_step=jnp.asarray(steps),
  )


def _algo(**kwargs):
  kwargs.setdefault("num_generations", 2)
  return grpo.BlockDiffusionGRPOConfig(denoise_config=CONFIG, **kwargs)


@functools.lru_cache(maxsize=None)
def _loss_and_grad():
  example = _example()
  algo = _algo(beta=0.04)
  loss_fn = function_registry.get_policy_loss_fn("bd_grpo")

  def objective(model):
    out = loss_fn(model, example, algo, pad_id=0, eos_id=EOS)
    return out.primary_loss.unreduced_sum, out

  return nnx.jit(nnx.value_and_grad(objective, has_aux=True))(_model())


def test_registered_loss_has_finite_nonzero_gradient():
  (_, out), grads = _loss_and_grad()
  assert isinstance(out, compat.LossOutput)
  leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert sum(float(np.abs(g).sum()) for g in leaves) > 0
  # KL to the reference: its log-probs are the policy's minus 0.1.
  np.testing.assert_allclose(out.aux_metrics["kl"].compute(), 0.1, rtol=1e-4)
  # Default aggregation: mean over rows of each row's token mean.
  assert float(out.primary_loss.denominator) == 4.0


def test_ratio_is_exactly_one_on_the_first_iteration():
  # Without stored old log-probs (num_iterations == 1) the old policy is
  # stop_gradient(policy), as in Tunix: the ratio is exactly 1. With stored
  # ones (num_iterations > 1) see the RLCluster test below.
  (_, out), _ = _loss_and_grad()
  assert float(out.aux_metrics["is_ratio/max"]) == 1.0
  assert float(out.aux_metrics["is_ratio/min"]) == 1.0
  assert float(out.aux_metrics["pg_clipfrac"].compute()) == 0.0


def test_exact_likelihood_gradient_flows_through_the_selection_term():
  example = _example()

  def selection_term(model):
    # Exact minus committed-only: the selection log-probs alone.
    totals = [
        jnp.sum(grpo.policy_log_probs(model, example, CONFIG, kind)[0])
        for kind in ("exact", "committed_only")
    ]
    return totals[0] - totals[1]

  value, grads = nnx.jit(nnx.value_and_grad(selection_term))(_model())
  # Selection probabilities are <= 1 and here not all 1.
  assert float(value) < -1e-3
  leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert sum(float(np.abs(g).sum()) for g in leaves) > 1e-4


def test_ppo_ratio_is_one_before_and_not_after_an_update():
  # num_iterations > 1: the old log-probs are the rollout policy's, scored
  # by the cluster's program; the loss's ratio is 1 until the policy moves.
  prompts, prompt_mask, tokens, steps = _trajectories()
  old = likelihood.score_trajectories_jit(
      _model(), prompts, prompt_mask, tokens, steps, CONFIG
  )
  example = _example().replace(old_per_token_logps=old)
  algo = _algo(num_iterations=2)
  loss_fn = function_registry.get_policy_loss_fn("bd_grpo")

  @nnx.jit
  def ratios(model):
    metrics = loss_fn(model, example, algo).aux_metrics
    return metrics["is_ratio/max"], metrics["is_ratio/min"]

  ratio_max, ratio_min = map(float, ratios(_model()))
  assert ratio_max == pytest.approx(1.0, abs=1e-5)
  assert ratio_min == pytest.approx(1.0, abs=1e-5)
  _, grads = _loss_and_grad()
  updated = nnx.clone(_model())
  params = nnx.state(updated, nnx.Param)
  nnx.update(updated, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
  ratio_max, ratio_min = map(float, ratios(updated))
  assert np.isfinite(ratio_max) and np.isfinite(ratio_min)
  assert max(ratio_max - 1.0, 1.0 - ratio_min) > 1e-3


@pytest.mark.parametrize("mode", grpo.LOSS_AGG_MODES)
def test_aggregation_sums_exactly_over_micro_batches(mode):
  rs = np.random.RandomState(0)
  per_token = jnp.asarray(rs.normal(size=(6, 5)), jnp.float32)
  mask = jnp.asarray(rs.rand(6, 5) < 0.5)
  whole = grpo.aggregate(per_token, mask, mode)
  parts = [
      grpo.aggregate(per_token[s], mask[s], mode)
      for s in (slice(0, 1), slice(1, 6))
  ]
  total = sum(float(p.unreduced_sum) for p in parts) / sum(
      float(p.denominator) for p in parts
  )
  np.testing.assert_allclose(total, whole.compute(), rtol=1e-6)


def test_missing_trace_and_bad_config_raise():
  example = _example()
  no_trace = example.replace(commit_step=None)
  with pytest.raises(ValueError, match="commit_step"):
    grpo.bd_grpo_loss_fn(_model(), no_trace, _algo())
  with pytest.raises(ValueError, match="denoise_config"):
    grpo.bd_grpo_loss_fn(
        _model(), example, grpo.BlockDiffusionGRPOConfig(num_generations=2)
    )
  with pytest.raises(ValueError, match="loss_agg_mode"):
    _algo(loss_agg_mode="sequence-mean-token-scale")
  with pytest.raises(ValueError, match="likelihood must be one of"):
    _algo(likelihood="committed")
  # Greedy rollouts are deterministic: no exact likelihood to train with.
  greedy = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK)
  with pytest.raises(ValueError, match="temperature > 0"):
    grpo.BlockDiffusionGRPOConfig(num_generations=2, denoise_config=greedy)
  grpo.BlockDiffusionGRPOConfig(
      num_generations=2, denoise_config=greedy, likelihood="committed_only"
  )


class _Linear(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jnp.array([0.5, -1.0, 2.0]))


def _weighted_loss(model, x, weights):
  per_row = (x @ model.w.value) ** 2
  return compat.LossOutput(
      primary_loss=compat.WeightedMetric(
          jnp.sum(weights * per_row), jnp.sum(weights)
      ),
      aux_metrics={},
  )


def _trainer(accumulation):
  config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(0.1),
      eval_every_n_steps=1000,
      mini_batch_size=2,
      train_micro_batch_size=2 // accumulation,
  )
  trainer = trainer_lib.BlockDiffusionRLTrainer(
      _Linear(), optax.sgd(0.1), config, custom_checkpoint_metadata_fn=dict
  )
  trainer.with_loss_fn(_weighted_loss)
  return trainer


def test_accumulation_is_the_exact_mean_over_micro_batches():
  rs = np.random.RandomState(1)
  x = jnp.asarray(rs.normal(size=(2, 4, 3)), jnp.float32)
  # Micro-batches with 1 and 4 weighted rows: a mean of means would differ.
  weights = jnp.array([[1.0, 0, 0, 0], [1.0, 1, 1, 1]])
  accumulated = _trainer(2)
  step, _ = accumulated.jit_train_and_eval_step()
  for i in range(2):
    step({"x": x[i], "weights": weights[i]})
  whole = _trainer(1)
  step, _ = whole.jit_train_and_eval_step()
  step({"x": x.reshape(8, 3), "weights": weights.reshape(8)})
  np.testing.assert_allclose(
      accumulated.model.w.value, whole.model.w.value, rtol=1e-6
  )
  assert not np.allclose(whole.model.w.value, _Linear().w.value)


def test_two_grpo_steps_inside_a_real_rlcluster():
  tokenizer = tasks.CharTokenizer()
  policy = tiny_models.tiny_qwen3(tokenizer.vocab_size, seed=0, num_layers=1)
  before = jax.tree.map(np.array, nnx.state(policy, nnx.Param))
  mesh = rl_common.rl_mesh(None)
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=4,
      max_prompt_length=10,
      temperature=1.0,
      top_p=None,
  )
  cluster = cluster_lib.BlockDiffusionRLCluster(
      actor=policy,
      reference=nnx.clone(policy),
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
          rollout_engine=functools.partial(
              engine_lib.BlockDiffusionRollout, block_size=4, threshold=0.5
          ),
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=optax.adam(1e-2),
              eval_every_n_steps=1000,
              max_steps=2,
              mini_batch_size=2,
              train_micro_batch_size=1,
          ),
          rollout_config=rollout_config,
      ),
  )
  assert isinstance(cluster.actor_trainer, trainer_lib.BlockDiffusionRLTrainer)
  calls = []

  def reward(prompts, completions, **unused):
    calls.append(len(completions))
    return [float(len(c)) for c in completions]

  learner = learners.BlockDiffusionGRPOLearner(
      cluster,
      grpo.BlockDiffusionGRPOConfig(
          num_generations=2, num_iterations=2, beta=0.04
      ),
      reward_fns=[reward],
  )
  assert learner.algo_config.denoise_config == cluster.rollout.score_config
  data = [{"prompts": np.array(["rev 12>", "rev 345>"])} for _ in range(3)]
  with mesh:
    learner.train(data)
  assert cluster.actor_trainer.train_steps == 2
  after = nnx.state(cluster.actor_trainer.model, nnx.Param)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, after)
  assert any(jax.tree.leaves(changed))
  # One rollout batch of 2 prompts x 2 generations, trained twice
  # (num_iterations=2): the first iteration's ratio is 1 (old = rollout
  # policy), the second's is not.
  assert sum(calls) == 4
  logger = cluster.actor_trainer.metrics_logger
  ratios = logger.get_metric_history("actor", "is_ratio/mean", "train")
  assert abs(float(ratios[0]) - 1.0) < 1e-5
  assert float(ratios[1]) != pytest.approx(1.0, abs=1e-6)
  assert np.all(np.isfinite(logger.get_metric_history("actor", "kl", "train")))


def test_splash_scores_keep_the_ratio_one_and_equal_dense(monkeypatch):
  """Old log-probs and the loss's, both through Splash (interpret mode).

  Prompts 16 wide and 48 new tokens: scored rows of 64, their two-stream
  call 128 slots (one tile). The cluster-side scorer and the loss use the
  same kernels, so the ratio is 1 (as on dense masks); the Splash scores
  equal the dense ones.
  """
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff.models import flash  # pylint: disable=g-import-not-at-top

  scopes = []
  branch = flash.splash_branch
  monkeypatch.setattr(flash, "splash_branch",
                      lambda *a, **k: scopes.append(1) or branch(*a, **k))
  splash = config_lib.AttentionConfig("splash")
  prompts, prompt_mask, tokens, steps = _trajectories(
      seed=1, width=16, num_new=48)
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  with mesh:
    old = likelihood.score_trajectories_jit(
        _model(), prompts, prompt_mask, tokens, steps, CONFIG,
        attention=splash)
  dense = likelihood.score_trajectories_jit(
      _model(), prompts, prompt_mask, tokens, steps, CONFIG)
  committed = steps >= 0
  np.testing.assert_allclose(np.asarray(old)[committed],
                             np.asarray(dense)[committed], atol=1e-4)
  example = grpo.BlockDiffusionTrainExample(
      prompt_ids=jnp.asarray(prompts),
      prompt_mask=jnp.asarray(prompt_mask),
      completion_ids=jnp.asarray(tokens),
      completion_mask=jnp.asarray(committed.astype(np.int32)),
      advantages=jnp.array([1.0, -1.0, 0.5, -0.5]),
      ref_per_token_logps=None,
      old_per_token_logps=old,
      commit_step=jnp.asarray(steps),
  )
  algo = _algo(num_iterations=2, beta=0.0, attention=splash)
  loss_fn = function_registry.get_policy_loss_fn("bd_grpo")

  @nnx.jit
  def ratios(model):
    metrics = loss_fn(model, example, algo).aux_metrics
    return metrics["is_ratio/max"], metrics["is_ratio/min"]

  with mesh:
    ratio_max, ratio_min = map(float, ratios(_model()))
  assert ratio_max == pytest.approx(1.0, abs=1e-5)
  assert ratio_min == pytest.approx(1.0, abs=1e-5)
  assert len(scopes) == 2  # the scorer's trace and the loss's took Splash


def test_the_learner_takes_the_engines_attention_and_refuses_another():
  splash = config_lib.AttentionConfig("splash")
  engine = type("Engine", (), {"score_config": CONFIG, "attention": splash})
  cluster = type("Cluster", (), {"rollout": engine})
  algo = _algo()
  learners.TraceLearnerMixin._fill_denoise_config(algo, cluster)
  assert algo.attention == splash
  other = _algo(attention=config_lib.AttentionConfig("auto"))
  with pytest.raises(ValueError, match="attention"):
    learners.TraceLearnerMixin._fill_denoise_config(other, cluster)
  with pytest.raises(TypeError, match="attention"):
    _algo(attention="splash")
