"""Weighted cross-entropy for block diffusion, as a denominator-aware LossOutput."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunix_blockdiff import compat


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """float32 [B, L] cross-entropy of `targets` under `logits`.

  Target ids outside `[0, V)` are clipped for the gather (the caller masks
  them out), so inactive slots may hold any id without producing NaNs.

  Args:
    logits: float [B, L, V].
    targets: int [B, L].
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  safe_targets = jnp.clip(targets, 0, vocab - 1)
  log_norm = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
  return log_norm - target_logit


def diffusion_loss(
    logits: jax.Array, targets: jax.Array, loss_weights: jax.Array
) -> compat.LossOutput:
  """Weighted cross-entropy over target slots, unreduced.

  `primary_loss = WeightedMetric(sum_i w_i * CE_i, #{i : w_i > 0})`: the sum
  is weighted (ELBO weights 1/t stay in it) and the denominator counts target
  tokens, so summing sums and denominators over micro-batches and dividing
  once gives the exact token-weighted mean of the whole batch.

  Args:
    logits: float [B, L, V] target-aligned logits.
    targets: int [B, L] clean token ids (any id where the weight is 0).
    loss_weights: float/bool [B, L] per-target weights, >= 0.

  Returns:
    `LossOutput` with `primary_loss` and aux metrics `accuracy`
    (WeightedMetric over targets) and `target_tokens` (float32 scalar).
  """
  if logits.ndim != 3:
    raise ValueError(f"logits must have shape [batch, length, vocab], got {logits.shape}")
  if targets.shape != logits.shape[:2]:
    raise ValueError(
        f"targets must have shape {logits.shape[:2]} (logits [batch, length]),"
        f" got {targets.shape}"
    )
  if loss_weights.shape != targets.shape:
    raise ValueError(
        f"loss_weights must have the shape of targets {targets.shape}, got"
        f" {loss_weights.shape}"
    )
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"targets must have an integer dtype, got {targets.dtype}")
  weights = loss_weights.astype(jnp.float32)
  active = weights > 0
  ce = token_cross_entropy(logits, targets)
  # `where` (not multiply) so an inf/NaN CE at an inactive slot cannot leak.
  loss_sum = jnp.sum(jnp.where(active, weights * ce, 0.0))
  count = jnp.sum(active.astype(jnp.float32))
  correct = jnp.argmax(logits, axis=-1) == targets
  accuracy = compat.WeightedMetric(
      unreduced_sum=jnp.sum(jnp.where(active, correct, False).astype(jnp.float32)),
      denominator=count,
  )
  return compat.LossOutput(
      primary_loss=compat.WeightedMetric(unreduced_sum=loss_sum, denominator=count),
      aux_metrics={"accuracy": accuracy, "target_tokens": count},
  )
