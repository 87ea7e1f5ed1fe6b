"""Tests for logit-to-target alignment (DESIGN.md section 2)."""

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.objective import alignment

# One compiled program per shape instead of dozens of eager ops per call.
_align = jax.jit(alignment.align_logits, static_argnames=("alignment",))


def reference_source(positions, validity, segments):
  """Brute force: the physical slot holding (segment, pos - 1), valid."""
  batch, length = positions.shape
  out = np.tile(np.arange(length), (batch, 1))
  for b in range(batch):
    for i in range(length):
      if not validity[b, i]:
        continue
      for j in range(length):
        if (
            validity[b, j]
            and segments[b, j] == segments[b, i]
            and positions[b, j] == positions[b, i] - 1
        ):
          out[b, i] = j
  return out


def test_same_position_is_identity():
  logits = jnp.arange(24.0).reshape(2, 4, 3)
  out = _align(logits, "same_position")
  np.testing.assert_array_equal(out, logits)
  # Positions are irrelevant for same_position.
  out = _align(logits, "same_position", positions=jnp.array([[3, 2, 1, 0]] * 2))
  np.testing.assert_array_equal(out, logits)


def test_shifted_without_positions_takes_previous_slot():
  logits = jnp.arange(8.0).reshape(1, 4, 2)
  out = _align(logits, "shifted")
  np.testing.assert_array_equal(out, logits[:, [0, 0, 1, 2], :])
  assert out.dtype == logits.dtype


def test_shifted_follows_logical_positions_after_reordering():
  positions = jnp.array([[0, 3, 1, 2]], jnp.int32)
  logits = positions[..., None].astype(jnp.float32)
  out = _align(
      logits,
      "shifted",
      positions=positions,
      validity=jnp.ones_like(positions, bool),
  )
  np.testing.assert_array_equal(out[..., 0], [[0, 2, 0, 1]])


def test_shifted_defaults_to_all_valid():
  positions = jnp.array([[0, 3, 1, 2]], jnp.int32)
  logits = positions[..., None].astype(jnp.float32)
  explicit = _align(logits, "shifted", positions, jnp.ones((1, 4), bool))
  default = _align(logits, "shifted", positions)
  np.testing.assert_array_equal(default, explicit)


def test_padding_is_never_the_source_of_logical_position_one():
  positions = jnp.array([[0, 3, 1, 2, 0, 0]], jnp.int32)
  validity = jnp.array([[1, 1, 1, 1, 0, 0]], bool)
  logits = jnp.arange(6.0).reshape(1, 6, 1)
  out = _align(logits, "shifted", positions, validity)
  np.testing.assert_array_equal(out[0, :4, 0], [0, 3, 0, 2])
  # Left padding at logical position 0 before the real logical 0.
  positions = jnp.array([[0, 0, 0, 1, 2]], jnp.int32)
  validity = jnp.array([[0, 0, 1, 1, 1]], bool)
  out = _align(jnp.arange(5.0).reshape(1, 5, 1), "shifted", positions, validity)
  np.testing.assert_array_equal(out[0, 2:, 0], [2, 2, 3])


def test_packed_segments_do_not_leak_across_documents():
  positions = jnp.array([[0, 1, 2, 0, 1, 2]], jnp.int32)
  segments = jnp.array([[0, 0, 0, 1, 1, 1]], jnp.int32)
  logits = jnp.arange(6.0).reshape(1, 6, 1)
  out = _align(logits, "shifted", positions, segment_ids=segments)
  # Doc 1's logical 0 (physical 3) keeps its own logit, not doc 0's last.
  np.testing.assert_array_equal(out[0, :, 0], [0, 0, 1, 3, 3, 4])


def test_invalid_alignment_and_shapes_raise():
  logits = jnp.zeros((1, 4, 3))
  with pytest.raises(ValueError, match=r"alignment must be one of"):
    alignment.align_logits(logits, "left")
  with pytest.raises(ValueError, match=r"positions must match logits"):
    alignment.align_logits(
        logits, "shifted", positions=jnp.zeros((1, 3), jnp.int32)
    )
  with pytest.raises(ValueError, match=r"validity must match logits"):
    alignment.align_logits(logits, "shifted", validity=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match=r"segment_ids must match logits"):
    alignment.align_logits(
        logits, "shifted", segment_ids=jnp.zeros((1, 5), jnp.int32)
    )
  with pytest.raises(ValueError, match=r"logits must have shape"):
    alignment.align_logits(jnp.zeros((4, 3)), "shifted")


def test_align_logits_is_jittable():
  fn = jax.jit(lambda x, p, v: alignment.align_logits(x, "shifted", p, v))
  positions = jnp.array([[0, 3, 1, 2, 0, 0]], jnp.int32)
  validity = jnp.array([[1, 1, 1, 1, 0, 0]], bool)
  logits = jnp.arange(6.0).reshape(1, 6, 1)
  np.testing.assert_array_equal(
      fn(logits, positions, validity),
      alignment.align_logits(logits, "shifted", positions, validity),
  )


def test_shifted_source_index_dtype_and_self_fallback():
  source = jax.jit(alignment.shifted_source_index)(
      jnp.array([[5, 0, 7]], jnp.int32)
  )
  assert source.dtype == jnp.int32
  # 5 and 7 have no predecessor at 4 / 6: they keep their own slot.
  np.testing.assert_array_equal(source, [[0, 1, 2]])


_BATCH, _LENGTH = 2, 10
_jit_shifted = jax.jit(
    lambda x, p, v, s: alignment.align_logits(x, "shifted", p, v, segment_ids=s)
)


@st.composite
def _rows(draw):
  # One shape, so the jitted function compiles once; the content (documents,
  # permutation, padding) is what varies.
  batch, length = _BATCH, _LENGTH
  positions = np.zeros((batch, length), np.int32)
  segments = np.zeros((batch, length), np.int32)
  for row in range(batch):
    start, doc = 0, 0
    while start < length:
      size = draw(st.integers(1, length - start))
      positions[row, start : start + size] = np.arange(size)
      segments[row, start : start + size] = doc
      start, doc = start + size, doc + 1
    perm = np.array(draw(st.permutations(list(range(length)))))
    positions[row], segments[row] = positions[row, perm], segments[row, perm]
  validity = np.array(
      draw(
          st.lists(
              st.lists(st.booleans(), min_size=length, max_size=length),
              min_size=batch,
              max_size=batch,
          )
      )
  )
  # Padding slots get arbitrary positions, often colliding with real ones.
  junk = np.array(
      draw(
          st.lists(
              st.lists(st.integers(0, 3), min_size=length, max_size=length),
              min_size=batch,
              max_size=batch,
          )
      )
  )
  positions = np.where(validity, positions, junk).astype(np.int32)
  return positions, validity, segments


@given(_rows())
def test_property_shifted_matches_brute_force(data):
  positions, validity, segments = data
  batch, length = positions.shape
  logits = np.arange(batch * length * 2, dtype=np.float32).reshape(
      batch, length, 2
  )
  out = _jit_shifted(jnp.asarray(logits), positions, validity, segments)
  source = reference_source(positions, validity, segments)
  np.testing.assert_array_equal(
      out, np.take_along_axis(logits, source[:, :, None], axis=1)
  )
