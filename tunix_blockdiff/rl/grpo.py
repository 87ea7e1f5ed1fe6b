"""GRPO with a block-diffusion policy: the `bd_grpo` loss and its learner.

Tunix's GRPO scores the policy by causal teacher forcing, which is not the
probability of a block-diffusion rollout. Here every log-prob (policy, old
policy, reference) comes from the trajectory-exact scorer
(`rl.scoring`), which rebuilds each denoising step's canvas from the commit
steps the rollout recorded, under the config's `likelihood`
(`rl.likelihood`): `exact` (default) per-token shares of the trajectory's
exact log-prob, selection events included, so the policy gradient is that of
the distribution the rollouts come from; or `committed_only`, the committed
tokens' probabilities alone. The pieces:

* `bd_grpo_loss_fn`, registered as Tunix policy loss `bd_grpo` (by
  `tunix_blockdiff.register()`): the clipped GRPO/PPO surrogate plus the
  optional KL penalty, over the scorer's log-probs; it returns a
  `LossOutput` (summed loss and its denominator) so gradient accumulation is
  exact (`BlockDiffusionRLTrainer`).
* `BlockDiffusionGRPOLearner`: Tunix's `GRPOLearner` whose rollout step keeps
  the denoising trace in the train example and asks the cluster for
  trajectory-exact reference and old-policy log-probs.

Use it with `BlockDiffusionRLCluster` and the `BlockDiffusionRollout` engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import common
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rollout import engine as engine_lib

LOSS_AGG_MODES = (
    "token-mean",
    "sequence-mean-token-mean",
    "seq-mean-token-sum",
)
LOG_RATIO_CLIP = 20.0


@flax.struct.dataclass(frozen=True)
class BlockDiffusionTrainExample(common.TrainExample):
  """Tunix's `TrainExample` plus the rollout's denoising trace.

  `completion_ids` holds the trace tokens (every committed token, also those
  committed after EOS in its block) and `completion_mask` the slots that
  count in the loss.

  Attributes:
    commit_step: int32 [B, N] step that committed each slot, -1 where none.
    teacher_logits: Optional float32 [B, N, V] teacher logits (OPD, full
      distribution).
    teacher_per_token_logps: Optional float32 [B, N] teacher log-probs of
      the completion tokens (OPD, sampled token).
  """

  commit_step: jax.Array | None = None
  teacher_logits: jax.Array | None = None
  teacher_per_token_logps: jax.Array | None = None


@dataclasses.dataclass(kw_only=True)
class BlockDiffusionGRPOConfig(grpo_learner.GRPOConfig):
  """`GRPOConfig` for block-diffusion policies.

  Attributes:
    policy_loss_fn: Default `bd_grpo`.
    denoise_config: The rollout's `DenoiseConfig` (what the scorer rebuilds
      and scores under); `BlockDiffusionGRPOLearner` fills it from the
      rollout engine when None and rejects a different one.
    likelihood: `exact` (default; needs sampled rollouts, temperature > 0)
      or `committed_only` (the committed tokens' probabilities only, biased).
      Token-level terms: each token's proposal log-prob plus an even share
      of its step's selection log-prob (`rl.selection`).
  """

  policy_loss_fn: str = "bd_grpo"
  denoise_config: config_lib.DenoiseConfig | None = None
  likelihood: str = "exact"

  def __post_init__(self):
    super().__post_init__()
    if self.loss_agg_mode not in LOSS_AGG_MODES:
      raise ValueError(
          f"loss_agg_mode must be one of {LOSS_AGG_MODES} (each is an exact"
          f" sum / denominator), got {self.loss_agg_mode!r}"
      )
    if self.loss_algo != "grpo":
      raise ValueError(
          "loss_algo must be 'grpo' for block-diffusion GRPO, got"
          f" {self.loss_algo!r}"
      )
    if self.denoise_config is not None and not isinstance(
        self.denoise_config, config_lib.DenoiseConfig
    ):
      raise TypeError(
          "denoise_config must be a DenoiseConfig, got"
          f" {type(self.denoise_config).__name__}"
      )
    likelihood_lib.check_likelihood(self.likelihood, self.denoise_config)


def aggregate(
    per_token: jax.Array, mask: jax.Array, mode: str
) -> compat.WeightedMetric:
  """Exact `WeightedMetric` (sum, denominator) of a per-token quantity.

  Args:
    per_token: float [B, N].
    mask: float/bool [B, N] slots that count.
    mode: `token-mean` (sum over tokens / tokens), `sequence-mean-token-mean`
      (sum over rows of the row's token mean / non-empty rows) or
      `seq-mean-token-sum` (sum over rows of the row's token sum / non-empty
      rows). Summing sums and denominators over micro-batches gives the mean
      over the whole batch in every mode.
  """
  mask = mask.astype(jnp.float32)
  masked = jnp.where(mask > 0, per_token * mask, 0.0)
  row_tokens = jnp.sum(mask, axis=-1)
  rows = jnp.sum((row_tokens > 0).astype(jnp.float32))
  if mode == "token-mean":
    return compat.WeightedMetric(jnp.sum(masked), jnp.sum(mask))
  if mode == "sequence-mean-token-mean":
    row_mean = jnp.sum(masked, axis=-1) / jnp.maximum(row_tokens, 1.0)
    return compat.WeightedMetric(jnp.sum(row_mean), rows)
  if mode == "seq-mean-token-sum":
    return compat.WeightedMetric(jnp.sum(masked), rows)
  raise ValueError(
      f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}"
  )


def require_trace(train_example) -> jax.Array:
  """The example's commit steps int [B, N], or a clear error if absent."""
  commit_step = getattr(train_example, "commit_step", None)
  if commit_step is None:
    raise ValueError(
        "train_example has no commit_step: block-diffusion losses need the"
        " rollout's denoising trace (train with BlockDiffusionGRPOLearner and"
        " BlockDiffusionRLCluster)"
    )
  return commit_step


def require_denoise_config(algo_config) -> config_lib.DenoiseConfig:
  """`algo_config.denoise_config`, or a clear error if it is not set."""
  config = getattr(algo_config, "denoise_config", None)
  if not isinstance(config, config_lib.DenoiseConfig):
    raise ValueError(
        "algo_config.denoise_config must be the rollout's DenoiseConfig"
        " (BlockDiffusionGRPOLearner fills it from the rollout engine)"
    )
  return config


def policy_log_probs(
    model,
    train_example,
    config: config_lib.DenoiseConfig,
    likelihood: str = "exact",
):
  """Differentiable per-token log-probs and entropies, each float32 [B, N].

  Under `likelihood` (`rl.likelihood.per_token_logps`).
  """
  batch = scoring.prepare_trajectory_batch(
      train_example.prompt_ids,
      train_example.prompt_mask,
      train_example.completion_ids,
      require_trace(train_example),
      mask_token_id=config.mask_token_id,
      loss_weights=train_example.completion_mask,
  )
  return likelihood_lib.per_token_logps(
      model,
      batch,
      config,
      likelihood=likelihood,
      stop_gradient=False,
      return_entropy=True,
  )


def bd_grpo_loss_fn(
    model,
    train_example,
    algo_config,
    pad_id: int | None = None,
    eos_id: int | None = None,
    **kwargs,
) -> compat.LossOutput:
  """GRPO policy loss of a block-diffusion policy (Tunix policy-loss API).

  Per committed token t of row i, with the trajectory-exact log-prob
  `logp` (differentiable; under `algo_config.likelihood`, with `exact` the
  token's share of its trajectory's exact log-prob), the old policy's `old` (the train example's, or
  `stop_gradient(logp)` when absent, as in Tunix: then the ratio is exactly
  1) and the row advantage `A`:
  `loss_t = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)) + beta KL_t`,
  `r = exp(clip(logp - old, +-20))`, KL by `algo_config.kl_loss_mode`
  against the reference log-probs (when present).

  Args:
    model: The policy (Tunix causal LM used as block-diffusion model).
    train_example: `BlockDiffusionTrainExample`.
    algo_config: `BlockDiffusionGRPOConfig` (epsilon, epsilon_high, beta,
      kl_loss_mode, kl_clamp_value, loss_agg_mode, denoise_config).
    pad_id: Unused (kept for Tunix's policy-loss signature).
    eos_id: Unused.
    **kwargs: Unused.

  Returns:
    `LossOutput`: `primary_loss` = WeightedMetric(sum, denominator) of the
    aggregated loss; aux metrics `kl`, `pg_clipfrac`, `ppo_kl`,
    `is_ratio/mean`, `is_ratio/max`, `is_ratio/min`, `entropy`, `pg_loss`.
  """
  del pad_id, eos_id, kwargs
  config = require_denoise_config(algo_config)
  mode = algo_config.loss_agg_mode
  epsilon = algo_config.epsilon
  epsilon_high = getattr(algo_config, "epsilon_high", None) or epsilon
  logps, entropy = policy_log_probs(
      model, train_example, config, getattr(algo_config, "likelihood", "exact")
  )
  mask = train_example.completion_mask.astype(jnp.float32)
  active = mask > 0
  if train_example.old_per_token_logps is None:
    old = jax.lax.stop_gradient(logps)
  else:
    old = train_example.old_per_token_logps.astype(jnp.float32)
  log_ratio = jnp.clip(logps - old, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
  ratio = jnp.exp(log_ratio)
  advantages = train_example.advantages.astype(jnp.float32)
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
  pg_per_token = jnp.maximum(unclipped, clipped)
  per_token = pg_per_token
  aux = {
      "pg_loss": aggregate(pg_per_token, mask, mode),
      "pg_clipfrac": aggregate(
          (clipped > unclipped).astype(jnp.float32), mask, "token-mean"
      ),
      "ppo_kl": aggregate(-log_ratio, mask, "token-mean"),
      "is_ratio/mean": aggregate(ratio, mask, "token-mean"),
      "is_ratio/max": jnp.max(jnp.where(active, ratio, -jnp.inf)),
      "is_ratio/min": jnp.min(jnp.where(active, ratio, jnp.inf)),
      "entropy": aggregate(entropy, mask, "token-mean"),
      "kl": compat.WeightedMetric(jnp.zeros(()), jnp.zeros(())),
  }
  if train_example.ref_per_token_logps is not None:
    kl = common.compute_kl_divergence(
        logps,
        train_example.ref_per_token_logps,
        algo_config.kl_loss_mode,
        clamp_value=getattr(algo_config, "kl_clamp_value", None),
    )
    aux["kl"] = aggregate(kl, mask, "token-mean")
    if algo_config.beta:
      per_token = per_token + algo_config.beta * kl
  return compat.LossOutput(
      primary_loss=aggregate(per_token, mask, mode), aux_metrics=aux
  )


class TraceLearnerMixin:
  """Rollout -> `BlockDiffusionTrainExample` plumbing shared by GRPO and OPD."""

  rl_cluster: cluster_lib.BlockDiffusionRLCluster

  def _check_cluster(self, rl_cluster) -> None:
    if not isinstance(rl_cluster, cluster_lib.BlockDiffusionRLCluster):
      raise TypeError(
          f"{type(self).__name__} needs a BlockDiffusionRLCluster, got"
          f" {type(rl_cluster).__name__}"
      )

  @staticmethod
  def _fill_denoise_config(algo_config, rl_cluster) -> None:
    rollout_config = rl_cluster.rollout.score_config
    if algo_config.denoise_config is None:
      algo_config.denoise_config = rollout_config
    elif algo_config.denoise_config != rollout_config:
      raise ValueError(
          "algo_config.denoise_config differs from the rollout engine's"
          f" TRAIN config {rollout_config}; the scorer must rebuild the"
          " rollout's own distribution"
      )
    likelihood_lib.check_likelihood(
        getattr(algo_config, "likelihood", "exact"), rollout_config
    )

  def _rollout(self, training_input, mode):
    training_input["prompts"] = list(training_input["prompts"])
    output = self.rl_cluster.generate(
        prompts=training_input["prompts"],
        mode=mode,
        micro_batch_size=(
            self._rollout_micro_batch_size * self._num_generations()
        ),
    )
    prompt_ids = np.asarray(output.left_padded_prompt_tokens, np.int32)
    prompt_mask = engine_lib.prompt_mask_from_tokens(
        prompt_ids, self.rl_cluster.rollout.pad_id()
    )
    commit_step = np.asarray(output.commit_steps, np.int32)
    return output, prompt_ids, prompt_mask, commit_step

  def _log_rollout_metrics(self, output, rewards, mode) -> None:
    lengths = np.array([len(t) for t in output.tokens], np.float32)
    steps = np.asarray(output.commit_steps)
    self.rl_cluster.buffer_metrics(
        {
            "rewards/score/mean": (np.mean(rewards), np.mean),
            "rewards/score/max": (np.max(rewards), np.max),
            "rewards/score/min": (np.min(rewards), np.min),
            "completions/mean_length": (np.mean(lengths), np.mean),
            "completions/max_length": (np.max(lengths), np.max),
            "completions/min_length": (np.min(lengths), np.min),
            "rollout/denoising_steps": (float(steps.max() + 1), np.mean),
        },
        mode=mode,
    )


class BlockDiffusionGRPOLearner(TraceLearnerMixin, grpo_learner.GRPOLearner):
  """Tunix `GRPOLearner` for block-diffusion policies (see module docstring).

  Same constructor as `GRPOLearner`; `rl_cluster` must be a
  `BlockDiffusionRLCluster` and `algo_config` a `BlockDiffusionGRPOConfig`.
  """

  def __init__(
      self,
      rl_cluster: cluster_lib.BlockDiffusionRLCluster,
      algo_config: BlockDiffusionGRPOConfig,
      reward_fns,
      metric_fns: Sequence[Any] | None = None,
      data_shuffle_seed: int | None = None,
  ):
    # Registration makes `bd_grpo` visible to GRPOLearner's registry lookup.
    from tunix_blockdiff import registration  # pylint: disable=g-import-not-at-top

    registration.register()
    self._check_cluster(rl_cluster)
    if not isinstance(algo_config, BlockDiffusionGRPOConfig):
      raise TypeError(
          "algo_config must be a BlockDiffusionGRPOConfig, got"
          f" {type(algo_config).__name__}"
      )
    if rl_cluster.cluster_config.training_config.max_seq_token_per_tpu:
      raise ValueError(
          "sequence packing (max_seq_token_per_tpu) is not supported with"
          " block-diffusion rollouts"
      )
    self._fill_denoise_config(algo_config, rl_cluster)
    super().__init__(
        rl_cluster=rl_cluster,
        algo_config=algo_config,
        reward_fns=reward_fns,
        metric_fns=metric_fns,
        data_shuffle_seed=data_shuffle_seed,
    )
    self.rl_cluster.actor_trainer.with_rl_metrics_to_log({
        "kl": np.mean,
        "pg_clipfrac": np.mean,
        "is_ratio/mean": np.mean,
        "entropy": np.mean,
    })

  def _generate_and_compute_advantage(
      self,
      training_input,
      mode: rl_cluster_lib.Mode = rl_cluster_lib.Mode.TRAIN,
  ) -> BlockDiffusionTrainExample:
    """Rolls out, scores reference/old policy on the trace, and computes A."""
    output, prompt_ids, prompt_mask, commit_step = self._rollout(
        training_input, mode
    )
    trace_tokens = np.asarray(output.trace_tokens, np.int32)
    micro = self._compute_logps_micro_batch_size * self._num_generations()
    ref_logps = None
    if self.algo_config.beta != 0.0:
      ref_logps = self.rl_cluster.get_ref_per_token_logps(
          prompt_ids,
          trace_tokens,
          micro_batch_size=micro,
          commit_step=commit_step,
          likelihood=self.algo_config.likelihood,
      )
    old_logps = None
    if self.algo_config.num_iterations > 1:
      old_logps = self.rl_cluster.get_old_per_token_logps(
          prompt_ids,
          trace_tokens,
          micro_batch_size=micro,
          commit_step=commit_step,
          likelihood=self.algo_config.likelihood,
      )
    rewards = self._compute_rewards(
        prompts=training_input["prompts"],
        completions=output.text,
        mode=mode,
        **{k: v for k, v in training_input.items() if k != "prompts"},
    )
    advantages = function_registry.get_advantage_estimator(
        self.algo_config.advantage_estimator
    )(rewards=rewards, num_generations=self.algo_config.num_generations)
    self._log_rollout_metrics(output, rewards, mode)
    for metric_fn in self.metric_fns:
      self.rl_cluster.buffer_metrics(
          metric_fn(
              prompts=training_input["prompts"],
              completions=output.text,
              advantages=advantages,
              rewards=rewards,
              **{k: v for k, v in training_input.items() if k != "prompts"},
          ),
          mode=mode,
      )
    return BlockDiffusionTrainExample(
        prompt_ids=jnp.asarray(prompt_ids),
        prompt_mask=jnp.asarray(prompt_mask),
        completion_ids=jnp.asarray(trace_tokens),
        completion_mask=jnp.asarray((commit_step >= 0).astype(np.int32)),
        advantages=jnp.asarray(advantages, jnp.float32),
        ref_per_token_logps=ref_logps,
        old_per_token_logps=old_logps,
        commit_step=jnp.asarray(commit_step),
    )


__all__ = [
    "BlockDiffusionGRPOConfig",
    "BlockDiffusionGRPOLearner",
    "BlockDiffusionTrainExample",
    "LOSS_AGG_MODES",
    "TraceLearnerMixin",
    "aggregate",
    "bd_grpo_loss_fn",
    "policy_log_probs",
    "require_denoise_config",
    "require_trace",
]
