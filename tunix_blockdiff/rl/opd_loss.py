"""The on-policy distillation (OPD) loss and its algorithm config.

`diffusion_opd_loss_fn` (name and first three arguments as in the Tunix
proposal, PR #1747) is the core loss: a per-token divergence
(`rl.divergence`) of the block-diffusion student's trajectory-exact
distribution (`rl.scoring`) to the teacher's. `bd_opd_loss_fn` wraps it in
Tunix's policy-loss API; `BlockDiffusionOPDConfig` is its algorithm config.
The teacher scoring and the learner are in `rl.opd`, which re-exports every
public name here; `registration` registers `bd_opd` from there.

Shapes: B batch, P prompt, N completion, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
from tunix.rl import algorithm_config as algo_config_lib

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rl import divergence as divergence_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.rl import scoring


@flax.struct.dataclass(frozen=True)
class DiffusionDistillationBatch:
  """A student rollout and the teacher's scores of it.

  Attributes:
    student_batch: `DiffusionTokenBatch` of the student's trajectories
      (`scoring.prepare_trajectory_batch`); `loss_weights` marks the scored
      tokens.
    teacher_logits: float [B, N, V] teacher logits at each scored token
      (required by `estimator='full'`).
    teacher_logps: float [B, N] teacher log-probs of the student's tokens
      (enough for `estimator='sampled_token'`).
  """

  student_batch: Any
  teacher_logits: jax.Array | None = None
  teacher_logps: jax.Array | None = None


def diffusion_opd_loss_fn(
    student_model,
    batch: DiffusionDistillationBatch,
    student_logits_fn: Callable[[Any, Any], jax.Array],
    *,
    divergence: str = "reverse_kl",
    estimator: str = "full",
    beta: float = 0.5,
    temperature: float = 1.0,
    exclude_token_id: int | None = None,
    score_logps: jax.Array | None = None,
) -> compat.LossOutput:
  """Token-weighted OPD loss of a block-diffusion student.

  Both distributions are `softmax(logits / temperature)` without
  `exclude_token_id` (pass the student's mask token, which it never
  proposes). With `estimator='sampled_token'` and `temperature` equal to the
  rollout's (no top-k/top-p), the one-sample estimate is unbiased.

  Args:
    student_model: The trainable student.
    batch: `DiffusionDistillationBatch`.
    student_logits_fn: `(model, batch.student_batch.model_inputs) -> [B, N,
      V]` target-aligned student logits (e.g. the trajectory scorer's).
    divergence: `reverse_kl` (default), `forward_kl` or `jsd`.
    estimator: `full` or `sampled_token`.
    beta: Teacher weight of the `jsd` mixture, 0 < beta < 1.
    temperature: > 0.
    exclude_token_id: Token removed from both distributions.
    score_logps: Optional float [B, N] differentiable per-token log-probs
      whose gradient is the `sampled_token` estimator's score function
      (default: the student's token log-probs); `bd_opd` passes the exact
      likelihood's (`rl.likelihood`). Unused by `full`.

  Returns:
    `LossOutput`: primary = WeightedMetric(sum_t w_t * D_t, sum_t w_t);
    aux `divergence` (the same mean, from the estimate), `student_logp`
    and `teacher_logp` of the sampled tokens (token means).

  Raises:
    ValueError: unknown divergence/estimator, bad beta or temperature,
      missing teacher scores, teacher/student vocabulary mismatch.
  """
  divergence_lib.check_divergence(divergence, estimator, beta, temperature)
  student_batch = batch.student_batch
  student_vocab = getattr(
      getattr(student_model, "config", None), "vocab_size", None
  )
  if batch.teacher_logits is not None and student_vocab is not None:
    check_vocab_match(batch.teacher_logits.shape[-1], student_vocab)
  if estimator == "full" and batch.teacher_logits is None:
    raise ValueError("estimator='full' needs batch.teacher_logits [B, N, V]")
  if batch.teacher_logits is None and batch.teacher_logps is None:
    raise ValueError("batch needs teacher_logits or teacher_logps")
  student_logits = student_logits_fn(student_model, student_batch.model_inputs)
  targets = jnp.asarray(student_batch.target_ids)
  if tuple(student_logits.shape[:2]) != tuple(targets.shape):
    raise ValueError(
        f"student logits {tuple(student_logits.shape)} do not match the"
        f" targets [batch, length] = {tuple(targets.shape)}"
    )
  if batch.teacher_logits is not None:
    check_vocab_match(batch.teacher_logits.shape[-1], student_logits.shape[-1])
    if tuple(batch.teacher_logits.shape) != tuple(student_logits.shape):
      raise ValueError(
          f"teacher_logits {tuple(batch.teacher_logits.shape)} must have the"
          f" student's logits shape {tuple(student_logits.shape)}"
      )
  weights = jnp.asarray(student_batch.loss_weights, jnp.float32)
  active = weights > 0
  safe_targets = jnp.where(active, targets, 0)[..., None]
  student_log_probs = divergence_lib.log_probs(
      jnp.where(active[..., None], student_logits, 0.0),
      temperature,
      exclude_token_id,
  )
  student_logp = jnp.take_along_axis(student_log_probs, safe_targets, axis=-1)[
      ..., 0
  ]
  if batch.teacher_logits is not None:
    teacher_log_probs = divergence_lib.log_probs(
        jax.lax.stop_gradient(
            jnp.where(active[..., None], batch.teacher_logits, 0.0)
        ),
        temperature,
        exclude_token_id,
    )
    teacher_logp = jnp.take_along_axis(
        teacher_log_probs, safe_targets, axis=-1
    )[..., 0]
  else:
    teacher_logp = jax.lax.stop_gradient(
        jnp.asarray(batch.teacher_logps, jnp.float32)
    )
  if estimator == "full":
    per_token = divergence_lib.full_divergence(
        student_log_probs, teacher_log_probs, divergence, beta
    )
    estimate = per_token
  else:
    estimate, per_token = divergence_lib.sampled_token_divergence(
        student_logp, teacher_logp, divergence, beta, score_logp=score_logps
    )
  # `where`: inactive slots may hold non-finite values from placeholders.
  per_token = jnp.where(active, per_token, 0.0)
  total = jnp.sum(weights)
  aux = {
      "divergence": compat.WeightedMetric(
          jnp.sum(jnp.where(active, weights * estimate, 0.0)), total
      ),
      "student_logp": compat.WeightedMetric(
          jnp.sum(jnp.where(active, weights * student_logp, 0.0)), total
      ),
      "teacher_logp": compat.WeightedMetric(
          jnp.sum(jnp.where(active, weights * teacher_logp, 0.0)), total
      ),
  }
  return compat.LossOutput(
      primary_loss=compat.WeightedMetric(jnp.sum(weights * per_token), total),
      aux_metrics=aux,
  )


def check_vocab_match(teacher_vocab: int, student_vocab: int) -> None:
  """Raises unless teacher and student share a vocabulary size."""
  if int(teacher_vocab) != int(student_vocab):
    raise ValueError(
        f"teacher vocabulary ({teacher_vocab}) differs from the student's"
        f" ({student_vocab}); OPD compares distributions token by token and"
        " needs one shared tokenizer"
    )



@dataclasses.dataclass(kw_only=True)
class BlockDiffusionOPDConfig(algo_config_lib.AlgorithmConfig):
  """Algorithm config of on-policy distillation.

  Attributes:
    policy_loss_fn: Default `bd_opd`.
    divergence: `reverse_kl` (default), `forward_kl` or `jsd`.
    estimator: `full` (exact over the vocabulary) or `sampled_token`.
    beta: Teacher weight of the `jsd` mixture.
    temperature: Temperature of both distributions.
    num_iterations: Optimizer passes over each rollout batch.
    denoise_config: The student rollout's `DenoiseConfig` (filled by the
      learner from the engine when None).
    likelihood: `exact` (default) or `committed_only`: the log-prob whose
      gradient is the score function of the `sampled_token` estimator
      (`rl.likelihood`; with `exact`, each token's share of its trajectory's
      exact log-prob, selection included). `full` computes each token's
      divergence exactly over the proposal distributions and uses none.
    attention: The student scorer's attention (`rl.likelihood`; filled by
      the learner from the engine when None, a different one refused).
  """

  algo_variant: str = "opd"
  advantage_estimator: str = "none"
  policy_loss_fn: str = "bd_opd"
  divergence: str = "reverse_kl"
  estimator: str = "full"
  beta: float = 0.5
  temperature: float = 1.0
  num_iterations: int = 1
  denoise_config: config_lib.DenoiseConfig | None = None
  likelihood: str = "exact"
  attention: config_lib.AttentionConfig | None = None

  def __post_init__(self):
    # AlgorithmConfig's own check only knows Tunix's built-in names.
    divergence_lib.check_divergence(
        self.divergence, self.estimator, self.beta, self.temperature
    )
    if self.num_iterations < 1:
      raise ValueError(
          f"num_iterations must be >= 1, got {self.num_iterations}"
      )
    likelihood_lib.check_likelihood(self.likelihood, self.denoise_config)
    likelihood_lib.check_attention(self.attention)


def bd_opd_loss_fn(
    model,
    train_example,
    algo_config,
    pad_id: int | None = None,
    eos_id: int | None = None,
    **kwargs,
) -> compat.LossOutput:
  """OPD loss in Tunix's policy-loss API (registered as `bd_opd`).

  Args:
    model: The student.
    train_example: `BlockDiffusionTrainExample` with `commit_step`,
      `completion_mask` (scored tokens) and `teacher_logits` or
      `teacher_per_token_logps`.
    algo_config: `BlockDiffusionOPDConfig`.
    pad_id: Unused (Tunix signature).
    eos_id: Unused.
    **kwargs: Unused.

  Returns:
    `diffusion_opd_loss_fn`'s `LossOutput`.
  """
  del pad_id, eos_id, kwargs
  config = grpo.require_denoise_config(algo_config)
  student_batch = scoring.prepare_trajectory_batch(
      train_example.prompt_ids,
      train_example.prompt_mask,
      train_example.completion_ids,
      grpo.require_trace(train_example),
      mask_token_id=config.mask_token_id,
      loss_weights=train_example.completion_mask,
  )
  batch = DiffusionDistillationBatch(
      student_batch=student_batch,
      teacher_logits=getattr(train_example, "teacher_logits", None),
      teacher_logps=getattr(train_example, "teacher_per_token_logps", None),
  )
  score_logps = None
  likelihood = getattr(algo_config, "likelihood", "exact")
  attention = getattr(algo_config, "attention", None)
  if algo_config.estimator == "sampled_token" and likelihood == "exact":
    score_logps = likelihood_lib.per_token_logps(
        model, student_batch, config, stop_gradient=False,
        attention=attention,
    )
  return diffusion_opd_loss_fn(
      model,
      batch,
      scoring.trajectory_logits_fn_for(config, attention),
      divergence=algo_config.divergence,
      estimator=algo_config.estimator,
      beta=algo_config.beta,
      temperature=algo_config.temperature,
      exclude_token_id=config.mask_token_id,
      score_logps=score_logps,
  )


__all__ = [
    "BlockDiffusionOPDConfig",
    "DiffusionDistillationBatch",
    "bd_opd_loss_fn",
    "check_vocab_match",
    "diffusion_opd_loss_fn",
]
