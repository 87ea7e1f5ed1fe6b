"""Tests for the weighted diffusion cross-entropy (LossOutput)."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import compat
from tunix_blockdiff.objective import loss as loss_lib

# Shared compiled programs: every test uses a few shapes, so each compiles
# once per worker instead of dispatching dozens of eager ops per call.
_loss = jax.jit(loss_lib.diffusion_loss)
_mean_and_grad = jax.jit(
    jax.value_and_grad(
        lambda x, t, w: loss_lib.diffusion_loss(x, t, w).primary_loss.compute()
    )
)


def _reference(logits, targets, weights):
  """NumPy float64 weighted CE sum and target count."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  total, count = 0.0, 0
  for b in range(targets.shape[0]):
    for i in range(targets.shape[1]):
      if weights[b, i] > 0:
        total += weights[b, i] * -log_probs[b, i, targets[b, i]]
        count += 1
  return total, count


def _example(seed=0, batch=2, length=6, vocab=11):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(batch, length, vocab)).astype(np.float32) * 3
  targets = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  weights = (rng.random((batch, length)) < 0.6) * rng.uniform(
      0.5, 4.0, (batch, length)
  )
  weights[0, 0] = 2.5  # at least one target.
  return logits, targets, weights.astype(np.float32)


def test_matches_numpy_reference():
  logits, targets, weights = _example()
  out = _loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  total, count = _reference(logits, targets, weights)
  assert isinstance(out, compat.LossOutput)
  assert isinstance(out.primary_loss, compat.WeightedMetric)
  np.testing.assert_allclose(out.primary_loss.unreduced_sum, total, rtol=1e-5)
  assert float(out.primary_loss.denominator) == count
  np.testing.assert_allclose(
      out.primary_loss.compute(), total / count, rtol=1e-5
  )
  assert float(out.aux_metrics["target_tokens"]) == count


def test_accuracy_metric_counts_argmax_hits_on_targets():
  logits = np.zeros((1, 3, 4), np.float32)
  logits[0, 0, 2] = logits[0, 1, 1] = logits[0, 2, 3] = 5.0
  targets = np.array([[2, 0, 3]], np.int32)
  weights = np.array([[1.0, 1.0, 0.0]], np.float32)
  out = _loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  accuracy = out.aux_metrics["accuracy"]
  assert float(accuracy.unreduced_sum) == 1.0
  assert float(accuracy.denominator) == 2.0


def test_bool_weights_and_token_cross_entropy():
  logits, targets, _ = _example(seed=1)
  mask = np.zeros(targets.shape, bool)
  mask[:, ::2] = True
  out = _loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  total, count = _reference(logits, targets, mask.astype(np.float64))
  np.testing.assert_allclose(
      out.primary_loss.compute(), total / count, rtol=1e-5
  )
  ce = loss_lib.token_cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
  assert ce.shape == targets.shape and ce.dtype == jnp.float32
  ones = np.ones(targets.shape)
  np.testing.assert_allclose(
      ce.sum(), _reference(logits, targets, ones)[0], rtol=1e-5
  )


def test_bf16_logits_give_float32_loss():
  logits, targets, weights = _example(seed=2)
  bf16 = jnp.asarray(logits, jnp.bfloat16)
  out = _loss(bf16, jnp.asarray(targets), jnp.asarray(weights))
  assert out.primary_loss.unreduced_sum.dtype == jnp.float32
  assert out.primary_loss.denominator.dtype == jnp.float32
  # Computed in float32 from the bf16-rounded logits.
  total, count = _reference(
      np.asarray(bf16.astype(jnp.float32)), targets, weights
  )
  np.testing.assert_allclose(
      out.primary_loss.compute(), total / count, rtol=1e-5
  )


def test_zero_total_weight_gives_zero_loss_and_zero_gradients():
  logits, targets, _ = _example(seed=3)
  weights = jnp.zeros(targets.shape, jnp.float32)
  value, grad = _mean_and_grad(
      jnp.asarray(logits), jnp.asarray(targets), weights
  )
  assert float(value) == 0.0
  assert np.isfinite(grad).all() and not np.asarray(grad).any()


