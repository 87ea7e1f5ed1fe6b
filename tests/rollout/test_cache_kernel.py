"""`rollout.cache_kernel`: attention over each row's cached span (Pallas).

The kernel (interpret mode here) against a float64 reference for spans of
any rows (empty ones too) over several chunks and row blocks; chunks no row
of a block uses are never computed; partial results merge into the
attention over the concatenated keys; and `generate(ragged_cache=True)`
gives the default generation.
"""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import generations
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cache_kernel as ck
from tunix_blockdiff.rollout import cached

VOCAB, MASK = 64, 63


def _reference(q, keys, values, valid, scale):
  """softmax(q k^T * scale) v over the valid keys, float64; 0 if none."""
  s = np.einsum("bkqh,bksh->bkqs", q.astype(np.float64),
                keys.astype(np.float64)) * scale
  s = np.where(valid, s, -np.inf)
  top = s.max(-1, keepdims=True)
  e = np.exp(s - np.where(np.isfinite(top), top, 0.0))
  total = e.sum(-1, keepdims=True)
  return np.einsum("bkqs,bksh->bkqh", e, values) / np.where(total > 0, total,
                                                            1.0)


@settings(max_examples=15, deadline=None)
@given(batch=st.sampled_from([3, 16]), slots=st.sampled_from([48, 336]),
       seed=st.integers(0, 10_000))
def test_kernel_equals_attention_over_each_rows_span(batch, slots, seed):
  rng = np.random.default_rng(seed)
  layers, kh, q_len, h = 2, 2, 8, 8
  keys, values = (rng.normal(size=(layers, batch, kh, slots, h)).astype(
      np.float32) for _ in range(2))
  q = rng.normal(size=(batch, kh, q_len, h)).astype(np.float32)
  lo = rng.integers(0, slots, size=batch)
  hi = rng.integers(0, slots + 1, size=batch)
  hi[0] = lo[0]  # an empty span
  got = ck.partial_attention(jnp.asarray(q), jnp.asarray(keys),
                             jnp.asarray(values), 1, jnp.asarray(lo),
                             jnp.asarray(hi), scale=0.4)
  slot = np.arange(slots)
  valid = (slot >= lo[:, None]) & (slot < hi[:, None])
  want = _reference(q, keys[1], values[1], valid[:, None, None], 0.4)
  np.testing.assert_allclose(np.asarray(ck.merge([got])), want, rtol=1e-5,
                             atol=1e-5)
  assert np.all(np.asarray(got.l)[0] == 0)  # nothing valid in row 0


def test_bf16_inputs_score_in_float32():
  """A bf16 cache (the TPU's) gives the float64 reference to bf16 rounding."""
  rng = np.random.default_rng(2)
  batch, kh, slots, h = 8, 2, 224, 16
  keys, values = (rng.normal(size=(1, batch, kh, slots, h)) for _ in range(2))
  q = rng.normal(size=(batch, kh, 8, h))
  lo = rng.integers(0, 100, size=batch)
  hi = lo + rng.integers(1, 120, size=batch)
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  got = ck.merge([ck.partial_attention(bf16(q), bf16(keys), bf16(values), 0,
                                       jnp.asarray(lo), jnp.asarray(hi),
                                       scale=0.25)])
  assert got.dtype == jnp.float32
  as64 = lambda x: np.asarray(bf16(x), np.float64)
  slot = np.arange(slots)
  valid = (slot >= lo[:, None]) & (slot < hi[:, None])
  want = _reference(as64(q), as64(keys)[0], as64(values)[0],
                    valid[:, None, None], 0.25)
  np.testing.assert_allclose(np.asarray(got), want, atol=3e-2)


def test_chunks_outside_every_rows_span_are_not_computed():
  """NaN keys and values in unused chunks cannot reach the output."""
  batch, kh, slots, h = 8, 1, 336, 8  # chunks of 112: one row block
  rng = np.random.default_rng(0)
  keys = rng.normal(size=(1, batch, kh, slots, h)).astype(np.float32)
  values = keys.copy()
  # The first chunk and the last: no row uses them (0 * NaN is NaN).
  for x in (keys, values):
    x[..., :112, :] = np.nan
    x[..., 224:, :] = np.nan
  lo = np.full(batch, 112)
  hi = 112 + rng.integers(1, 113, size=batch)
  q = rng.normal(size=(batch, kh, 4, h)).astype(np.float32)
  out = ck.merge([ck.partial_attention(
      jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), 0,
      jnp.asarray(lo), jnp.asarray(hi))])
  assert np.all(np.isfinite(np.asarray(out)))


