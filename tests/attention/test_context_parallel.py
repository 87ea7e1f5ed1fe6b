"""Tests for load-balanced context-parallel ordering (DESIGN.md 5.1)."""

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.attention import context_parallel as cp_lib


def test_cp1_is_identity():
  np.testing.assert_array_equal(cp_lib.load_balance_order(7, 1), np.arange(7))
  x = np.arange(14).reshape(2, 7)
  np.testing.assert_array_equal(cp_lib.reorder_for_context_parallel(x, 1), x)
  np.testing.assert_array_equal(cp_lib.restore_from_context_parallel(x, 1), x)


def test_cp2_dual_chunk_order():
  # Four chunks of 2: shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2.
  np.testing.assert_array_equal(
      cp_lib.load_balance_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5]
  )
  np.testing.assert_array_equal(cp_lib.load_balance_order(4, 2), [0, 3, 1, 2])


def test_cp4_dual_chunk_order():
  order = cp_lib.load_balance_order(16, 4)
  np.testing.assert_array_equal(
      order, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  )
  assert order.dtype == np.int32
  # Each shard's causal work (sum of logical indices + 1) is equal.
  work = (order.reshape(4, 4) + 1).sum(axis=1)
  assert len(set(work.tolist())) == 1


def test_inverse_order():
  order = cp_lib.load_balance_order(24, 4)
  inverse = cp_lib.inverse_order(order)
  np.testing.assert_array_equal(order[inverse], np.arange(24))
  np.testing.assert_array_equal(inverse[order], np.arange(24))


@pytest.mark.parametrize("cp_size", [3, 5])
def test_odd_cp_raises(cp_size):
  with pytest.raises(ValueError, match=r"cp_size must be 1 or even"):
    cp_lib.load_balance_order(60, cp_size)


@pytest.mark.parametrize("seq_len, cp_size", [(6, 2), (10, 4), (12, 4)])
def test_indivisible_length_raises(seq_len, cp_size):
  with pytest.raises(
      ValueError, match=r"seq_len must be divisible by 2 \* cp_size"
  ):
    cp_lib.load_balance_order(seq_len, cp_size)
  with pytest.raises(ValueError, match=r"seq_len must be divisible"):
    cp_lib.reorder_for_context_parallel(np.zeros((1, seq_len)), cp_size)


def test_bad_types_and_axis_raise():
  with pytest.raises(TypeError, match=r"cp_size must be an int"):
    cp_lib.load_balance_order(8, 2.0)
  with pytest.raises(ValueError, match=r"cp_size must be >= 1"):
    cp_lib.load_balance_order(8, 0)
  with pytest.raises(ValueError, match=r"axis 2 is out of range"):
    cp_lib.reorder_for_context_parallel(np.zeros((2, 8)), 2, axis=2)


def test_reorder_moves_elements_to_physical_order():
  x = np.arange(8)[None] * 10
  out = cp_lib.reorder_for_context_parallel(x, 2)
  np.testing.assert_array_equal(out[0], [0, 10, 60, 70, 20, 30, 40, 50])
  assert isinstance(out, np.ndarray)
  out_jax = cp_lib.reorder_for_context_parallel(jnp.asarray(x), 2)
  assert isinstance(out_jax, jax.Array)
  np.testing.assert_array_equal(out_jax, out)


def test_reorder_inside_jit():
  x = jnp.arange(16.0).reshape(2, 8)
  fn = jax.jit(
      lambda a: cp_lib.restore_from_context_parallel(
          cp_lib.reorder_for_context_parallel(a, 2), 2
      )
  )
  np.testing.assert_array_equal(fn(x), x)


@st.composite
def _arrays(draw):
  cp_size = draw(st.sampled_from([1, 2, 4]))
  chunks = draw(st.integers(1, 3))
  seq_len = 2 * cp_size * chunks if cp_size > 1 else draw(st.integers(1, 9))
  ndim = draw(st.integers(1, 3))
  axis = draw(st.integers(-ndim, ndim - 1))
  shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
  shape[axis] = seq_len
  use_jax = draw(st.booleans())
  x = np.arange(int(np.prod(shape))).reshape(shape)
  return (jnp.asarray(x) if use_jax else x), cp_size, axis


@given(_arrays())
def test_property_reorder_restore_round_trip(data):
  x, cp_size, axis = data
  reordered = cp_lib.reorder_for_context_parallel(x, cp_size, axis=axis)
  # NumPy stays NumPy (host pipelines); JAX stays JAX.
  assert isinstance(reordered, np.ndarray) == isinstance(x, np.ndarray)
  assert reordered.shape == x.shape
  np.testing.assert_array_equal(
      cp_lib.restore_from_context_parallel(reordered, cp_size, axis=axis), x
  )
  # Reordering is a gather by load_balance_order along `axis`.
  order = cp_lib.load_balance_order(x.shape[axis], cp_size)
  np.testing.assert_array_equal(reordered, np.take(np.asarray(x), order, axis))


def test_reorder_batch_permutes_every_per_token_field_together():
  batch = {
      "tokens": np.arange(16).reshape(2, 8),
      "positions": np.tile(np.arange(8), (2, 1)),
      "segment_ids": np.zeros((2, 8), np.int32),
      "validity": np.ones((2, 8), bool),
      "completion": np.arange(16).reshape(2, 8) % 3 == 0,
      "loss_weights": jnp.arange(16.0).reshape(2, 8),
      "example_ids": np.array([5, 9]),
      "prompt_lengths": np.array([[3], [4]]),
      "step": 7,
  }
  out = cp_lib.reorder_batch_for_context_parallel(batch, 2)
  order = cp_lib.load_balance_order(8, 2)
  for name in (
      "tokens",
      "positions",
      "segment_ids",
      "validity",
      "completion",
      "loss_weights",
  ):
    np.testing.assert_array_equal(out[name], np.asarray(batch[name])[:, order])
  assert isinstance(out["loss_weights"], jax.Array)
  assert out["example_ids"] is batch["example_ids"]
  assert out["prompt_lengths"] is batch["prompt_lengths"]
  assert out["step"] == 7
  # The input mapping is untouched.
  np.testing.assert_array_equal(batch["tokens"], np.arange(16).reshape(2, 8))


def test_reorder_batch_needs_seq_len_without_tokens():
  with pytest.raises(ValueError, match=r"seq_len is required"):
    cp_lib.reorder_batch_for_context_parallel({"x": np.zeros((1, 4))}, 2)
  out = cp_lib.reorder_batch_for_context_parallel(
      {"x": np.arange(4)[None]}, 2, seq_len=4
  )
  np.testing.assert_array_equal(out["x"], [[0, 3, 1, 2]])