@pytest.mark.parametrize("bad_id", [-5, 11, 10**6])
def test_inactive_targets_may_hold_any_id(bad_id):
  logits, targets, weights = _example(seed=4)
  targets = targets.copy()
  weights = weights.copy()
  targets[1, :] = bad_id
  weights[1, :] = 0.0
  value, grad = _mean_and_grad(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  assert np.isfinite(value) and np.isfinite(grad).all()
  total, count = _reference(logits[:1], targets[:1], weights[:1])
  np.testing.assert_allclose(value, total / count, rtol=1e-5)
  assert not np.asarray(grad[1]).any()


def test_halves_sum_to_the_whole_batch_mean():
  logits, targets, weights = _example(seed=5)
  weights[1, :4] = 0.0  # uneven target counts in the two halves.
  parts = [
      _loss(
          jnp.asarray(logits[s]),
          jnp.asarray(targets[s]),
          jnp.asarray(weights[s]),
      ).primary_loss
      for s in (slice(0, 1), slice(1, 2))
  ]
  whole = _loss(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  ).primary_loss
  combined = compat.WeightedMetric(
      unreduced_sum=parts[0].unreduced_sum + parts[1].unreduced_sum,
      denominator=parts[0].denominator + parts[1].denominator,
  )
  np.testing.assert_allclose(combined.compute(), whole.compute(), rtol=1e-6)
  # The mean of the two means differs: that is why the sums are returned.
  assert parts[0].denominator != parts[1].denominator


def test_gradient_matches_softmax_minus_one_hot():
  logits, targets, weights = _example(seed=6)
  weights[:] = 0.0
  weights[0, :3] = [2.0, 0.0, 1.0]
  weights[1, 5] = 1.0
  _, grad = _mean_and_grad(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  grad = np.asarray(grad)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  onehot = np.eye(logits.shape[-1])[targets]
  expected = weights[..., None] * (probs - onehot) / 3.0
  np.testing.assert_allclose(grad, expected, atol=1e-6)


def test_bad_shapes_and_dtypes_raise():
  logits = jnp.zeros((2, 3, 5))
  targets = jnp.zeros((2, 3), jnp.int32)
  weights = jnp.ones((2, 3))
  with pytest.raises(ValueError, match=r"logits must have shape"):
    loss_lib.diffusion_loss(jnp.zeros((2, 3)), targets, weights)
  with pytest.raises(ValueError, match=r"targets must have shape"):
    loss_lib.diffusion_loss(logits, jnp.zeros((2, 4), jnp.int32), weights)
  with pytest.raises(ValueError, match=r"loss_weights must have the shape"):
    loss_lib.diffusion_loss(logits, targets, jnp.ones((2, 4)))
  with pytest.raises(TypeError, match=r"targets must have an integer dtype"):
    loss_lib.diffusion_loss(logits, jnp.zeros((2, 3)), weights)


def test_non_finite_logits_at_inactive_slots_do_not_leak_into_the_value():
  # E.g. a padded slot whose bf16 logits overflowed: its CE is NaN, but it
  # carries no weight, so the loss must not see it.
  logits, targets, weights = _example(seed=8)
  logits = logits.copy()
  weights = weights.copy()
  logits[1, 2] = np.nan
  logits[1, 3] = -np.inf
  weights[1, 2:4] = 0.0
  out = _loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  total, count = _reference(
      np.nan_to_num(logits, nan=0.0, neginf=0.0), targets, weights
  )
  np.testing.assert_allclose(
      out.primary_loss.compute(), total / count, rtol=1e-5
  )


# The optional certainty term (dParallel's certainty forcing).

_certain = jax.jit(
    functools.partial(loss_lib.diffusion_loss, certainty_weight=0.5,
                      certainty_temperature=2.0)
)


def _entropy_reference(logits, temperature):
  """NumPy float64 entropy [B, L] of softmax(logits / T)."""
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -(p * np.log(p)).sum(-1)


def test_certainty_term_matches_numpy_reference_on_correct_targets():
  logits, targets, weights = _example(seed=9)
  targets = targets.copy()
  targets[0, :3] = logits[0, :3].argmax(-1)  # some right predictions.
  targets[1, 0] = logits[1, 0].argmax(-1)
  weights[1, 0] = 0.0                         # right, but not a target.
  out = _certain(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  total, count = _reference(logits, targets, weights)
  selected = (logits.argmax(-1) == targets) & (weights > 0)
  assert selected.sum() >= 3
  certainty = float(
      (weights * selected * _entropy_reference(logits, 2.0)).sum()
  )
  metric = out.aux_metrics["certainty"]
  np.testing.assert_allclose(metric.unreduced_sum, certainty, rtol=1e-5)
  assert float(metric.denominator) == count
  np.testing.assert_allclose(
      out.primary_loss.unreduced_sum, total + 0.5 * certainty, rtol=1e-5
  )
  assert float(out.primary_loss.denominator) == count


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**16), weight=st.floats(0.0, 3.0),
    temperature=st.floats(0.1, 5.0),
)
def test_certainty_is_zero_at_wrong_or_unweighted_slots(
    seed, weight, temperature
):
  logits, targets, weights = _example(seed=seed)
  predicted = logits.argmax(-1)
  # Every target right where its weight is 0, wrong where it is positive.
  targets = np.where(weights > 0, (predicted + 1) % logits.shape[-1],
                     predicted).astype(np.int32)
  out = loss_lib.diffusion_loss(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights),
      certainty_weight=weight, certainty_temperature=temperature,
  )
  plain = _loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  if weight > 0:
    assert float(out.aux_metrics["certainty"].unreduced_sum) == 0.0
  np.testing.assert_allclose(
      out.primary_loss.unreduced_sum, plain.primary_loss.unreduced_sum,
      rtol=1e-6,
  )