def test_partials_merge_into_attention_over_the_concatenated_keys():
  rng = np.random.default_rng(1)
  b, kh, q_len, h = 2, 2, 4, 8
  q = rng.normal(size=(b, kh, q_len, h)).astype(np.float32)
  keys = rng.normal(size=(b, kh, 20, h)).astype(np.float32)
  values = rng.normal(size=(b, kh, 20, h)).astype(np.float32)
  valid = rng.random((b, 1, q_len, 20)) < 0.7
  parts = [ck.partial_dense(jnp.asarray(q), jnp.asarray(keys[:, :, a:z]),
                            jnp.asarray(values[:, :, a:z]),
                            jnp.asarray(valid[..., a:z]))
           for a, z in ((0, 7), (7, 16), (16, 20))]
  np.testing.assert_allclose(np.asarray(ck.merge(parts)),
                             _reference(q, keys, values, valid, 1.0),
                             rtol=1e-5, atol=1e-5)


def test_chunks_are_multiples_of_16_that_divide_the_cache():
  assert [ck.chunk_size(s) for s in (16, 48, 128, 336, 512)] == [
      16, 48, 128, 112, 128]
  with pytest.raises(ValueError, match="multiple of 16"):
    ck.chunk_size(20)


@pytest.mark.parametrize("schedule", [
    dict(threshold=0.2, alignment="shifted"),
    dict(steps_per_block=2),
])
def test_generate_with_the_kernel_gives_the_default_generation(schedule):
  model = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  rng = np.random.default_rng(3)
  lengths = np.array([11, 1, 6, 9])
  prompts = rng.integers(0, MASK, size=(4, 11))
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK,
                                    **schedule)
  runs = [cached.generate(model, prompts, lengths, config, max_new_tokens=21,
                          cache_phases=2, ragged_cache=ragged)
          for ragged in (False, True)]
  generations.assert_same_generation(runs[1], runs[0])


def test_ragged_cache_is_refused_when_not_a_bool_or_without_the_cache():
  model = tiny_models.tiny_qwen3(VOCAB)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK)
  args = (model, np.ones((1, 4), int), np.array([4]), config)
  with pytest.raises(TypeError, match="ragged_cache must be a bool"):
    cached.generate(*args, max_new_tokens=4, ragged_cache="yes")
  with pytest.raises(ValueError, match="ragged_cache=True .* use_cache=True"):
    cached.generate(*args, max_new_tokens=4, ragged_cache=True,
                    use_cache=False)
  # Row blocks of 8, or one block of at most 8 rows.
  with pytest.raises(ValueError, match="at most 8 rows or a multiple of 8"):
    cached.generate(model, np.ones((12, 4), int), np.full(12, 4), config,
                    max_new_tokens=4, ragged_cache=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk=24), "chunk must be a multiple of 16 dividing the 48"),
    (dict(chunk=32), "chunk must be a multiple of 16 dividing the 48"),
    (dict(row_block=12), "row_block must be a positive multiple of 8"),
])
def test_a_bad_chunk_or_row_block_is_refused(kwargs, message):
  q = jnp.zeros((16, 1, 8, 8))
  cache = jnp.zeros((1, 16, 1, 48, 8))
  span = jnp.zeros((16,), jnp.int32)
  with pytest.raises(ValueError, match=message):
    ck.partial_attention(q, cache, cache, 0, span, span, **kwargs)


def test_row_blocks_of_16_give_the_blocks_of_8s_result():
  rng = np.random.default_rng(3)
  keys, values = (jnp.asarray(rng.normal(size=(1, 16, 2, 32, 8)), jnp.float32)
                  for _ in range(2))
  q = jnp.asarray(rng.normal(size=(16, 2, 8, 8)), jnp.float32)
  lo = jnp.asarray(rng.integers(0, 32, size=16))
  hi = jnp.asarray(rng.integers(0, 33, size=16))
  run = lambda **kw: ck.merge([ck.partial_attention(q, keys, values, 0, lo,
                                                    hi, chunk=16, **kw)])
  np.testing.assert_allclose(run(row_block=16), run(row_block=8), rtol=1e-6,
                             atol=1e-6)


def test_the_kernel_lowers_for_a_tpu_at_qwen3_0p6b_shapes():
  """The Mosaic kernel is built for a TPU (lowered here, not compiled)."""
  q = jax.ShapeDtypeStruct((128, 8, 16, 128), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((28, 128, 8, 336, 128), jnp.bfloat16)
  span = jax.ShapeDtypeStruct((128,), jnp.int32)
  program = jax.jit(lambda q, k, v, lo, hi: ck.merge([ck.partial_attention(
      q, k, v, 3, lo, hi, scale=0.1, interpret=False)]))
  text = program.trace(q, cache, cache, span, span).lower(
      lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 1
  # The cache is passed whole (the layer is picked by the index map).
  assert "28x128x8x336x128xbf16" in text
