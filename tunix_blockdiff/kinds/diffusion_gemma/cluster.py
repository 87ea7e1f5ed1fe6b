"""`DiffusionGemmaRLCluster`: `BlockDiffusionRLCluster` for DiffusionGemma.

The same cluster (the `BlockDiffusionRLTrainer` actor trainer, checkpoint
handling, the trace kept through `generate`) with a `DiffusionGemmaRollout`
engine: `generate` returns a `DiffusionGemmaRolloutOutput`, and reference
and old-policy log-probs are sequence-level, the trajectory-exact
`kinds.diffusion_gemma.scoring.sequence_logprobs` of each row's trace, float32
[B].
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import utils as rl_utils

from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib
from tunix_blockdiff.kinds.diffusion_gemma import output as output_lib

Role = cluster_lib.Role


class DiffusionGemmaRLCluster(cluster_lib.BlockDiffusionRLCluster):
  """`RLCluster` over a `DiffusionGemmaRollout` (see module docstring).

  Same constructor as `RLCluster`; `cluster_config.rollout_engine` must be
  `DiffusionGemmaRollout` or a `functools.partial` of it.
  """

  rollout_types = (engine_lib.DiffusionGemmaRollout,)

  @property
  def rollout(self) -> engine_lib.DiffusionGemmaRollout:
    return self._rollout

  def _concat_records(self, records):
    return output_lib.concat_outputs(records)

  def _score_rows(self, model: nnx.Module, prompt_tokens, prompt_mask,
                  trace: output_lib.DiffusionGemmaTrace,
                  micro_batch_size: int | None) -> jax.Array:
    prompt_tokens = np.asarray(prompt_tokens)
    batch_size = prompt_tokens.shape[0]
    if batch_size == 0:
      raise ValueError("cannot score an empty batch")
    if not isinstance(trace, output_lib.DiffusionGemmaTrace):
      raise TypeError(
          "trace must be the rollouts' DiffusionGemmaTrace, got"
          f" {type(trace).__name__}")
    prompt_mask = np.asarray(prompt_mask, bool)
    outs = []
    for rows in rl_utils.chunk_slices_by_size(
        stop=batch_size, step=micro_batch_size or batch_size):
      part = jax.tree.map(lambda x, r=rows: np.asarray(x)[r], trace)
      outs.append(self.rollout.score(model, prompt_tokens[rows],
                                     prompt_mask[rows], part))
    return jnp.concatenate(outs, axis=0)

  def get_ref_sequence_logps(self, prompt_tokens, prompt_mask,
                             trace: output_lib.DiffusionGemmaTrace,
                             micro_batch_size: int | None = None
                             ) -> jax.Array:
    """Reference-model log P of each rollout's trajectories, float32 [B].

    Args:
      prompt_tokens: int [B, P] left-padded prompts.
      prompt_mask: bool [B, P] real prompt slots.
      trace: The rollouts' `DiffusionGemmaTrace`.
      micro_batch_size: Rows per scoring call.
    """
    with self._get_mesh_and_logical_axis_rules_cm(Role.REFERENCE):
      model = self.inference_worker.get_model("reference")
      if model is None:
        raise ValueError("the cluster has no reference model")
      self._maybe_load_model_from_cpu(model, Role.REFERENCE)
      out = self._score_rows(model, prompt_tokens, prompt_mask, trace,
                             micro_batch_size)
      self._maybe_offload_model_to_cpu(model, Role.REFERENCE)
      return out

  def get_old_sequence_logps(self, prompt_tokens, prompt_mask,
                             trace: output_lib.DiffusionGemmaTrace,
                             micro_batch_size: int | None = None
                             ) -> jax.Array:
    """Rollout-policy log P of each rollout's trajectories, float32 [B].

    Same arguments as `get_ref_sequence_logps`.
    """
    with self._get_mesh_and_logical_axis_rules_cm(Role.ROLLOUT):
      model = self.rollout.model()
      self._maybe_load_model_from_cpu(model, Role.ROLLOUT)
      out = self._score_rows(model, prompt_tokens, prompt_mask, trace,
                             micro_batch_size)
      self._maybe_offload_model_to_cpu(model, Role.ROLLOUT)
      return out

  def get_ref_per_token_logps(self, *args, **kwargs):
    raise TypeError(
        "DiffusionGemma log-probs are sequence-level: use"
        " get_ref_sequence_logps(prompt_tokens, prompt_mask, trace)")

  def get_old_per_token_logps(self, *args, **kwargs):
    raise TypeError(
        "DiffusionGemma log-probs are sequence-level: use"
        " get_old_sequence_logps(prompt_tokens, prompt_mask, trace)")


__all__ = ["DiffusionGemmaRLCluster"]