def test_certainty_weight_zero_leaves_the_loss_exactly_unchanged():
  logits, targets, weights = _example(seed=10)
  targets = np.where(weights > 0, logits.argmax(-1), targets).astype(np.int32)
  args = (jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  plain = _loss(*args)
  off = jax.jit(functools.partial(
      loss_lib.diffusion_loss, certainty_weight=0.0, certainty_temperature=3.0
  ))(*args)
  assert set(off.aux_metrics) == set(plain.aux_metrics) == {
      "accuracy", "target_tokens"
  }
  assert float(off.primary_loss.unreduced_sum) == float(
      plain.primary_loss.unreduced_sum
  )
  assert float(off.primary_loss.denominator) == float(
      plain.primary_loss.denominator
  )


_certain_mean_and_grad = jax.jit(
    jax.value_and_grad(
        lambda x, t, w: loss_lib.diffusion_loss(
            x, t, w, certainty_weight=1.0
        ).primary_loss.compute()
    )
)


def test_certainty_gradients_are_finite_with_all_zero_weights():
  logits, targets, _ = _example(seed=11)
  logits = logits.copy()
  logits[1, 2, 3] = -np.inf  # no weight anywhere: nothing may leak.
  targets = logits.argmax(-1).astype(np.int32)
  value, grad = _certain_mean_and_grad(
      jnp.asarray(logits), jnp.asarray(targets),
      jnp.zeros(targets.shape, jnp.float32),
  )
  assert float(value) == 0.0
  assert np.isfinite(grad).all() and not np.asarray(grad).any()


def test_certainty_gradient_is_finite_with_minus_inf_logits_at_targets():
  logits, _, weights = _example(seed=12)
  logits = logits.copy()
  logits[..., 0] = -np.inf  # e.g. a suppressed id, at every slot.
  targets = logits.argmax(-1).astype(np.int32)
  value, grad = _certain_mean_and_grad(
      jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  assert np.isfinite(value)
  assert np.isfinite(np.asarray(grad)[..., 1:]).all()


def test_training_on_the_certainty_term_lowers_entropy():
  logits, _, weights = _example(seed=13)
  targets = logits.argmax(-1).astype(np.int32)
  x, t, w = jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)

  def certainty(x):
    return float(_certain(x, t, w).aux_metrics["certainty"].compute())

  before = certainty(x)
  for _ in range(5):
    _, grad = _certain_mean_and_grad(x, t, w)
    x = x - 0.5 * grad
  assert certainty(x) < before


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(certainty_weight=-0.1), ValueError, "certainty_weight"),
        (dict(certainty_weight=float("nan")), ValueError, "certainty_weight"),
        (dict(certainty_temperature=0.0), ValueError, "certainty_temperature"),
        (dict(certainty_temperature=-1.0), ValueError,
         "certainty_temperature"),
        (dict(certainty_weight="1"), TypeError, "certainty_weight"),
    ],
)
def test_bad_certainty_values_raise_naming_the_argument(kwargs, error, match):
  logits = jnp.zeros((1, 2, 3))
  targets = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(error, match=match):
    loss_lib.diffusion_loss(logits, targets, jnp.ones((1, 2)), **kwargs)


