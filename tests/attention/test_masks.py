"""Tests for dense block-causal and two-stream masks (DESIGN.md 5.1)."""

import functools

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks


def reference_block_causal(
    q_pos, kv_pos, block_size, q_seg=None, kv_seg=None, kv_valid=None
):
  """Brute force: one Python comparison per (b, q, k)."""
  q_pos, kv_pos = np.asarray(q_pos), np.asarray(kv_pos)
  batch, q_len = q_pos.shape
  kv_len = kv_pos.shape[1]
  out = np.zeros((batch, q_len, kv_len), bool)
  for b in range(batch):
    for q in range(q_len):
      for k in range(kv_len):
        same_doc = q_seg is None or q_seg[b][q] == kv_seg[b][k]
        valid = kv_valid is None or bool(kv_valid[b][k])
        causal = q_pos[b][q] // block_size >= kv_pos[b][k] // block_size
        out[b, q, k] = same_doc and valid and causal
  return out


def reference_two_stream(pos, block_size, seg=None, valid=None):
  """Brute force over the four quadrants of `[x0 | xt]`."""
  pos = np.asarray(pos)
  batch, length = pos.shape
  out = np.zeros((batch, 2 * length, 2 * length), bool)
  for b in range(batch):
    for q in range(2 * length):
      for k in range(2 * length):
        qi, ki = q % length, k % length
        q_noised, k_noised = q >= length, k >= length
        qb, kb = pos[b, qi] // block_size, pos[b, ki] // block_size
        if not q_noised and not k_noised:
          rule = kb <= qb
        elif q_noised and not k_noised:
          rule = kb < qb
        elif q_noised and k_noised:
          rule = kb == qb
        else:
          rule = False
        same_doc = seg is None or seg[b][qi] == seg[b][ki]
        ok = valid is None or bool(valid[b][ki])
        out[b, q, k] = rule and same_doc and ok
  return out


