"""Tests for the OPD divergences against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.rl import divergence as div

V = 7
BETA = 0.3


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_kl(p, q):
  return np.sum(
      np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - np.log(q)), 0), -1
  )


def _np_divergence(
    student_logits, teacher_logits, name, beta=BETA, temperature=1.0
):
  ps = np.exp(_np_log_softmax(student_logits / temperature))
  pt = np.exp(_np_log_softmax(teacher_logits / temperature))
  if name == "reverse_kl":
    return _np_kl(ps, pt)
  if name == "forward_kl":
    return _np_kl(pt, ps)
  m = beta * pt + (1 - beta) * ps
  return beta * _np_kl(pt, m) + (1 - beta) * _np_kl(ps, m)


def _logits(seed, shape=(3, 5, V)):
  rs = np.random.RandomState(seed)
  return rs.normal(size=shape).astype(np.float32) * 2


@pytest.mark.parametrize("name", div.DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_divergence_matches_numpy(name, temperature):
  s, t = _logits(0), _logits(1)
  got = div.full_divergence(
      div.log_probs(jnp.asarray(s), temperature),
      div.log_probs(jnp.asarray(t), temperature),
      name,
      BETA,
  )
  np.testing.assert_allclose(
      got,
      _np_divergence(s, t, name, temperature=temperature),
      rtol=1e-5,
      atol=1e-6,
  )
  assert np.all(np.asarray(got) >= -1e-6)


@pytest.mark.parametrize("name", div.DIVERGENCES)
def test_excluded_token_is_removed_from_both_distributions(name):
  s, t = _logits(2), _logits(3)
  teacher = div.log_probs(jnp.asarray(t), 1.0, exclude_token_id=0)

  def total(student_logits):
    student = div.log_probs(student_logits, 1.0, exclude_token_id=0)
    return jnp.sum(div.full_divergence(student, teacher, name, BETA))

  got = div.full_divergence(
      div.log_probs(jnp.asarray(s), 1.0, exclude_token_id=0),
      teacher,
      name,
      BETA,
  )
  np.testing.assert_allclose(
      got, _np_divergence(s[..., 1:], t[..., 1:], name), rtol=1e-5, atol=1e-6
  )
  grads = jax.grad(total)(jnp.asarray(s))
  assert np.all(np.isfinite(grads)) and np.all(grads[..., 0] == 0)


@pytest.mark.parametrize("name", div.DIVERGENCES)
def test_sampled_token_estimate_is_unbiased_in_value_and_gradient(name):
  # With x ~ p_s, E[f(r)] is the divergence and E[grad of the surrogate] its
  # gradient; enumerate x to take the expectations exactly.
  s, t = _logits(4, (V,)), _logits(5, (V,))
  teacher_logp = div.log_probs(jnp.asarray(t))

  def expected_surrogate(student_logits, field):
    student_logp = div.log_probs(student_logits)
    values = []
    for x in range(V):
      value, surrogate = div.sampled_token_divergence(
          student_logp[x], teacher_logp[x], name, BETA
      )
      values.append(value if field == "value" else surrogate)
    weights = jax.lax.stop_gradient(jnp.exp(student_logp))
    return jnp.sum(weights * jnp.stack(values))

  full = lambda z: div.full_divergence(
      div.log_probs(z), teacher_logp, name, BETA
  )
  s = jnp.asarray(s)
  np.testing.assert_allclose(expected_surrogate(s, "value"), full(s), rtol=1e-5)
  np.testing.assert_allclose(
      jax.grad(expected_surrogate)(s, "surrogate"),
      jax.grad(full)(s),
      rtol=1e-4,
      atol=1e-6,
  )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(divergence="kl"), "divergence must be one of"),
        (dict(estimator="topk"), "estimator must be one of"),
        (dict(divergence="jsd", beta=1.0), "0 < beta < 1"),
        (dict(temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_configurations_raise(kwargs, message):
  args = dict(
      divergence="reverse_kl", estimator="full", beta=0.5, temperature=1.0
  )
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    div.check_divergence(**args)
