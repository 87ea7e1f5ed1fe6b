"""Weighted cross-entropy for block diffusion, as a denominator-aware LossOutput."""

from __future__ import annotations

import numbers
from typing import Callable

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


def token_entropy(
    logits: jax.Array, temperature: float = 1.0, where: jax.Array | None = None
) -> jax.Array:
  """float32 [B, L] entropy (nats) of `softmax(logits / temperature)`.

  Computed as `logsumexp(z) - sum(p * z)` with `z = logits / temperature`;
  `-inf` logits (p = 0) add nothing to value or gradient. Where `where` is
  False the logits are replaced by zeros before anything is computed, so NaN
  or inf logits at those slots reach neither the value nor the gradient.

  Args:
    logits: float [B, L, V].
    temperature: > 0.
    where: Optional bool [B, L]: slots whose entropy is needed.
  """
  z = logits.astype(jnp.float32) / temperature
  if where is not None:
    z = jnp.where(where[..., None], z, 0.0)
  probs = jax.nn.softmax(z, axis=-1)
  finite_z = jnp.where(jnp.isfinite(z), z, 0.0)
  return jax.nn.logsumexp(z, axis=-1) - jnp.sum(probs * finite_z, axis=-1)


def _check_certainty(weight, temperature) -> tuple[float, float]:
  """(certainty_weight, certainty_temperature) as floats, or raises."""
  for name, value in (
      ("certainty_weight", weight), ("certainty_temperature", temperature)
  ):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  weight, temperature = float(weight), float(temperature)
  if not 0.0 <= weight < float("inf"):
    raise ValueError(f"certainty_weight must be finite and >= 0, got {weight}")
  if not 0.0 < temperature < float("inf"):
    raise ValueError(
        f"certainty_temperature must be finite and > 0, got {temperature}"
    )
  return weight, temperature


def _check_targets(name, array, last, targets, loss_weights) -> None:
  """Raises unless `array` is [B, L, last] and targets/weights are [B, L]."""
  if array.ndim != 3:
    raise ValueError(
        f"{name} must have shape [batch, length, {last}], got {array.shape}")
  if targets.shape != array.shape[:2]:
    raise ValueError(
        f"targets must have shape {array.shape[:2]} ({name} [batch, length]),"
        f" got {targets.shape}"
    )
  if loss_weights.shape != targets.shape:
    raise ValueError(
        f"loss_weights must have the shape of targets {targets.shape}, got"
        f" {loss_weights.shape}"
    )
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"targets must have an integer dtype, got {targets.dtype}")


def _token_terms(logits, targets, active, certainty_weight,
                 certainty_temperature):
  """Per-slot (CE, argmax == target, certainty entropy or None), [B, L] each.

  The entropy is computed only where the certainty term needs it: active
  slots predicted right (a stop-gradient selection).
  """
  ce = token_cross_entropy(logits, targets)
  correct = jnp.argmax(logits, axis=-1) == targets
  if certainty_weight <= 0.0:
    return ce, correct, None
  selected = jax.lax.stop_gradient(active & correct)
  return ce, correct, token_entropy(logits, certainty_temperature,
                                    where=selected)


def _reduce(ce, correct, entropy, weights, certainty_weight
            ) -> compat.LossOutput:
  """The `LossOutput` of per-slot terms (`_token_terms`) and weights."""
  active = weights > 0
  # `where` (not multiply) so an inf/NaN CE at an inactive slot cannot leak.
  loss_sum = jnp.sum(jnp.where(active, weights * ce, 0.0))
  count = jnp.sum(active.astype(jnp.float32))
  accuracy = compat.WeightedMetric(
      unreduced_sum=jnp.sum(jnp.where(active, correct, False).astype(
          jnp.float32)),
      denominator=count,
  )
  aux_metrics = {"accuracy": accuracy, "target_tokens": count}
  if entropy is not None:
    selected = active & correct
    certainty_sum = jnp.sum(jnp.where(selected, weights * entropy, 0.0))
    loss_sum = loss_sum + certainty_weight * certainty_sum
    aux_metrics["certainty"] = compat.WeightedMetric(
        unreduced_sum=certainty_sum, denominator=count
    )
  return compat.LossOutput(
      primary_loss=compat.WeightedMetric(unreduced_sum=loss_sum,
                                         denominator=count),
      aux_metrics=aux_metrics,
  )


