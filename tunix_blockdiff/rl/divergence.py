"""Per-token divergences between a student and a teacher distribution.

Two estimators of each divergence D(student, teacher) at a token slot:

* `full`: exact, over the whole vocabulary, from both models' logits;
  differentiable in the student's logits by autodiff.
* `sampled_token`: from the log-probs of the one token the student sampled,
  x ~ p_s. Every divergence here is an f-divergence `E_{x~p_s}[f(r)]` with
  `r = p_t(x) / p_s(x)`, so `f(r)` is an unbiased one-sample estimate, and
  `(f(r) - r f'(r)) * grad log p_s(x)` an unbiased estimate of its gradient
  (the score-function identity). `sampled_token_divergence` returns both.

Divergences (p_s student, p_t teacher, both temperature-scaled):

* `reverse_kl` (default): KL(p_s || p_t); f(r) = -log r.
* `forward_kl`: KL(p_t || p_s); f(r) = r log r.
* `jsd`: generalized Jensen-Shannon with mixture m = beta p_t + (1-beta) p_s:
  beta KL(p_t || m) + (1 - beta) KL(p_s || m), 0 < beta < 1;
  f(r) = beta r log(r / u) - (1 - beta) log u, u = beta r + 1 - beta.

Shapes: [...] any leading shape, V vocabulary.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
ESTIMATORS = ("full", "sampled_token")


def check_divergence(
    divergence: str, estimator: str, beta: float, temperature: float
) -> None:
  """Raises a clear error for an unknown divergence or a bad parameter."""
  if divergence not in DIVERGENCES:
    raise ValueError(
        f"divergence must be one of {DIVERGENCES}, got {divergence!r}"
    )
  if estimator not in ESTIMATORS:
    raise ValueError(
        f"estimator must be one of {ESTIMATORS}, got {estimator!r}"
    )
  for name, value in (("beta", beta), ("temperature", temperature)):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  if divergence == "jsd" and not 0.0 < beta < 1.0:
    raise ValueError(
        f"beta must satisfy 0 < beta < 1 for divergence='jsd', got {beta}"
        " (use forward_kl / reverse_kl for the end points)"
    )
  if not temperature > 0.0:
    raise ValueError(f"temperature must be > 0, got {temperature}")


def log_probs(
    logits: jax.Array,
    temperature: float = 1.0,
    exclude_token_id: int | None = None,
) -> jax.Array:
  """float32 log-softmax of `logits / temperature`, optionally without a token.

  Args:
    logits: float [..., V].
    temperature: > 0.
    exclude_token_id: A token removed from the distribution (the mask token
      of a block-diffusion student is never proposed).
  """
  logits = logits.astype(jnp.float32) / temperature
  if exclude_token_id is not None:
    logits = logits.at[..., exclude_token_id].set(-jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """KL(p || q) over the last axis; 0 * log 0 terms are 0, also in gradients."""
  p = jnp.exp(log_p)
  finite = p > 0
  diff = jnp.where(finite, log_p - jnp.where(finite, log_q, 0.0), 0.0)
  return jnp.sum(jnp.where(finite, p * diff, 0.0), axis=-1)


def full_divergence(
    student_log_probs: jax.Array,
    teacher_log_probs: jax.Array,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
) -> jax.Array:
  """Exact per-token divergence over the vocabulary.

  Args:
    student_log_probs: float32 [..., V] log p_s.
    teacher_log_probs: float32 [..., V] log p_t (same support as p_s).
    divergence: `reverse_kl`, `forward_kl` or `jsd`.
    beta: Mixture weight of the teacher for `jsd`.

  Returns:
    float32 [...], >= 0.
  """
  check_divergence(divergence, "full", beta, 1.0)
  if divergence == "reverse_kl":
    return _kl(student_log_probs, teacher_log_probs)
  if divergence == "forward_kl":
    return _kl(teacher_log_probs, student_log_probs)
  # A token both exclude has log-prob -inf twice; logaddexp's gradient there
  # is NaN, so it is computed on placeholders and set back to -inf.
  excluded = jnp.isneginf(teacher_log_probs) & jnp.isneginf(student_log_probs)
  log_mixture = jnp.logaddexp(
      jnp.where(excluded, 0.0, teacher_log_probs) + jnp.log(beta),
      jnp.where(excluded, 0.0, student_log_probs) + jnp.log1p(-beta),
  )
  log_mixture = jnp.where(excluded, -jnp.inf, log_mixture)
  return beta * _kl(teacher_log_probs, log_mixture) + (1.0 - beta) * _kl(
      student_log_probs, log_mixture
  )


def _f_and_score_weight(log_ratio: jax.Array, divergence: str, beta: float):
  """(f(r), f(r) - r f'(r)) of the divergence's generator at r = exp(log_ratio)."""
  ratio = jnp.exp(log_ratio)
  if divergence == "reverse_kl":
    return -log_ratio, 1.0 - log_ratio
  if divergence == "forward_kl":
    return ratio * log_ratio, -ratio
  u = beta * ratio + (1.0 - beta)
  log_u = jnp.log(u)
  value = beta * ratio * (log_ratio - log_u) - (1.0 - beta) * log_u
  # f'(r) = beta log(r / u) + beta (1 - beta) / u - beta (1 - beta) / u
  #       = beta log(r / u), so f - r f' = -(1 - beta) log u.
  return value, -(1.0 - beta) * log_u


def sampled_token_divergence(
    student_logp: jax.Array,
    teacher_logp: jax.Array,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    log_ratio_clip: float = 20.0,
    score_logp: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """One-sample divergence estimate at the student's sampled token.

  Args:
    student_logp: float [...] log p_s(x) of the sampled token x ~ p_s.
    teacher_logp: float [...] log p_t(x).
    divergence: `reverse_kl`, `forward_kl` or `jsd`.
    beta: Mixture weight of the teacher for `jsd`.
    log_ratio_clip: |log r| is clipped here (the importance ratio of the
      forward divergences explodes where the student is confident and the
      teacher is not).
    score_logp: float [...] differentiable log-prob whose gradient is the
      score function (default `student_logp`); e.g. the token's share of
      its trajectory's exact log-prob (`rl.likelihood`), whose law, not
      p_s alone, the token was sampled from.

  Returns:
    (estimate float32 [...], surrogate float32 [...]). `estimate` is the
    unbiased estimate `f(r)`; `surrogate` has the estimate's value and the
    score-function gradient `(f(r) - r f'(r)) grad log p_s(x)`, so minimising
    its mean follows the divergence's true gradient in expectation.
  """
  check_divergence(divergence, "sampled_token", beta, 1.0)
  student_logp = student_logp.astype(jnp.float32)
  log_ratio = jnp.clip(
      teacher_logp.astype(jnp.float32) - jax.lax.stop_gradient(student_logp),
      -log_ratio_clip,
      log_ratio_clip,
  )
  value, weight = _f_and_score_weight(log_ratio, divergence, beta)
  value = jax.lax.stop_gradient(value)
  weight = jax.lax.stop_gradient(weight)
  if score_logp is None:
    score_logp = student_logp
  surrogate = value + weight * (score_logp - jax.lax.stop_gradient(score_logp))
  return value, surrogate
