"""`rollout.window_attention`: the cached driver's model call and cache writes.

The attention core against a NumPy reference over the concatenated keys;
`write_blocks` against NumPy for any start slots and chosen rows (an update
of whole chunks); `window_call` on
every family against the Tunix model's own full-sequence logits; the
refusal of a model it does not know; and a flash-configured model, which
the driver now runs with its own attention.
"""

import dataclasses
import functools
import re

from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.attention import masks
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import window_attention as wa
from tunix_blockdiff.rollout import window_families

VOCAB = 64


def _reference_attention(q, keys, values, visible, scale):
  """softmax(q k^T * scale, masked) v over one key axis, float64."""
  b, t, n, h = q.shape
  kh = keys.shape[2]
  q = q.reshape(b, t, kh, n // kh, h).astype(np.float64)
  scores = np.einsum("btkgh,bskh->bkgts", q, keys) * scale
  scores = np.where(visible[:, None, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bkgts,bskh->btkgh", probs, values).reshape(b, t, n, h)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), parts=st.integers(0, 2))
def test_attend_equals_attention_over_the_concatenated_keys(seed, parts):
  rng = np.random.default_rng(seed)
  b, t, n, kh, h = 2, 3, 4, 2, 8
  sizes = [int(rng.integers(1, 6)) for _ in range(parts)]
  q, k, v = (rng.normal(size=(b, t, heads, h)).astype(np.float32)
             for heads in (n, kh, kh))
  cached_parts, all_k, all_v, all_vis = [], [], [], []
  for size in sizes:
    pk, pv = (rng.normal(size=(b, kh, size, h)).astype(np.float32)
              for _ in range(2))
    valid = rng.random((b, size)) < 0.6
    cached_parts.append((jnp.asarray(pk), jnp.asarray(pv), jnp.asarray(valid)))
    all_k.append(pk.transpose(0, 2, 1, 3))
    all_v.append(pv.transpose(0, 2, 1, 3))
    all_vis.append(np.broadcast_to(valid[:, None, :], (b, t, size)))
  window = rng.random((b, t, t)) < 0.5
  window[:, np.arange(t), np.arange(t)] = True  # every query sees itself
  all_k.append(k)
  all_v.append(v)
  all_vis.append(window)
  p = window_families.Projected(jnp.asarray(q), jnp.asarray(k),
                                jnp.asarray(v), 0.35, jnp.float32)
  got = wa.attend(p, cached_parts, jnp.asarray(window))
  want = _reference_attention(q, np.concatenate(all_k, 1),
                              np.concatenate(all_v, 1),
                              np.concatenate(all_vis, 2), 0.35)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _chunked(x):
  """[L, B, K, S, H] -> the chunked cache layout [L, B, K, S / TILE, TILE, H]."""
  return x.reshape(x.shape[:3] + (-1, wa.TILE, x.shape[-1]))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_write_blocks_puts_each_chosen_rows_block_at_its_own_slots(data):
  layers, b, kh, h = 2, 4, 2, 4
  w = data.draw(st.sampled_from([3, 4, 16, 20]))
  s = data.draw(st.sampled_from([1, 2, 3])) * wa.TILE
  s = max(s, -(-w // wa.TILE) * wa.TILE)
  # Any start, or only multiples of the block (fewer chunks written).
  start_step = data.draw(st.sampled_from([1, w]))
  starts = sorted({0, start_step, (s - w) // start_step * start_step,
                   (s // 2) // start_step * start_step})
  starts = [x for x in starts if x + w <= s]
  # Starts drawn from few values, so rows often share one (one update).
  start = np.array(data.draw(st.lists(st.sampled_from(starts),
                                      min_size=b, max_size=b)))
  rows = np.array(data.draw(st.lists(st.booleans(), min_size=b, max_size=b)))
  rng = np.random.default_rng(int(start.sum()))
  cache = rng.normal(size=(layers, b, kh, s, h)).astype(np.float32)
  block = rng.normal(size=(layers, b, kh, w, h)).astype(np.float32)
  out = wa.write_blocks(
      wa.Cache(_chunked(jnp.asarray(cache)), _chunked(jnp.asarray(cache))),
      wa.Cache(jnp.asarray(block), jnp.asarray(-block)),
      jnp.asarray(start, jnp.int32), jnp.asarray(rows), start_step=start_step)
  assert out.k.shape == (layers, b, kh, s // wa.TILE, wa.TILE, h)
  for got, sign in ((wa.slots(out).k, 1), (wa.slots(out).v, -1)):
    want = cache.copy()
    for row in np.flatnonzero(rows):
      want[:, row, :, start[row]:start[row] + w] = sign * block[:, row]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_write_blocks_is_an_update_of_whole_chunks_not_a_scatter():
  """XLA's TPU backend loops a per-row scatter over the rows; no scatter.

  A 4-slot block at a multiple of 4 lies in one chunk: the update is one
  chunk wide (whole memory tiles), not four slots.
  """
  b, s, w = 3, 48, 4
  cache = wa.Cache(_chunked(jnp.zeros((2, b, 2, s, 4))),
                   _chunked(jnp.zeros((2, b, 2, s, 4))))
  block = wa.Cache(jnp.ones((2, b, 2, w, 4)), jnp.ones((2, b, 2, w, 4)))
  args = (cache, block, jnp.full((b,), 28, jnp.int32), jnp.ones((b,), bool))
  write = jax.jit(functools.partial(wa.write_blocks, start_step=w))
  out = wa.slots(write(*args))
  np.testing.assert_array_equal(np.asarray(out.k[:, :, :, 28:32]), 1.0)
  assert float(out.k.sum()) == float(block.k.sum())
  with pytest.raises(ValueError, match="start_step must be an int >= 1"):
    wa.write_blocks(*args, start_step=0)
  hlo = write.lower(*args).as_text()
  assert "scatter" not in hlo
  updates = re.findall(r"dynamic_update_slice[^\n]*", hlo)
  assert updates and all("2x3x2x1x16x4" in u for u in updates), updates


@settings(max_examples=15, deadline=None)
@given(width=st.integers(1, 40), size=st.integers(0, 64))
def test_cache_from_block_holds_the_block_at_slot_zero(width, size):
  """Whole chunks of at least max(size, width) slots; zeros past the block."""
  block = jnp.arange(2 * 1 * 2 * width * 4, dtype=jnp.float32).reshape(
      2, 1, 2, width, 4) + 1
  cache = wa.cache_from_block(wa.Cache(block, -block), size)
  chunks = -(-max(size, width) // wa.TILE)
  assert cache.k.shape == (2, 1, 2, chunks, wa.TILE, 4)
  view = wa.slots(cache)
  np.testing.assert_array_equal(np.asarray(view.k[:, :, :, :width]), block)
  np.testing.assert_array_equal(np.asarray(view.v[:, :, :, :width]), -block)
  assert not np.any(np.asarray(view.k[:, :, :, width:]))
  assert not np.any(np.asarray(view.v[:, :, :, width:]))


def test_init_cache_stacks_every_layer():
  model = tiny_models.tiny_qwen3(VOCAB, num_layers=3)
  cache = wa.init_cache(model, 2, 20, jnp.bfloat16)  # two whole chunks
  attn = model.layers[0].attn
  assert cache.k.shape == (3, 2, attn.num_kv_heads, 2, wa.TILE, attn.head_dim)
  assert wa.slots(cache).k.shape == (3, 2, attn.num_kv_heads, 32,
                                     attn.head_dim)
  assert cache.v.dtype == jnp.bfloat16


FAMILIES = {
    "qwen3": lambda: tiny_models.tiny_qwen3(VOCAB, random_mlp=True),
    "qwen2": lambda: tiny_models.tiny_qwen2(VOCAB, num_layers=1,
                                            random_mlp=True),
    "llama3": lambda: tiny_models.tiny_llama3(VOCAB, random_mlp=True),
    "gemma3": lambda: tiny_models.tiny_gemma3(VOCAB, sliding_window_size=64,
                                              random_mlp=True),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_window_call_gives_the_models_own_logits(family):
  """Prefix blocks in the cache + a window == the full block-causal call."""
  model = FAMILIES[family]()
  b, prefix, width = 2, 8, 4
  length = prefix + width
  tokens = jax.random.randint(jax.random.key(0), (b, length), 0, VOCAB)
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  block_causal = masks.block_causal_mask(positions, positions, width)
  # Each call is one compiled program, as in the driver (op by op, each of
  # the model's ops would lower and compile apart: ~250 programs).
  want, _ = nnx.jit(lambda m, *a: m(*a))(model, tokens, positions, None,
                                          block_causal)

  @nnx.jit
  def prefix_call(m, tokens, positions):
    # The prefix through window_call (no cache), written at slots [0, 8).
    _, keys, values = wa.window_call(m, tokens, positions, [],
                                     block_causal[:, :prefix, :prefix])
    return wa.write_blocks(wa.init_cache(m, b, 16, jnp.float32),
                           wa.as_block(keys, values, prefix),
                           jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool))

  cache = prefix_call(model, tokens[:, :prefix], positions[:, :prefix])
  valid = jnp.broadcast_to(jnp.arange(16) < prefix, (b, 16))
  rows = jnp.array([1, 3])

  @nnx.jit
  def window(m, cache):
    parts = [(cache, valid)]
    args = (m, tokens[:, prefix:], positions[:, prefix:], parts,
            jnp.ones((b, width, width), bool))
    got, _, _ = wa.window_call(*args)
    # `pick`: the logits of the picked slots only (here each row's own slot).
    picked, _, _ = wa.window_call(
        *args,
        pick=lambda x: jnp.take_along_axis(x, rows[:, None, None], axis=1))
    return got, picked

  got, picked = window(model, cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, prefix:]),
                             rtol=1e-5, atol=1e-5)
  assert picked.shape == (b, 1, VOCAB)
  np.testing.assert_allclose(
      np.asarray(picked[:, 0]),
      np.asarray(want[jnp.arange(b), prefix + rows]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_a_bf16_models_logits_stay_bf16_without_a_float32_copy(tied):
  """Qwen3 casts its logits to float32; the driver's call skips that copy.

  The head runs apart from the model, so the logits stay bf16 (the same
  values: the cast is exact) and no float32 [B, T, V] buffer is in the
  compiled call, for a tied (`embedder.decode`) and an untied (`lm_head`)
  head.
  """
  config = dataclasses.replace(tiny_models.qwen3_config(VOCAB),
                               dtype=jnp.bfloat16, use_tied_embedding=tied)
  model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))
  b, t = 2, 4
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, VOCAB)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.ones((b, t, t), bool)
  got, _, _ = wa.window_call(model, tokens, positions, [], mask)
  assert got.dtype == jnp.bfloat16
  want, _ = model(tokens, positions, None, mask)
  assert want.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                             rtol=2e-2, atol=2e-2)
  call = jax.jit(lambda x: wa.window_call(model, x, positions, [], mask)[0])
  hlo = call.lower(tokens).compile().as_text()
  assert f"bf16[{b},{t},{VOCAB}]" in hlo
  assert f"f32[{b},{t},{VOCAB}]" not in hlo


class _NotTunix(nnx.Module):

  def __init__(self):
    self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])


def test_a_model_it_does_not_know_is_refused_naming_use_cache():
  assert not window_families.supports(_NotTunix())
  assert window_families.supports(FAMILIES["qwen3"]())
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=VOCAB - 1)
  with pytest.raises(ValueError, match="use_cache=False"):
    cached.generate(_NotTunix(), np.ones((1, 4), int), np.array([4]), config,
                    max_new_tokens=4)


def test_a_flash_configured_model_generates_as_its_dense_twin():
  dense = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  flash_config = dataclasses.replace(dense.config, use_flash_attention=True)
  graphdef, state = nnx.split(dense)
  flash = nnx.merge(graphdef, state)
  flash.config = flash_config
  for layer in flash.layers:
    layer.attn.config = flash_config
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=VOCAB - 1,
                                    threshold=0.2)
  prompts = np.random.default_rng(0).integers(0, VOCAB - 1, (2, 6))
  args = (prompts, np.array([6, 3]), config)
  want = cached.generate(dense, *args, max_new_tokens=8)
  got = cached.generate(flash, *args, max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(got.tokens),
                                np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.commit_step),
                                np.asarray(want.commit_step))