def diffusion_loss(
    logits: jax.Array,
    targets: jax.Array,
    loss_weights: jax.Array,
    *,
    certainty_weight: float = 0.0,
    certainty_temperature: float = 1.0,
) -> compat.LossOutput:
  """Weighted cross-entropy over target slots, unreduced.

  `primary_loss = WeightedMetric(sum_i w_i * CE_i, #{i : w_i > 0})`: the sum
  is weighted (ELBO weights 1/t stay in it) and the denominator counts target
  tokens, so summing sums and denominators over micro-batches and dividing
  once gives the exact token-weighted mean of the whole batch.

  With `certainty_weight = c > 0` (dParallel's certainty forcing) the sum
  gains `c * sum_i w_i * [argmax_i == target_i] * H_i`, where `H_i` is the
  entropy of `softmax(logits_i / certainty_temperature)`: at targets the
  model already predicts right it is pushed to be confident, so a
  threshold decoder commits more slots per step. The selection mask is
  stop-gradient; the entropy is not. The denominator stays the target count
  and zero-weight slots add nothing. With `c = 0` (the default) the term is
  not computed and the loss is exactly the cross-entropy alone.

  Args:
    logits: float [B, L, V] target-aligned logits.
    targets: int [B, L] clean token ids (any id where the weight is 0).
    loss_weights: float/bool [B, L] per-target weights, >= 0.
    certainty_weight: Weight c >= 0 of the certainty term (0: off).
    certainty_temperature: Temperature > 0 of its softmax.

  Returns:
    `LossOutput` with `primary_loss` and aux metrics `accuracy`
    (WeightedMetric over targets) and `target_tokens` (float32 scalar);
    with `certainty_weight > 0` also `certainty`, a WeightedMetric whose sum
    is `sum_i w_i * [argmax_i == target_i] * H_i` (unscaled by c) over the
    target count.
  """
  certainty_weight, certainty_temperature = _check_certainty(
      certainty_weight, certainty_temperature
  )
  _check_targets("logits", logits, "vocab", targets, loss_weights)
  weights = loss_weights.astype(jnp.float32)
  active = weights > 0
  ce, correct, entropy = _token_terms(
      logits, targets, active, certainty_weight, certainty_temperature)
  return _reduce(ce, correct, entropy, weights, certainty_weight)


def check_head_chunk(head_chunk) -> int | None:
  """`head_chunk` (None, or tokens per output-head chunk >= 1), or raises."""
  if head_chunk is None:
    return None
  if isinstance(head_chunk, bool) or not isinstance(head_chunk,
                                                    numbers.Integral):
    raise TypeError(
        f"head_chunk must be an int or None, got {type(head_chunk).__name__}")
  if head_chunk < 1:
    raise ValueError(f"head_chunk must be >= 1 (tokens), got {head_chunk}")
  return int(head_chunk)


def chunked_diffusion_loss(
    hidden: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    targets: jax.Array,
    loss_weights: jax.Array,
    *,
    chunk: int,
    hidden_dtype=None,
    certainty_weight: float = 0.0,
    certainty_temperature: float = 1.0,
) -> compat.LossOutput:
  """`diffusion_loss(head(hidden), ...)` with the logits made `chunk` at a time.

  The B*L slots are cut into chunks of `chunk` tokens (the last padded with
  inactive slots); each chunk's logits are made, reduced to its per-slot
  terms and dropped, and rematerialised chunk by chunk in the backward pass
  (`jax.checkpoint`). The peak logits memory is one chunk's
  [chunk, V] float32 instead of the batch's [B, L, V]; the result and its
  gradients are those of `diffusion_loss` on the full logits.

  Args:
    hidden: float [B, L, D] target-aligned final hidden states (what
      `models.head.headless` returns).
    head: hidden [..., D] -> float32 logits [..., V] (`models.head
      .output_head`).
    targets: int [B, L] clean token ids.
    loss_weights: float/bool [B, L] per-target weights, >= 0.
    chunk: Tokens per chunk, >= 1.
    hidden_dtype: The dtype the head takes its input in (None: `hidden`'s).
    certainty_weight: As in `diffusion_loss`.
    certainty_temperature: As in `diffusion_loss`.

  Returns:
    The `LossOutput` of `diffusion_loss`.
  """
  certainty_weight, certainty_temperature = _check_certainty(
      certainty_weight, certainty_temperature
  )
  chunk = check_head_chunk(chunk)
  if chunk is None:
    raise ValueError("chunk must be >= 1 (tokens), got None")
  _check_targets("hidden", hidden, "width", targets, loss_weights)
  weights = loss_weights.astype(jnp.float32)
  active = weights > 0
  batch, length = hidden.shape[:2]
  slots = batch * length
  pad = -slots % chunk

  def flat(x, fill):
    x = x.reshape((slots, *x.shape[2:]))
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape((-1, chunk, *x.shape[1:]))

  dtype = hidden.dtype if hidden_dtype is None else hidden_dtype

  @jax.checkpoint
  def terms(piece):
    h, t, a = piece
    logits = head(h[None].astype(dtype))
    ce, correct, entropy = _token_terms(
        logits, t[None], a[None], certainty_weight, certainty_temperature)
    if entropy is None:
      entropy = jnp.zeros_like(ce)
    return ce[0], correct[0], entropy[0]

  ce, correct, entropy = jax.lax.map(
      terms, (flat(hidden, 0), flat(targets, 0), flat(active, False)))
  unflat = lambda x: x.reshape(-1)[:slots].reshape(batch, length)
  return _reduce(unflat(ce), unflat(correct),
                 unflat(entropy) if certainty_weight > 0.0 else None,
                 weights, certainty_weight)
