"""Tunix RL learners over block-diffusion rollouts.

`TraceLearnerMixin` turns a rollout's denoising trace into the train example
the block-diffusion losses score (shared by GRPO and OPD);
`BlockDiffusionGRPOLearner` is Tunix's `GRPOLearner` with that plumbing and
the `bd_grpo` loss (`rl/grpo.py`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

from tunix_blockdiff import arrays
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.rl import engine as engine_lib


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
    # One attention for the engine's old/reference scores and the loss's.
    engine_attention = getattr(rl_cluster.rollout, "attention", None)
    if getattr(algo_config, "attention", None) is None:
      algo_config.attention = engine_attention
    elif algo_config.attention != engine_attention:
      raise ValueError(
          f"algo_config.attention {algo_config.attention} differs from the"
          f" rollout engine's {engine_attention}; the loss and the old"
          " log-probs must come from the same attention kernels")

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
      algo_config: grpo.BlockDiffusionGRPOConfig,
      reward_fns,
      metric_fns: Sequence[Any] | None = None,
      data_shuffle_seed: int | None = None,
  ):
    # Registration makes `bd_grpo` visible to GRPOLearner's registry lookup.
    from tunix_blockdiff import registration  # pylint: disable=g-import-not-at-top

    registration.register()
    self._check_cluster(rl_cluster)
    if not isinstance(algo_config, grpo.BlockDiffusionGRPOConfig):
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
  ) -> grpo.BlockDiffusionTrainExample:
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
    return grpo.BlockDiffusionTrainExample(
        prompt_ids=arrays.asarray(prompt_ids),
        prompt_mask=arrays.asarray(prompt_mask),
        completion_ids=arrays.asarray(trace_tokens),
        completion_mask=arrays.asarray((commit_step >= 0).astype(np.int32)),
        advantages=arrays.asarray(advantages, jnp.float32),
        ref_per_token_logps=ref_logps,
        old_per_token_logps=old_logps,
        commit_step=arrays.asarray(commit_step),
    )


__all__ = ["BlockDiffusionGRPOLearner", "TraceLearnerMixin"]
