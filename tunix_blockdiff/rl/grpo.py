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

import flax
import jax
import jax.numpy as jnp
from tunix.rl import common
from tunix.rl.grpo import grpo_learner

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.rl import scoring

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
    attention: The scoring call's attention (`rl.likelihood`); the learner
      fills it from the rollout engine's when None and rejects a different
      one (old and new log-probs from one kernel keep the ratio exact).
  """

  policy_loss_fn: str = "bd_grpo"
  denoise_config: config_lib.DenoiseConfig | None = None
  likelihood: str = "exact"
  attention: config_lib.AttentionConfig | None = None

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
    likelihood_lib.check_attention(self.attention)


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
    attention: config_lib.AttentionConfig | None = None,
):
  """Differentiable per-token log-probs and entropies, each float32 [B, N].

  Under `likelihood` and `attention` (`rl.likelihood.per_token_logps`).
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
      attention=attention,
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
      model, train_example, config, getattr(algo_config, "likelihood", "exact"),
      getattr(algo_config, "attention", None),
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


__all__ = [
    "BlockDiffusionGRPOConfig",
    "BlockDiffusionTrainExample",
    "LOSS_AGG_MODES",
    "aggregate",
    "bd_grpo_loss_fn",
    "policy_log_probs",
    "require_denoise_config",
    "require_trace",
]