def test_maxtext_block4_length10_partial_last_block():
  pos = np.arange(10)
  mask = np.asarray(masks.block_causal_mask(pos, pos, 4))[0]
  expected = (pos[:, None] // 4) >= (pos[None, :] // 4)
  np.testing.assert_array_equal(mask, expected)
  assert mask[1, 3]  # same block, key later: attend.
  assert not mask[3, 4]  # next block: never.
  assert mask[4, 3]  # earlier block: attend.
  assert mask[8, 9]  # partial last block is bidirectional.
  assert mask[9, 8] and mask[9, 0]


def test_mask_is_boolean_with_batched_shape():
  mask = masks.block_causal_mask(np.arange(6), np.arange(6), 2)
  assert mask.dtype == jnp.bool_
  assert mask.shape == (1, 6, 6)
  pos = np.tile(np.arange(6), (3, 1))
  mask = masks.block_causal_mask(pos, pos, 2)
  assert mask.shape == (3, 6, 6) and mask.dtype == jnp.bool_


def test_rectangular_mask_with_query_offset():
  # Three queries at logical positions 2..4 against eight keys (a decode
  # chunk attending to a cache): MaxText's q_offset case.
  q_pos = np.arange(2, 5)[None]
  kv_pos = np.arange(8)[None]
  mask = np.asarray(masks.block_causal_mask(q_pos, kv_pos, 4))
  expected = (np.arange(2, 5)[:, None] // 4) >= (np.arange(8)[None, :] // 4)
  assert mask.shape == (1, 3, 8)
  np.testing.assert_array_equal(mask[0], expected)
  # Query at position 4 opens block 1: it sees keys 0..7 in blocks 0 and 1.
  assert mask[0, 2].all()
  assert mask[0, 0, :4].all() and not mask[0, 0, 4:].any()


def test_query_batch_broadcasts_against_key_batch():
  q_pos = np.arange(4)[None]
  kv_pos = np.stack([np.arange(4), np.arange(4) + 4])
  mask = np.asarray(masks.block_causal_mask(q_pos, kv_pos, 4))
  assert mask.shape == (2, 4, 4)
  assert mask[0].all() and not mask[1].any()


def test_packed_documents_not_starting_at_block_multiples():
  # Two documents of lengths 3 and 7 packed into one row: the second starts
  # at physical index 3, its logical positions restart at 0.
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
  pos = np.array([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
  mask = np.asarray(
      masks.block_causal_mask(
          pos, pos, 4, q_segment_ids=seg, kv_segment_ids=seg
      )
  )[0]
  np.testing.assert_array_equal(
      mask, reference_block_causal(pos, pos, 4, seg, seg)[0]
  )
  assert not mask[3, 2] and not mask[2, 3]  # never across documents.
  assert mask[3, 6]  # doc 1 block 0 = physical 3..6, bidirectional.
  assert not mask[6, 7]  # physical 7 is doc 1 logical 4: the next block.
  assert mask[9, 3]


def test_kv_valid_hides_padding_keys():
  pos = np.arange(6)[None]
  valid = np.array([[1, 1, 1, 1, 0, 0]], bool)
  mask = np.asarray(masks.block_causal_mask(pos, pos, 4, kv_valid=valid))[0]
  assert not mask[:, 4:].any()
  assert mask[0, :4].all()


def test_load_balanced_positions_give_the_permuted_mask():
  length, cp = 16, 2
  seg = np.array([[0] * 5 + [1] * 11])
  logical_pos = np.concatenate([np.arange(5), np.arange(11)])[None]
  original = np.asarray(
      masks.block_causal_mask(
          logical_pos, logical_pos, 4, q_segment_ids=seg, kv_segment_ids=seg
      )
  )
  order = context_parallel.load_balance_order(length, cp)
  perm_pos = context_parallel.reorder_for_context_parallel(logical_pos, cp)
  perm_seg = context_parallel.reorder_for_context_parallel(seg, cp)
  permuted = np.asarray(
      masks.block_causal_mask(
          perm_pos, perm_pos, 4, q_segment_ids=perm_seg, kv_segment_ids=perm_seg
      )
  )
  np.testing.assert_array_equal(permuted[0], original[0][order][:, order])


@pytest.mark.parametrize("block_size", [0, -3])
def test_invalid_block_size_raises(block_size):
  with pytest.raises(ValueError, match=r"block_size must be >= 1"):
    masks.block_causal_mask(np.arange(4), np.arange(4), block_size)
  with pytest.raises(ValueError, match=r"block_size must be >= 1"):
    masks.two_stream_mask(np.arange(4), block_size)


@pytest.mark.parametrize("block_size", [2.0, True, None])
def test_non_int_block_size_raises(block_size):
  with pytest.raises(TypeError, match=r"block_size must be an int"):
    masks.block_causal_mask(np.arange(4), np.arange(4), block_size)


def test_bad_positions_and_segments_raise():
  with pytest.raises(
      TypeError, match=r"q_positions must have an integer dtype"
  ):
    masks.block_causal_mask(np.arange(4.0), np.arange(4), 2)
  with pytest.raises(ValueError, match=r"kv_positions must have shape"):
    masks.block_causal_mask(np.arange(4), np.zeros((1, 2, 4), np.int32), 2)
  with pytest.raises(ValueError, match=r"given together"):
    masks.block_causal_mask(
        np.arange(4), np.arange(4), 2, q_segment_ids=np.zeros(4, np.int32)
    )
  with pytest.raises(ValueError, match=r"kv_valid must have the shape"):
    masks.block_causal_mask(
        np.arange(4), np.arange(4), 2, kv_valid=np.ones(3, bool)
    )
  with pytest.raises(ValueError, match=r"does not broadcast"):
    masks.block_causal_mask(
        np.zeros((2, 4), np.int32), np.zeros((3, 4), np.int32), 2
    )


def test_block_size_one_is_causal():
  pos = np.arange(7)
  mask = np.asarray(masks.block_causal_mask(pos, pos, 1))[0]
  np.testing.assert_array_equal(mask, np.tril(np.ones((7, 7), bool)))


@pytest.mark.parametrize("block_size", [7, 8, 100])
def test_block_size_at_least_length_is_bidirectional_within_document(
    block_size,
):
  seg = np.array([[0, 0, 0, 1, 1, 1, 1]])
  pos = np.array([[0, 1, 2, 0, 1, 2, 3]])
  mask = np.asarray(
      masks.block_causal_mask(
          pos, pos, block_size, q_segment_ids=seg, kv_segment_ids=seg
      )
  )[0]
  np.testing.assert_array_equal(mask, seg[0][:, None] == seg[0][None, :])


def test_block_causal_mask_is_jittable():
  fn = jax.jit(
      functools.partial(masks.block_causal_mask, block_size=4),
  )
  pos = jnp.arange(10)[None]
  seg = jnp.zeros((1, 10), jnp.int32)
  valid = jnp.ones((1, 10), bool)
  mask = jax.jit(
      lambda p, s, v: masks.block_causal_mask(
          p, p, 4, q_segment_ids=s, kv_segment_ids=s, kv_valid=v
      )
  )(pos, seg, valid)
  assert mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask, fn(pos, pos))
  np.testing.assert_array_equal(mask, reference_block_causal(pos, pos, 4))


def test_masks_build_no_float_intermediates():
  """Masks stay boolean/int all the way (no float L x L scratch arrays)."""
  pos = jnp.arange(16)[None]
  seg = jnp.zeros((1, 16), jnp.int32)
  valid = jnp.ones((1, 16), bool)
  programs = [
      jax.make_jaxpr(
          lambda p, s, v: masks.block_causal_mask(
              p, p, 4, q_segment_ids=s, kv_segment_ids=s, kv_valid=v
          )
      )(pos, seg, valid),
      jax.make_jaxpr(
          lambda p, s, v: masks.two_stream_mask(p, 4, segment_ids=s, valid=v)
      )(pos, seg, valid),
  ]
  for program in programs:
    for eqn in program.jaxpr.eqns:
      for var in eqn.outvars:
        assert not jnp.issubdtype(var.aval.dtype, jnp.floating), eqn


def test_two_stream_quadrants():
  block_size, length = 2, 6
  pos = np.arange(length)
  mask = np.asarray(masks.two_stream_mask(pos, block_size))[0]
  assert mask.shape == (2 * length, 2 * length) and mask.dtype == bool
  blk = pos // block_size
  clean_clean = mask[:length, :length]
  clean_noised = mask[:length, length:]
  noised_clean = mask[length:, :length]
  noised_noised = mask[length:, length:]
  # Clean stream: block-causal on itself.
  np.testing.assert_array_equal(clean_clean, blk[:, None] >= blk[None, :])
  # Clean never sees noised.
  assert not clean_noised.any()
  # Noised block: earlier clean blocks only, not its own clean block.
  np.testing.assert_array_equal(noised_clean, blk[:, None] > blk[None, :])
  # Noised block: itself bidirectionally, never another noised block.
  np.testing.assert_array_equal(noised_noised, blk[:, None] == blk[None, :])
  # Never the future, in either stream.
  for q in range(2 * length):
    for k in range(2 * length):
      if blk[k % length] > blk[q % length]:
        assert not mask[q, k]


def test_two_stream_with_segments_and_padding_matches_reference():
  pos = np.array([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8])
  valid = np.array([[1] * 7 + [0], [1] * 5 + [0] * 3], bool)
  mask = jax.jit(
      lambda p, s, v: masks.two_stream_mask(p, 2, segment_ids=s, valid=v)
  )(pos, seg, valid)
  assert mask.dtype == jnp.bool_ and mask.shape == (2, 16, 16)
  np.testing.assert_array_equal(mask, reference_two_stream(pos, 2, seg, valid))


def test_two_stream_rejects_mismatched_segments():
  with pytest.raises(ValueError, match=r"segment_ids must have the shape"):
    masks.two_stream_mask(
        np.arange(4), 2, segment_ids=np.zeros((1, 3), np.int32)
    )


@st.composite
def _rows(draw, length=10):
  """A random batch: positions (packed docs), segments, validity, a perm.

  The shape is fixed so each mask op compiles once; documents, offsets,
  padding, the permutation and the block size (up to beyond the length) vary.
  """
  batch = 2
  block_size = draw(st.integers(1, length + 2))
  rows_pos, rows_seg, rows_valid, rows_perm = [], [], [], []
  for _ in range(batch):
    # Cut the row into documents; positions restart in each.
    cuts = sorted(draw(st.sets(st.integers(1, max(1, length - 1)), max_size=3)))
    cuts = [c for c in cuts if c < length]
    starts = [0] + cuts
    pos = np.zeros(length, np.int32)
    seg = np.zeros(length, np.int32)
    for doc, start in enumerate(starts):
      end = starts[doc + 1] if doc + 1 < len(starts) else length
      offset = draw(st.integers(0, 5))  # documents need not start at 0 mod B.
      pos[start:end] = np.arange(end - start) + offset
      seg[start:end] = doc
    valid = np.array(
        draw(st.lists(st.booleans(), min_size=length, max_size=length))
    )
    perm = np.array(draw(st.permutations(list(range(length)))))
    rows_pos.append(pos)
    rows_seg.append(seg)
    rows_valid.append(valid)
    rows_perm.append(perm)
  return (
      np.stack(rows_pos),
      np.stack(rows_seg),
      np.stack(rows_valid),
      np.stack(rows_perm),
      block_size,
  )


@given(_rows())
def test_property_block_causal_mask_matches_reference(data):
  pos, seg, valid, perm, block_size = data
  got = masks.block_causal_mask(
      pos,
      pos,
      block_size,
      q_segment_ids=seg,
      kv_segment_ids=seg,
      kv_valid=valid,
  )
  expected = reference_block_causal(pos, pos, block_size, seg, seg, valid)
  np.testing.assert_array_equal(got, expected)
  # After a physical permutation the mask is the permuted mask.
  take = lambda x: np.take_along_axis(x, perm, axis=1)
  got_perm = np.asarray(
      masks.block_causal_mask(
          take(pos),
          take(pos),
          block_size,
          q_segment_ids=take(seg),
          kv_segment_ids=take(seg),
          kv_valid=take(valid),
      )
  )
  for b in range(pos.shape[0]):
    np.testing.assert_array_equal(got_perm[b], expected[b][perm[b]][:, perm[b]])


@given(_rows(length=7))
def test_property_two_stream_mask_matches_reference(data):
  pos, seg, valid, _, block_size = data
  got = masks.two_stream_mask(pos, block_size, segment_ids=seg, valid=valid)
  np.testing.assert_array_equal(
      got, reference_two_stream(pos, block_size, seg, valid)
  )
