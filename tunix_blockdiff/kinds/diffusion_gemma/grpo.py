"""GRPO on DiffusionGemma rollouts: the `dg_grpo` loss, sequence-level.

Why a loss of its own (not `bd_grpo`): `bd_grpo` takes per-token ratios of
a mask-and-commit trajectory, where every token is committed once at a
known step. A DiffusionGemma trajectory resamples the whole canvas at every
step and may revise any token, so a token has no probability of its own;
only the whole trajectory does. `dg_grpo` therefore uses the exact
sequence-level ratio

  r_i = exp(log P_theta(tau_i) - log P_old(tau_i)),

`log P` the trajectory-exact log-prob of row i's recorded trajectories
(`kinds.diffusion_gemma.scoring.sequence_logprobs`: every canvas, every live
step, the self-conditioning chain replayed), and per row

  loss_i = max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps_high))
           + beta KL_i,

`KL_i` Tunix's `kl_loss_mode` estimator on the sequence log-probs against
the reference's (an estimate of the trajectory-level KL). Rows weigh
equally: the loss is `sum_i loss_i / B`, returned as a `LossOutput` (sum,
row count) so micro-batch accumulation is exact. The ratio is not length
normalised (unlike GSPO): it is the exact importance weight of the
trajectory, so it is 1 at the rollout's parameters and its gradient there
is the REINFORCE gradient of the sampler's own distribution. The log-ratio
is clipped to +-20 before `exp` (as `bd_grpo`); PPO's clip bounds the rest.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from tunix.rl import common
from tunix.rl.grpo import grpo_learner

from tunix_blockdiff import compat
from tunix_blockdiff.models.diffusion_gemma import config as dg_config
from tunix_blockdiff.kinds.diffusion_gemma import scoring as scoring
from tunix_blockdiff.kinds.diffusion_gemma import output as output_lib

LOG_RATIO_CLIP = 20.0
LOSS_AGG_MODES = ("sequence-mean-token-mean", "seq-mean-token-sum")


@flax.struct.dataclass(frozen=True)
class DiffusionGemmaTrainExample(common.TrainExample):
  """Tunix's `TrainExample` plus the rollouts' DiffusionGemma trace.

  `completion_ids` are the trace's tokens int32 [B, K * C] and
  `completion_mask` the completion slots (before the first EOS); neither is
  used by the loss. `ref_per_token_logps` and `old_per_token_logps` hold
  *sequence* log-probs float32 [B].

  Attributes:
    trace: The `DiffusionGemmaTrace` of the B rows.
  """

  trace: output_lib.DiffusionGemmaTrace | None = None


@dataclasses.dataclass(kw_only=True)
class DiffusionGemmaGRPOConfig(grpo_learner.GRPOConfig):
  """`GRPOConfig` for DiffusionGemma policies.

  Attributes:
    policy_loss_fn: Default `dg_grpo`.
    sampler_config: The rollout's `SamplerConfig` (what the scorer replays);
      `DiffusionGemmaGRPOLearner` fills it from the engine when None and
      rejects a different one.
    loss_agg_mode: `sequence-mean-token-mean` or `seq-mean-token-sum`; both
      mean the per-row losses (the loss is sequence-level).
    splash_tile: The policy's log-probs (`sequence_logprobs`) run every
      attention call on the Splash kernel with this tile (a multiple of 128
      dividing the prompt width and the canvas); None: dense.
      `DiffusionGemmaGRPOLearner` fills it from the engine when None and
      rejects a different one.
    splash_interpret: Pallas interpret mode; None: off TPU.
  """

  policy_loss_fn: str = "dg_grpo"
  sampler_config: dg_config.SamplerConfig | None = None
  splash_tile: int | None = None
  splash_interpret: bool | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.loss_algo != "grpo":
      raise ValueError(
          f"loss_algo must be 'grpo' for dg_grpo, got {self.loss_algo!r}")
    if self.loss_agg_mode not in LOSS_AGG_MODES:
      raise ValueError(
          f"loss_agg_mode must be one of {LOSS_AGG_MODES} (dg_grpo is"
          f" sequence-level), got {self.loss_agg_mode!r}")
    if self.sampler_config is not None and not isinstance(
        self.sampler_config, dg_config.SamplerConfig):
      raise TypeError(
          "sampler_config must be a SamplerConfig, got"
          f" {type(self.sampler_config).__name__}")
    scoring.check_splash_tile(self.splash_tile)


def require_trace(train_example) -> output_lib.DiffusionGemmaTrace:
  """The example's trace, or a ValueError saying where it comes from."""
  trace = getattr(train_example, "trace", None)
  if not isinstance(trace, output_lib.DiffusionGemmaTrace):
    raise ValueError(
        "train_example has no DiffusionGemmaTrace: dg_grpo needs the"
        " rollouts' trace (train with DiffusionGemmaGRPOLearner and"
        " DiffusionGemmaRLCluster)")
  return trace