def _linear_head(kernel):
  return lambda hidden: (hidden @ kernel).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("chunk", "certainty"))
def _full_and_chunked(hidden, kernel, targets, weights, *, chunk, certainty):
  """(value, grads wrt hidden and kernel) of the full and the chunked loss."""
  settings = dict(certainty_weight=certainty, certainty_temperature=1.5)

  def full(h, k):
    out = loss_lib.diffusion_loss(_linear_head(k)(h), targets, weights,
                                  **settings)
    return out.primary_loss.unreduced_sum, out

  def chunked(h, k):
    out = loss_lib.chunked_diffusion_loss(h, _linear_head(k), targets,
                                          weights, chunk=chunk, **settings)
    return out.primary_loss.unreduced_sum, out

  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      hidden, kernel)
  return grad(full), grad(chunked)


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    chunk=st.integers(1, 15),
    certainty=st.sampled_from([0.0, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_chunked_loss_equals_the_full_logits_loss(chunk, certainty, seed):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(2, 6, 5)).astype(np.float32)
  kernel = rng.normal(size=(5, 11)).astype(np.float32) * 2
  _, targets, weights = _example(seed, batch=2, length=6, vocab=11)
  ((want, want_out), want_grads), ((got, got_out), got_grads) = (
      _full_and_chunked(hidden, kernel, targets, weights, chunk=chunk,
                        certainty=certainty))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for name in want_out.aux_metrics:
    np.testing.assert_allclose(
        jax.tree.leaves(got_out.aux_metrics[name]),
        jax.tree.leaves(want_out.aux_metrics[name]), rtol=1e-6)
  assert set(got_out.aux_metrics) == set(want_out.aux_metrics)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_chunked_loss_never_holds_the_batchs_logits():
  # Compiled at [4, 512] slots with a vocabulary of 4096: the full loss holds
  # 8 MB of float32 logits, a chunk of 64 slots 1 MB.
  hidden = jnp.zeros((4, 512, 8))
  kernel = jnp.zeros((8, 4096))
  targets = jnp.zeros((4, 512), jnp.int32)
  weights = jnp.ones((4, 512))

  def temp_bytes(loss):
    grad = jax.jit(jax.grad(lambda h, k: loss(h, k).primary_loss.compute(),
                            argnums=(0, 1)))
    return grad.lower(hidden, kernel).compile().memory_analysis(
    ).temp_size_in_bytes

  full = temp_bytes(lambda h, k: loss_lib.diffusion_loss(
      _linear_head(k)(h), targets, weights))
  chunked = temp_bytes(lambda h, k: loss_lib.chunked_diffusion_loss(
      h, _linear_head(k), targets, weights, chunk=64))
  logits_bytes = 4 * 512 * 4096 * 4
  assert full >= logits_bytes > 2 * chunked


def test_head_chunk_is_checked():
  assert loss_lib.check_head_chunk(None) is None
  assert loss_lib.check_head_chunk(np.int64(8)) == 8
  with pytest.raises(ValueError, match="head_chunk must be >= 1"):
    loss_lib.check_head_chunk(0)
  for bad in (True, 2.0, "8"):
    with pytest.raises(TypeError, match="head_chunk must be an int"):
      loss_lib.check_head_chunk(bad)
  with pytest.raises(ValueError, match="hidden must have shape"):
    loss_lib.chunked_diffusion_loss(
        jnp.zeros((2, 3)), _linear_head(jnp.zeros((3, 4))),
        jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3)), chunk=2)
