"""`DiffusionGemmaGRPOLearner`: Tunix's `GRPOLearner` on DiffusionGemma.

Used like `BlockDiffusionGRPOLearner`:

    cluster = DiffusionGemmaRLCluster(actor=..., reference=..., tokenizer=...,
        cluster_config=ClusterConfig(rollout_engine=functools.partial(
            DiffusionGemmaRollout, sampler_config=...), ...))
    learner = DiffusionGemmaGRPOLearner(
        cluster, DiffusionGemmaGRPOConfig(num_generations=4), reward_fns=[...])
    learner.train(dataset)

Its rollout step keeps each rollout's `DiffusionGemmaTrace` in the train
example and asks the cluster for trajectory-exact sequence log-probs of the
reference (when `beta != 0`) and of the rollout policy (when
`num_iterations > 1`); the loss is `dg_grpo` (`kinds/diffusion_gemma/grpo.py`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

from tunix_blockdiff import arrays
from tunix_blockdiff.kinds.diffusion_gemma import cluster as cluster_lib
from tunix_blockdiff.kinds.diffusion_gemma import grpo as dg_grpo
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout


class DiffusionGemmaGRPOLearner(grpo_learner.GRPOLearner):
  """Tunix `GRPOLearner` for DiffusionGemma policies (see module docstring).

  Same constructor as `GRPOLearner`; `rl_cluster` must be a
  `DiffusionGemmaRLCluster` and `algo_config` a `DiffusionGemmaGRPOConfig`.
  """

  def __init__(self, rl_cluster: cluster_lib.DiffusionGemmaRLCluster,
               algo_config: dg_grpo.DiffusionGemmaGRPOConfig, reward_fns,
               metric_fns: Sequence[Any] | None = None,
               data_shuffle_seed: int | None = None):
    # Registration makes `dg_grpo` visible to GRPOLearner's registry lookup.
    from tunix_blockdiff import registration  # pylint: disable=g-import-not-at-top

    registration.register()
    if not isinstance(rl_cluster, cluster_lib.DiffusionGemmaRLCluster):
      raise TypeError(
          "rl_cluster must be a DiffusionGemmaRLCluster, got"
          f" {type(rl_cluster).__name__}")
    if not isinstance(algo_config, dg_grpo.DiffusionGemmaGRPOConfig):
      raise TypeError(
          "algo_config must be a DiffusionGemmaGRPOConfig, got"
          f" {type(algo_config).__name__}")
    if rl_cluster.cluster_config.training_config.max_seq_token_per_tpu:
      raise ValueError(
          "sequence packing (max_seq_token_per_tpu) is not supported with"
          " DiffusionGemma rollouts")
    engine_config = rl_cluster.rollout.sampler_config
    if algo_config.sampler_config is None:
      algo_config.sampler_config = engine_config
    elif algo_config.sampler_config != engine_config:
      raise ValueError(
          "algo_config.sampler_config differs from the rollout engine's"
          f" {engine_config}; the scorer must replay the rollout's own"
          " distribution")
    # One attention for the engine's old/reference scores and the loss's.
    engine = rl_cluster.rollout
    if algo_config.splash_tile is None:
      algo_config.splash_tile = engine.splash_tile
      algo_config.splash_interpret = engine.splash_interpret
    elif algo_config.splash_tile != engine.splash_tile:
      raise ValueError(
          f"algo_config.splash_tile {algo_config.splash_tile} differs from"
          f" the rollout engine's {engine.splash_tile}; the loss and the old"
          " log-probs must come from the same attention kernels")
    super().__init__(rl_cluster=rl_cluster, algo_config=algo_config,
                     reward_fns=reward_fns, metric_fns=metric_fns,
                     data_shuffle_seed=data_shuffle_seed)
    self.rl_cluster.actor_trainer.with_rl_metrics_to_log({
        "kl": np.mean,
        "pg_clipfrac": np.mean,
        "is_ratio/mean": np.mean,
        "sequence_logp": np.mean,
    })

  def _generate_and_compute_advantage(
      self, training_input,
      mode: rl_cluster_lib.Mode = rl_cluster_lib.Mode.TRAIN,
  ) -> dg_grpo.DiffusionGemmaTrainExample:
    """Rolls out, scores reference/old policy on the traces, computes A."""
    training_input["prompts"] = list(training_input["prompts"])
    output = self.rl_cluster.generate(
        prompts=training_input["prompts"], mode=mode,
        micro_batch_size=(self._rollout_micro_batch_size
                          * self._num_generations()))
    prompt_ids = np.asarray(output.left_padded_prompt_tokens, np.int32)
    prompt_mask = dg_rollout.valid_mask(prompt_ids.shape[1],
                                        output.prompt_lengths)
    trace = output.trace
    micro = self._compute_logps_micro_batch_size * self._num_generations()
    ref_logps = None
    if self.algo_config.beta != 0.0:
      ref_logps = self.rl_cluster.get_ref_sequence_logps(
          prompt_ids, prompt_mask, trace, micro_batch_size=micro)
    old_logps = None
    if self.algo_config.num_iterations > 1:
      old_logps = self.rl_cluster.get_old_sequence_logps(
          prompt_ids, prompt_mask, trace, micro_batch_size=micro)
    extra = {k: v for k, v in training_input.items() if k != "prompts"}
    rewards = self._compute_rewards(prompts=training_input["prompts"],
                                    completions=output.text, mode=mode,
                                    **extra)
    advantages = function_registry.get_advantage_estimator(
        self.algo_config.advantage_estimator)(
            rewards=rewards, num_generations=self.algo_config.num_generations)
    self._log_rollout_metrics(output, rewards, mode)
    for metric_fn in self.metric_fns:
      self.rl_cluster.buffer_metrics(
          metric_fn(prompts=training_input["prompts"],
                    completions=output.text, advantages=advantages,
                    rewards=rewards, **extra), mode=mode)
    lengths = np.array([len(t) for t in output.tokens])
    completion_mask = (np.arange(trace.tokens.shape[1])[None]
                       < lengths[:, None])
    return dg_grpo.DiffusionGemmaTrainExample(
        prompt_ids=arrays.asarray(prompt_ids),
        prompt_mask=arrays.asarray(prompt_mask),
        completion_ids=arrays.asarray(trace.tokens),
        completion_mask=arrays.asarray(completion_mask.astype(np.int32)),
        advantages=arrays.asarray(advantages, jnp.float32),
        ref_per_token_logps=ref_logps,
        old_per_token_logps=old_logps,
        trace=jax.tree.map(arrays.asarray, trace),
    )

  def _log_rollout_metrics(self, output, rewards, mode) -> None:
    lengths = np.array([len(t) for t in output.tokens], np.float32)
    steps = np.asarray(output.trace.live).sum(-1)       # [B, K]
    active = np.asarray(output.trace.active)
    self.rl_cluster.buffer_metrics({
        "rewards/score/mean": (np.mean(rewards), np.mean),
        "rewards/score/max": (np.max(rewards), np.max),
        "rewards/score/min": (np.min(rewards), np.min),
        "completions/mean_length": (np.mean(lengths), np.mean),
        "rollout/denoising_steps_per_canvas": (
            float(steps[active].mean()) if active.any() else 0.0, np.mean),
        "rollout/sequence_logp": (float(np.mean(output.sequence_logprobs)),
                                  np.mean),
    }, mode=mode)


__all__ = ["DiffusionGemmaGRPOLearner"]
