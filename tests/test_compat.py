"""Tests for the Tunix compatibility types (LossOutput, WeightedMetric, ...)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import compat


def test_weighted_metric_computes_sum_over_denominator():
  metric = compat.WeightedMetric(
      unreduced_sum=jnp.float32(6.0), denominator=jnp.float32(4.0)
  )
  np.testing.assert_allclose(metric.compute(), 1.5)


def test_weighted_metric_zero_denominator_is_zero_with_finite_gradient():
  def value(total):
    return compat.WeightedMetric(
        unreduced_sum=total, denominator=jnp.float32(0.0)
    ).compute()

  assert float(value(jnp.float32(3.0))) == 0.0
  grad = jax.grad(value)(jnp.float32(3.0))
  assert np.isfinite(grad) and float(grad) == 0.0


def test_weighted_metric_eps_and_min_denom():
  metric = compat.WeightedMetric(
      unreduced_sum=jnp.float32(2.0), denominator=jnp.float32(1.0), eps=1.0
  )
  np.testing.assert_allclose(metric.compute(), 1.0)
  metric = compat.WeightedMetric(
      unreduced_sum=jnp.float32(2.0),
      denominator=jnp.float32(0.5),
      min_denom=4.0,
  )
  np.testing.assert_allclose(metric.compute(), 0.5)


def test_fallback_fields_are_identical_to_tunix_main():
  # Tunix main's tunix.sft.utils field names, in order.
  names = [f.name for f in dataclasses.fields(compat.WeightedMetric)]
  assert names == ["unreduced_sum", "denominator", "eps", "min_denom"]
  names = [f.name for f in dataclasses.fields(compat.LossOutput)]
  assert names == ["primary_loss", "aux_metrics"]
  names = [f.name for f in dataclasses.fields(compat.DiffusionTokenBatch)]
  assert names == ["model_inputs", "target_ids", "loss_weights"]


def test_tunix_release_flags_reflect_installed_tunix():
  try:
    from tunix.sft.utils import LossOutput  # noqa: F401

    has_loss_output = True
  except ImportError:
    has_loss_output = False
  assert compat.TUNIX_HAS_LOSS_OUTPUT == has_loss_output


def test_loss_output_is_a_pytree_through_jit():
  @jax.jit
  def make(x):
    return compat.LossOutput(
        primary_loss=compat.WeightedMetric(
            unreduced_sum=jnp.sum(x), denominator=jnp.float32(x.size)
        ),
        aux_metrics={"count": jnp.float32(x.size)},
    )

  out = make(jnp.arange(4, dtype=jnp.float32))
  np.testing.assert_allclose(out.primary_loss.compute(), 1.5)
  np.testing.assert_allclose(out.aux_metrics["count"], 4.0)
  # eps/min_denom are static metadata, not leaves.
  assert len(jax.tree.leaves(out.primary_loss)) == 2


def _batch(**overrides):
  fields = dict(
      model_inputs={"tokens": np.zeros((2, 5), np.int32)},
      target_ids=np.zeros((2, 5), np.int32),
      loss_weights=np.ones((2, 5), np.float32),
  )
  fields.update(overrides)
  return fields


def test_diffusion_token_batch_create_accepts_valid_batch():
  batch = compat.DiffusionTokenBatch.create(**_batch())
  assert batch.target_ids.shape == (2, 5)
  # A pytree: its arrays are leaves.
  assert len(jax.tree.leaves(batch)) == 3


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"target_ids": np.zeros((10,), np.int32)}, ValueError, r"target_ids"),
        ({"target_ids": np.zeros((2, 5), np.float32)}, TypeError, r"integer"),
        (
            {"loss_weights": np.ones((2, 4), np.float32)},
            ValueError,
            r"loss_weights",
        ),
        (
            {"model_inputs": {"tokens": np.zeros((3, 5), np.int32)}},
            ValueError,
            r"batch",
        ),
        ({"model_inputs": {}}, ValueError, r"model_inputs"),
    ],
)
def test_diffusion_token_batch_rejects_bad_shapes(overrides, error, message):
  with pytest.raises(error, match=message):
    compat.DiffusionTokenBatch.create(**_batch(**overrides))