def require_sampler_config(algo_config) -> dg_config.SamplerConfig:
  """`algo_config.sampler_config`, or a ValueError if it is not set."""
  config = getattr(algo_config, "sampler_config", None)
  if not isinstance(config, dg_config.SamplerConfig):
    raise ValueError(
        "algo_config.sampler_config must be the rollout's SamplerConfig"
        " (DiffusionGemmaGRPOLearner fills it from the rollout engine)")
  return config


def policy_sequence_logprobs(model, train_example,
                             config: dg_config.SamplerConfig, *,
                             splash_tile: int | None = None,
                             splash_interpret: bool | None = None
                             ) -> jax.Array:
  """Differentiable log P of each row's trajectories, float32 [B]."""
  return scoring.sequence_logprobs(
      model, train_example.prompt_ids, train_example.prompt_mask,
      require_trace(train_example), config, splash_tile=splash_tile,
      splash_interpret=splash_interpret)


def _mean(x: jax.Array) -> compat.WeightedMetric:
  return compat.WeightedMetric(jnp.sum(x), jnp.asarray(x.size, jnp.float32))


def dg_grpo_loss_fn(model, train_example, algo_config,
                    pad_id: int | None = None, eos_id: int | None = None,
                    **kwargs) -> compat.LossOutput:
  """Sequence-level GRPO loss of a DiffusionGemma policy (Tunix's API).

  See the module docstring for the loss. The old policy's log-probs are
  `train_example.old_per_token_logps` (sequence-level, [B]) or, when
  absent, `stop_gradient` of the policy's own (ratio exactly 1, as Tunix).

  Args:
    model: The `DiffusionGemma` policy.
    train_example: `DiffusionGemmaTrainExample`.
    algo_config: `DiffusionGemmaGRPOConfig` (epsilon, epsilon_high, beta,
      kl_loss_mode, kl_clamp_value, sampler_config, splash_tile,
      splash_interpret).
    pad_id, eos_id, **kwargs: Unused (Tunix's policy-loss signature).

  Returns:
    `LossOutput`: `primary_loss` = WeightedMetric(sum of row losses, rows);
    aux metrics `kl`, `pg_loss`, `pg_clipfrac`, `ppo_kl`, `is_ratio/mean`,
    `is_ratio/max`, `is_ratio/min`, `sequence_logp`.
  """
  del pad_id, eos_id, kwargs
  config = require_sampler_config(algo_config)
  epsilon = algo_config.epsilon
  epsilon_high = getattr(algo_config, "epsilon_high", None) or epsilon
  logps = policy_sequence_logprobs(
      model, train_example, config,
      splash_tile=getattr(algo_config, "splash_tile", None),
      splash_interpret=getattr(algo_config, "splash_interpret", None))
  if train_example.old_per_token_logps is None:
    old = jax.lax.stop_gradient(logps)
  else:
    old = jnp.asarray(train_example.old_per_token_logps, jnp.float32)
    if old.shape != logps.shape:
      raise ValueError(
          f"old_per_token_logps must be sequence log-probs {logps.shape},"
          f" got {old.shape}")
  log_ratio = jnp.clip(logps - old, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
  ratio = jnp.exp(log_ratio)
  advantages = jnp.asarray(train_example.advantages, jnp.float32).reshape(
      logps.shape)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
  pg = jnp.maximum(unclipped, clipped)
  per_row = pg
  aux = {
      "pg_loss": _mean(pg),
      "pg_clipfrac": _mean((clipped > unclipped).astype(jnp.float32)),
      "ppo_kl": _mean(-log_ratio),
      "is_ratio/mean": _mean(ratio),
      "is_ratio/max": jnp.max(ratio),
      "is_ratio/min": jnp.min(ratio),
      "sequence_logp": _mean(jax.lax.stop_gradient(logps)),
      "kl": compat.WeightedMetric(jnp.zeros(()), jnp.zeros(())),
  }
  if train_example.ref_per_token_logps is not None:
    kl = common.compute_kl_divergence(
        logps, jnp.asarray(train_example.ref_per_token_logps).reshape(
            logps.shape), algo_config.kl_loss_mode,
        clamp_value=getattr(algo_config, "kl_clamp_value", None))
    aux["kl"] = _mean(kl)
    if algo_config.beta:
      per_row = per_row + algo_config.beta * kl
  return compat.LossOutput(primary_loss=_mean(per_row), aux_metrics=aux)


__all__ = [
    "DiffusionGemmaGRPOConfig",
    "DiffusionGemmaTrainExample",
    "LOSS_AGG_MODES",
    "dg_grpo_loss_fn",
    "policy_sequence_logprobs",
    "require_sampler_config",
    "require_trace",
]
