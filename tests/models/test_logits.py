"""Tests for the Tunix-model adapter: block-diffusion and two-stream logits.

One tiny Qwen3 (float32) for the module; every forward is jitted with the
model closed over, and shapes are kept to a few so compilation stays cheap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.attention import masks
from tunix_blockdiff.objective import alignment as alignment_lib

VOCAB, LENGTH, BLOCK = 32, 8, 2


@pytest.fixture(scope="module")
def model():
  return tiny_models.tiny_qwen3(vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def batch():
  """Row 0: one document with two padding slots; row 1: two packed docs."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB - 1, (2, LENGTH)).astype(np.int32)
  positions = np.array([[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 0, 1, 2, 3, 4]])
  segments = np.array([[0] * 6 + [1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])
  validity = np.array([[1] * 6 + [0, 0], [1] * 8], bool)
  return (
      jnp.asarray(tokens),
      jnp.asarray(positions, jnp.int32),
      jnp.asarray(segments, jnp.int32),
      jnp.asarray(validity),
  )


@pytest.fixture(scope="module")
def single_stream(model, batch):
  """All single-stream outputs from one compiled program (XLA shares the
  forward where inputs agree), keyed by (producer, alignment)."""

  @jax.jit
  def run(tokens, positions, segments, validity):
    mask = masks.block_causal_mask(
        positions,
        positions,
        BLOCK,
        q_segment_ids=segments,
        kv_segment_ids=segments,
        kv_valid=validity,
    )
    manual = modeling.call_model(model, tokens, positions, mask)
    out = {}
    for alignment in ("same_position", "shifted"):
      out["manual", alignment] = alignment_lib.align_logits(
          manual, alignment, positions, validity, segment_ids=segments
      )
      out["function", alignment] = modeling.block_diffusion_logits(
          model,
          tokens,
          positions,
          block_size=BLOCK,
          alignment=alignment,
          validity=validity,
          segment_ids=segments,
      )
      out["logits_fn", alignment] = modeling.make_logits_fn(
          model,
          block_size=BLOCK,
          alignment=alignment,
          validity=validity,
          segment_ids=segments,
      )(tokens, positions)
    return out

  return run(*batch)


@pytest.mark.parametrize("alignment", ["same_position", "shifted"])
def test_block_diffusion_logits_equals_manual_masked_call(
    single_stream, alignment
):
  got = single_stream["function", alignment]
  assert got.shape == (2, LENGTH, VOCAB) and got.dtype == jnp.float32
  np.testing.assert_allclose(
      got, single_stream["manual", alignment], atol=1e-5, rtol=1e-5
  )
  np.testing.assert_allclose(
      single_stream["logits_fn", alignment], got, atol=1e-5, rtol=1e-5
  )


def test_shifted_logits_are_same_position_logits_moved_by_position(
    single_stream, batch
):
  _, positions, segments, validity = batch
  source = jax.jit(alignment_lib.shifted_source_index)(
      positions, validity, segments
  )
  np.testing.assert_allclose(
      single_stream["function", "shifted"],
      np.take_along_axis(
          np.asarray(single_stream["function", "same_position"]),
          np.asarray(source)[:, :, None],
          axis=1,
      ),
      atol=1e-6,
  )


def test_block_size_one_same_position_is_the_causal_forward(model):
  tokens = jnp.asarray(
      np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH)), jnp.int32
  )
  # A second copy whose last token differs: no earlier logit may change.
  tokens = jnp.concatenate(
      [tokens, tokens.at[:, -1].set((tokens[:, -1] + 1) % VOCAB)]
  )
  positions = jnp.tile(jnp.arange(LENGTH, dtype=jnp.int32), (4, 1))
  causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None].repeat(4, 0)
  logits_fn = modeling.make_logits_fn(model, block_size=1)
  got, expected = jax.jit(
      lambda t, p, m: (logits_fn(t, p), modeling.call_model(model, t, p, m))
  )(tokens, positions, causal)
  np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got[2:, :-1], got[:2, :-1], atol=1e-5)
  assert not np.allclose(got[2:, -1], got[:2, -1], atol=1e-4)
  with pytest.raises(ValueError, match=r"block_size must be >= 1"):
    modeling.make_logits_fn(model, block_size=0)


