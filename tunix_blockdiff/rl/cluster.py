"""`BlockDiffusionRLCluster`: Tunix's `RLCluster` for block-diffusion policies.

Three differences from `RLCluster`, all needed because a block-diffusion
policy's log-probs depend on the order its tokens were committed:

* `generate` keeps each rollout's denoising trace (`RLCluster.generate`
  rebuilds a plain `RolloutOutput` from the engine's micro-batch outputs and
  would drop it) and returns a `BlockDiffusionRolloutOutput`.
* Reference and old-policy log-probs take the trace's `commit_step` and are
  computed by the trajectory-exact scorer under the learner's likelihood
  (`rl.likelihood`), not by causal teacher forcing.
* The actor trainer is `BlockDiffusionRLTrainer` (exact, denominator-aware
  gradient accumulation of `LossOutput` losses).

The rollout engine must be `BlockDiffusionRollout` (or a partial of it).
"""

from __future__ import annotations

import copy
import os

from absl import logging
import jax.numpy as jnp
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils

from tunix_blockdiff.rl import trainer as rl_trainer_lib
from tunix_blockdiff.rl import engine as engine_lib

Role = rl_cluster_lib.Role
Mode = rl_cluster_lib.Mode


class BlockDiffusionRLCluster(rl_cluster_lib.RLCluster):
  """`RLCluster` whose rollout, reference and old-policy scores are diffusion.

  Same constructor as `RLCluster`; `cluster_config.rollout_engine` must be
  `BlockDiffusionRollout` or a `functools.partial` of it. Subclasses for
  other engines (`kinds.diffusion_gemma.cluster`) set `rollout_types` and
  `_concat_records`.
  """

  rollout_types: tuple[type, ...] = (engine_lib.BlockDiffusionRollout,)

  def _init_cluster(self):
    # RLCluster's own actor trainer is replaced below, so it must not restore
    # a checkpoint (its optimizer is an optax.MultiSteps, the replacement's
    # is not: the states differ); the replacement restores instead.
    config = self.cluster_config.training_config
    root = config.checkpoint_root_directory
    config.checkpoint_root_directory = None
    try:
      super()._init_cluster()
    finally:
      config.checkpoint_root_directory = root
    if not isinstance(self._rollout, self.rollout_types):
      names = " or ".join(t.__name__ for t in self.rollout_types)
      raise TypeError(
          f"{type(self).__name__} needs cluster_config.rollout_engine ="
          f" {names} (or a functools.partial of it), got"
          f" {type(self._rollout).__name__}"
      )
    self._replace_actor_trainer(
        None if root is None else os.path.join(root, "actor")
    )

  def _replace_actor_trainer(self, checkpoint_directory: str | None) -> None:
    """Rebuilds the actor trainer as a `BlockDiffusionRLTrainer`.

    Same model, optimizer transformation, config, logger, tracers and
    checkpoint metadata as the trainer `RLCluster` built; it checkpoints to
    (and restores from) `checkpoint_directory` (RLCluster's `<root>/actor`).
    """
    old = self._actor_trainer
    training_config = copy.copy(self.cluster_config.training_config)
    training_config.metrics_prefix = old.config.metrics_prefix
    training_config.pbar_description = old.config.pbar_description
    training_config.checkpoint_root_directory = checkpoint_directory
    with self._get_mesh_and_logical_axis_rules_cm(Role.ACTOR):
      self._actor_trainer = rl_trainer_lib.BlockDiffusionRLTrainer(
          model=old.model,
          optimizer=self.cluster_config.training_config.actor_optimizer,
          training_config=training_config,
          custom_checkpoint_metadata_fn=old.custom_checkpoint_metadata_fn,
          metrics_logger=self._rl_metrics_logger,
          perf_tracer=self._perf,
          perf_tracer_v2=self._perf_v2,
      )
    try:
      old.checkpoint_manager.close()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("closing the replaced trainer's checkpointer: %s", e)

  @property
  def rollout(self) -> engine_lib.BlockDiffusionRollout:
    return self._rollout

  def generate(
      self, prompts, *args, **kwargs
  ) -> engine_lib.BlockDiffusionRolloutOutput:
    """`RLCluster.generate`, keeping every rollout's denoising trace.

    Same arguments as `RLCluster.generate`.

    Returns:
      `BlockDiffusionRolloutOutput` for all prompts, in order.
    """
    with self.rollout.record_outputs() as records:
      merged = super().generate(prompts, *args, **kwargs)
    output = self._concat_records(records)
    if output.text != merged.text:
      raise RuntimeError("recorded rollout outputs do not match RLCluster's")
    return output

  def _concat_records(self, records):
    """The engine's micro-batch outputs as one output (keeps the trace)."""
    return engine_lib.concat_outputs(records, pad_id=self.rollout.pad_id())

  def _score(
      self,
      model,
      prompt_tokens,
      completion_tokens,
      commit_step,
      micro_batch_size,
      likelihood,
      role,
  ):
    if commit_step is None:
      raise ValueError(
          "commit_step is required: block-diffusion log-probs are computed"
          " from each rollout's denoising trace"
      )
    prompt_tokens = np.asarray(prompt_tokens)
    batch_size = prompt_tokens.shape[0]
    if batch_size == 0:
      raise ValueError("cannot score an empty batch")
    completion_tokens = np.asarray(completion_tokens)
    commit_step = np.asarray(commit_step)
    outs = []
    for rows in rl_utils.chunk_slices_by_size(
        stop=batch_size, step=micro_batch_size or batch_size
    ):
      # Rows sharded over the rollout mesh's fsdp axis, results gathered.
      outs.append(
          self.rollout.score(
              model,
              prompt_tokens[rows],
              completion_tokens[rows],
              commit_step[rows],
              likelihood=likelihood,
              mesh=self.r2m[role],
          )
      )
    return jnp.concatenate(outs, axis=0)

  def get_ref_per_token_logps(
      self,
      prompt_tokens,
      completion_tokens,
      pad_id: int | None = None,
      eos_id: int | None = None,
      micro_batch_size: int | None = None,
      *,
      commit_step=None,
      likelihood: str = "exact",
  ):
    """Reference-model trajectory log-probs float32 [B, N].

    Args:
      prompt_tokens: int [B, P] left-padded prompts.
      completion_tokens: int [B, N] trace tokens.
      pad_id: Unused (the rollout's pad id is used).
      eos_id: Unused.
      micro_batch_size: Rows per scoring call.
      commit_step: int [B, N] commit steps; required.
      likelihood: `exact` or `committed_only` (`rl.likelihood`).
    """
    del pad_id, eos_id
    with self._get_mesh_and_logical_axis_rules_cm(Role.REFERENCE):
      model = self.inference_worker.get_model("reference")
      if model is None:
        raise ValueError("the cluster has no reference model")
      self._maybe_load_model_from_cpu(model, Role.REFERENCE)
      out = self._score(
          model,
          prompt_tokens,
          completion_tokens,
          commit_step,
          micro_batch_size,
          likelihood,
          Role.REFERENCE,
      )
      self._maybe_offload_model_to_cpu(model, Role.REFERENCE)
      return out

  def get_old_per_token_logps(
      self,
      prompt_tokens,
      completion_tokens,
      micro_batch_size: int | None = None,
      *,
      commit_step=None,
      likelihood: str = "exact",
  ):
    """Rollout-policy (old policy) trajectory log-probs float32 [B, N].

    Args:
      prompt_tokens: int [B, P] left-padded prompts.
      completion_tokens: int [B, N] trace tokens.
      micro_batch_size: Rows per scoring call.
      commit_step: int [B, N] commit steps; required.
      likelihood: `exact` or `committed_only` (`rl.likelihood`).
    """
    with self._get_mesh_and_logical_axis_rules_cm(Role.ROLLOUT):
      model = self.rollout.model()
      self._maybe_load_model_from_cpu(model, Role.ROLLOUT)
      out = self._score(
          model,
          prompt_tokens,
          completion_tokens,
          commit_step,
          micro_batch_size,
          likelihood,
          Role.ROLLOUT,
      )
      self._maybe_offload_model_to_cpu(model, Role.ROLLOUT)
      return out