@pytest.fixture(scope="module")
def two_stream_case(model, batch):
  """Two-stream logits, and single-stream logits on every canvas
  [clean blocks < k, noised blocks >= k], both alignments, one program."""
  clean, positions, segments, validity = batch
  rng = np.random.default_rng(2)
  noised = jnp.where(rng.random(clean.shape) < 0.5, VOCAB - 1, clean)
  block = np.asarray(positions) // BLOCK
  num_blocks = int(block.max()) + 1
  # Later blocks stay noised: block k cannot see them anyway.
  canvases = jnp.concatenate(
      [jnp.where(block < k, clean, noised) for k in range(num_blocks)]
  )
  tile = lambda x: jnp.concatenate([x] * num_blocks)

  @jax.jit
  def run(clean, noised, canvases, positions, segments, validity):
    out = {}
    for alignment in ("same_position", "shifted"):
      out["two", alignment] = modeling.two_stream_logits(
          model,
          clean,
          noised,
          positions,
          block_size=BLOCK,
          alignment=alignment,
          validity=validity,
          segment_ids=segments,
      )
      out["single", alignment] = modeling.block_diffusion_logits(
          model,
          canvases,
          tile(positions),
          block_size=BLOCK,
          alignment=alignment,
          validity=tile(validity),
          segment_ids=tile(segments),
      ).reshape(num_blocks, 2, LENGTH, VOCAB)
    return out

  return block, run(clean, noised, canvases, positions, segments, validity)


@pytest.mark.parametrize("alignment", ["same_position", "shifted"])
def test_two_stream_equals_single_stream_on_clean_prefix_canvas(
    two_stream_case, batch, alignment
):
  """The exactness claim: noised block k under the two-stream mask sees what
  a single-stream forward sees on [clean blocks < k, noised block k]."""
  block, out = two_stream_case
  two_stream = np.asarray(out["two", alignment])
  single = np.asarray(out["single", alignment])
  assert two_stream.shape == (2, LENGTH, VOCAB)
  valid = np.asarray(batch[3])
  checked = 0
  for row in range(2):
    for slot in range(LENGTH):
      if valid[row, slot]:
        k = block[row, slot]
        np.testing.assert_allclose(
            two_stream[row, slot],
            single[k, row, slot],
            atol=1e-5,
            rtol=1e-5,
            err_msg=f"row {row} slot {slot} block {k}",
        )
        checked += 1
  assert checked == 14
  # Not vacuous: row 0's block 1 reads differently once block 0 is noised.
  assert not np.allclose(single[0, 0, 2:4], single[1, 0, 2:4], atol=1e-4)


def test_two_stream_source_index_takes_block_starts_from_clean_stream():
  positions = jnp.array([[0, 1, 2, 3, 4, 5], [2, 0, 1, 3, 5, 4]], jnp.int32)
  same = modeling.two_stream_source_index(
      positions, block_size=2, alignment="same_position"
  )
  np.testing.assert_array_equal(same, np.tile(np.arange(6) + 6, (2, 1)))
  shifted = jax.jit(
      lambda p: modeling.two_stream_source_index(
          p, block_size=2, alignment="shifted"
      )
  )(positions)
  # Row 0: pos 1, 3, 5 (inside a block) read the noised stream at pos - 1;
  # pos 2, 4 (block starts) read the clean stream at pos - 1; pos 0 has no
  # predecessor and keeps its own noised slot.
  np.testing.assert_array_equal(shifted[0], [6, 6, 1, 8, 3, 10])
  # Row 1 is physically permuted: logical 2 (slot 0) <- clean logical 1
  # (slot 2); logical 1 (slot 2) <- noised logical 0 (slot 1 + 6); ...
  np.testing.assert_array_equal(shifted[1], [2, 7, 7, 6, 11, 3])
  with pytest.raises(ValueError, match=r"alignment must be one of"):
    modeling.two_stream_source_index(positions, block_size=2, alignment="x")
