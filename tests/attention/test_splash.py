"""Lazy block-causal Splash masks and kernels vs the dense reference.

Kernels run in Pallas interpret mode on CPU (slow), so shapes are small:
L=256 with 128-wide tiles (a 2 x 2 tile grid per head).
"""

import hypothesis
from hypothesis import strategies as st
import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash

L = 256
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 8


def dense_attention(query, key, value, mask, scale=HEAD_DIM**-0.5):
  """Reference: softmax attention with a bool mask [B, Q, K]; GQA by repeat."""
  repeats = query.shape[2] // key.shape[2]
  key = jnp.repeat(key, repeats, axis=2)
  value = jnp.repeat(value, repeats, axis=2)
  logits = jnp.einsum("bqnh,bknh->bnqk", query, key) * scale
  logits = jnp.where(mask[:, None], logits, -1e30)
  return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(logits, axis=-1), value)


def packed_rows(rng, batch, length, block_size, *, aligned):
  """Packed documents; `aligned` pads each one to a block multiple."""
  positions = np.zeros((batch, length), np.int32)
  segments = np.zeros((batch, length), np.int32)
  validity = np.zeros((batch, length), bool)
  for row in range(batch):
    cursor, doc = 0, 0
    while cursor < length:
      size = int(rng.integers(1, max(2, length // 2)))
      size = min(size, length - cursor)
      positions[row, cursor : cursor + size] = np.arange(size)
      segments[row, cursor : cursor + size] = doc
      validity[row, cursor : cursor + size] = True
      cursor += size
      pad = (-cursor) % block_size if aligned else 0
      pad = min(pad, length - cursor)
      # Padding: invalid, in the document's segment, positions counting on.
      positions[row, cursor : cursor + pad] = size + np.arange(pad)
      segments[row, cursor : cursor + pad] = doc
      cursor += pad
      doc += 1
  return positions, segments, validity


def qkv(seed, batch=2, length=L):
  rng = np.random.default_rng(seed)
  shapes = [(batch, length, HEADS, HEAD_DIM)] + [
      (batch, length, KV_HEADS, HEAD_DIM)
  ] * 2
  return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def dense_mask(positions, segments=None, validity=None, *, block_size):
  return masks.block_causal_mask(
      positions,
      positions,
      block_size,
      q_segment_ids=segments,
      kv_segment_ids=segments,
      kv_valid=validity,
  )


def forward_and_grads(attention, q, k, v, cotangent):
  out, vjp = jax.vjp(attention, q, k, v)
  return out, vjp(cotangent)


def assert_matches_dense(
    attention, q, k, v, mask, validity, *, fwd_tol=1e-5, grad_tol=1e-4
):
  """Forward at valid queries and q/k/v gradients of a valid-query loss."""
  rng = np.random.default_rng(7)
  keep = jnp.asarray(validity, jnp.float32)[:, :, None, None]
  cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * keep
  got, got_grads = jax.jit(
      lambda *a: forward_and_grads(attention, *a, cotangent)
  )(q, k, v)
  want, want_grads = forward_and_grads(
      lambda q, k, v: dense_attention(q, k, v, mask), q, k, v, cotangent
  )
  np.testing.assert_array_less(
      np.abs(np.asarray((got - want) * keep)).max(), fwd_tol
  )
  for name, g, w in zip("qkv", got_grads, want_grads):
    err = float(np.abs(np.asarray(g - w)).max())
    assert err <= grad_tol, f"d{name} max error {err}"


# --- masks, element by element -------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_logical_index_is_load_balance_order(cp):
  order = context_parallel.load_balance_order(64, cp)
  physical = np.arange(64, dtype=np.int32)
  np.testing.assert_array_equal(splash.logical_index(physical, 64, cp), order)
  np.testing.assert_array_equal(
      np.asarray(splash.logical_index(jnp.asarray(physical), 64, cp)), order
  )


def _materialise(mask):
  return np.asarray(mask[:, :])


@hypothesis.given(
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 70),
    q_len=st.integers(1, 40),
    q_offset=st.integers(0, 40),
)
def test_block_causal_mask_elements(num_blocks, block_size, q_len, q_offset):
  kv_len = 8 * num_blocks
  q_len = min(q_len, kv_len)
  mask = splash.BlockCausalMask((q_len, kv_len), block_size, q_offset=q_offset)
  want = masks.block_causal_mask(
      np.arange(q_len) + q_offset, np.arange(kv_len), block_size
  )[0]
  np.testing.assert_array_equal(_materialise(mask), np.asarray(want))


@hypothesis.given(
    cp=st.sampled_from([2, 4]),
    chunk=st.integers(1, 12),
    block_size=st.integers(1, 100),
    kv_reordered=st.booleans(),
)
def test_load_balanced_mask_elements(cp, chunk, block_size, kv_reordered):
  length = 2 * cp * chunk
  order = context_parallel.load_balance_order(length, cp)
  mask = splash.LoadBalancedBlockCausalMask(
      length, block_size, cp, kv_reordered=kv_reordered
  )
  kv_positions = order if kv_reordered else np.arange(length)
  want = masks.block_causal_mask(order, kv_positions, block_size)[0]
  np.testing.assert_array_equal(_materialise(mask), np.asarray(want))
  np.testing.assert_array_equal(mask.q_sequence, order)


def test_masks_are_hashable_equal_by_value_and_static_args():
  a = splash.BlockCausalMask((64, 64), 16)
  assert a == splash.BlockCausalMask((64, 64), 16)
  assert hash(a) == hash(splash.BlockCausalMask((64, 64), 16))
  assert a != splash.BlockCausalMask((64, 64), 8)
  assert a != splash.BlockCausalMask((64, 64), 16, q_offset=8)
  b = splash.LoadBalancedBlockCausalMask(64, 16, 2)
  assert b == splash.LoadBalancedBlockCausalMask(64, 16, 2, kv_reordered=True)
  assert b != splash.LoadBalancedBlockCausalMask(64, 16, 2, kv_reordered=False)
  assert b != splash.LoadBalancedBlockCausalMask(64, 16, 4)
  assert a != splash.LoadBalancedBlockCausalMask(64, 16, 2)
  assert len({a, splash.BlockCausalMask((64, 64), 16), b}) == 2
  # Equal masks share one Splash mask-info cache entry, so one mask function.
  multi = lambda m: splash_mask.MultiHeadMask([m])
  _, fn_a = info_lib.process_mask(multi(a), (64, 64))
  _, fn_b = info_lib.process_mask(
      multi(splash.BlockCausalMask((64, 64), 16)), (64, 64)
  )
  assert fn_a is fn_b

  traces = []

  def count(x, mask):
    traces.append(mask)
    return x + mask.block_size

  jitted = jax.jit(count, static_argnums=1)
  jitted(1, a)
  jitted(1, splash.BlockCausalMask((64, 64), 16))
  jitted(1, splash.BlockCausalMask((64, 64), 32))
  assert len(traces) == 2


def test_invalid_arguments_are_named():
  with pytest.raises(ValueError, match="block_size"):
    splash.BlockCausalMask((8, 8), 0)
  with pytest.raises(TypeError, match="block_size"):
    splash.BlockCausalMask((8, 8), 2.0)
  with pytest.raises(ValueError, match="q_offset"):
    splash.BlockCausalMask((8, 8), 2, q_offset=-1)
  with pytest.raises(ValueError, match="shape"):
    splash.BlockCausalMask((8,), 2)
  with pytest.raises(ValueError, match="cp_size"):
    splash.LoadBalancedBlockCausalMask(24, 2, 3)
  with pytest.raises(ValueError, match="seq_len"):
    splash.LoadBalancedBlockCausalMask(20, 2, 4)
  with pytest.raises(TypeError, match="kv_reordered"):
    splash.LoadBalancedBlockCausalMask(16, 2, 2, kv_reordered=1)
  with pytest.raises(ValueError, match="kv_tile"):
    splash.block_sizes(64, 64)
  with pytest.raises(ValueError, match="mask_mode"):
    q, k, v = qkv(0, batch=1, length=128)
    splash.splash_attention(q, k, v, block_size=4, mask_mode="fast")


# --- through the Splash kernel (interpret mode) ---------------------------

# Every block size with and without segment ids, every (segments, cp) pair
# twice; the partial last block (48) and the whole-sequence block (L).
KERNEL_CASES = [
    (1, False, 2),
    (1, True, 4),
    (16, True, 2),
    (16, False, 4),
    (48, False, 2),
    (48, True, 4),
    (L, True, 2),
    (L, False, 4),
]


@pytest.mark.parametrize("block_size,with_segments,cp", KERNEL_CASES)
def test_load_balanced_kernel_matches_dense(block_size, with_segments, cp):
  rng = np.random.default_rng(block_size + cp)
  q, k, v = qkv(block_size)
  if with_segments:
    positions, segments, validity = packed_rows(
        rng, 2, L, block_size, aligned=True
    )
  else:
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), (2, L))
    segments, validity = None, np.ones((2, L), bool)
  # Load-balanced physical order for everything, as a context-parallel batch.
  reorder = (
      lambda x: None
      if x is None
      else context_parallel.reorder_for_context_parallel(x, cp)
  )
  q, k, v = reorder(q), reorder(k), reorder(v)
  positions, segments, validity = (
      reorder(positions),
      reorder(segments),
      reorder(validity),
  )
  mask = dense_mask(positions, segments, validity, block_size=block_size)
  assert bool(
      splash.static_mask_matches(
          positions,
          block_size,
          segment_ids=segments,
          validity=validity,
          cp_size=cp,
      )
  )
  attention = lambda q, k, v: splash.splash_attention(
      q,
      k,
      v,
      block_size=block_size,
      positions=positions,
      segment_ids=segments,
      validity=None if not with_segments else validity,
      cp_size=cp,
      mask_mode="static",
  )
  assert_matches_dense(attention, q, k, v, mask, validity)


def test_query_only_load_balanced_kernel_keys_in_logical_order():
  cp, block_size = 4, 16
  q, k, v = qkv(3)
  kernel = splash.make_block_causal_kernel(
      L, HEADS, block_size, cp_size=cp, kv_reordered=False
  )
  q_phys = context_parallel.reorder_for_context_parallel(q, cp)
  order = context_parallel.load_balance_order(L, cp)
  mask = masks.block_causal_mask(order, np.arange(L), block_size)
  mask = jnp.broadcast_to(mask, (2, L, L))

  def attention(q, k, v):
    q = jnp.swapaxes(q * HEAD_DIM**-0.5, 1, 2)
    out = jax.vmap(kernel)(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
    return jnp.swapaxes(out, 1, 2)

  assert_matches_dense(attention, q_phys, k, v, mask, np.ones((2, L), bool))


def test_rectangular_mask_with_query_offset():
  block_size, q_len = 48, 128
  q, k, v = qkv(4)
  mask_obj = splash.BlockCausalMask((q_len, L), block_size, q_offset=L - q_len)
  kernel = splash_kernel.make_splash_mha(
      splash_mask.MultiHeadMask([mask_obj] * HEADS),
      block_sizes=splash.block_sizes(128, 128),
      head_shards=1,
      q_seq_shards=1,
      interpret=True,
  )
  q = q[:, L - q_len :]
  got = jax.vmap(kernel)(
      jnp.swapaxes(q * HEAD_DIM**-0.5, 1, 2),
      jnp.swapaxes(k, 1, 2),
      jnp.swapaxes(v, 1, 2),
  )
  mask = masks.block_causal_mask(
      np.arange(L - q_len, L), np.arange(L), block_size
  )
  want = dense_attention(q, k, v, jnp.broadcast_to(mask, (2, q_len, L)))
  np.testing.assert_allclose(jnp.swapaxes(got, 1, 2), want, atol=1e-5)


def test_kernel_without_partial_tiles_under_query_sharding():
  # Block size = L: every tile is full (no partial tile). JAX 0.10's grid
  # shrinking cannot shard such a mask over the query sequence;
  # make_splash_kernel can.
  block_size, cp = L, 2
  mesh = jax.make_mesh((cp,), ("sp",), axis_types=(AxisType.Auto,))
  kernel = splash.make_block_causal_kernel(
      L, HEADS, block_size, cp_size=cp, q_seq_shards=cp
  )
  kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, "sp")))
  sharded = jax.shard_map(
      lambda kernel, q, k, v: jax.vmap(kernel)(q, k, v),
      mesh=mesh,
      in_specs=(kernel_spec, P(None, None, "sp"), P(), P()),
      out_specs=P(None, None, "sp"),
      check_vma=False,
  )

  def attention(q, k, v):
    q = jnp.swapaxes(q * HEAD_DIM**-0.5, 1, 2)
    out = sharded(kernel, q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
    return jnp.swapaxes(out, 1, 2)

  re = lambda x: context_parallel.reorder_for_context_parallel(x, cp)
  q, k, v = map(re, qkv(8))
  positions = re(np.broadcast_to(np.arange(L, dtype=np.int32), (2, L)))
  mask = dense_mask(positions, block_size=block_size)
  assert_matches_dense(attention, q, k, v, mask, np.ones((2, L), bool))


# --- packed sequences -----------------------------------------------------


def test_static_mask_matches_detects_layouts():
  block_size = 16
  rng = np.random.default_rng(0)
  pos, seg, val = packed_rows(rng, 3, 128, block_size, aligned=True)
  assert bool(
      splash.static_mask_matches(pos, block_size, segment_ids=seg, validity=val)
  )
  for cp in (2, 4):
    re = lambda x: context_parallel.reorder_for_context_parallel(x, cp)
    assert bool(
        splash.static_mask_matches(
            re(pos),
            block_size,
            segment_ids=re(seg),
            validity=re(val),
            cp_size=cp,
        )
    )
    # Reordered data checked as if it were in logical order: wrong grid.
    assert not bool(
        splash.static_mask_matches(
            re(pos), block_size, segment_ids=re(seg), validity=re(val)
        )
    )
  pos_u, seg_u, val_u = packed_rows(rng, 3, 128, block_size, aligned=False)
  assert not bool(
      splash.static_mask_matches(
          pos_u, block_size, segment_ids=seg_u, validity=val_u
      )
  )
  # Block size 1: every layout with positions counting up per document.
  assert bool(
      splash.static_mask_matches(pos_u, 1, segment_ids=seg_u, validity=val_u)
  )
  # Left padding off the grid: the first valid token is not at a multiple.
  left = np.arange(128) - 5
  assert not bool(
      splash.static_mask_matches(
          left[None], block_size, validity=(left >= 0)[None]
      )
  )
  left = np.arange(128) - 32
  assert bool(
      splash.static_mask_matches(
          left[None], block_size, validity=(left >= 0)[None]
      )
  )
  # A document split in two pieces with different offsets.
  split = np.concatenate([np.arange(64), np.arange(64) + 70])
  assert not bool(splash.static_mask_matches(split[None], 2))


def test_unaligned_packing_uses_dynamic_mask_and_static_refuses():
  block_size = 16
  rng = np.random.default_rng(1)
  q, k, v = qkv(5)
  positions, segments, validity = packed_rows(
      rng, 2, L, block_size, aligned=False
  )
  assert not bool(
      splash.static_mask_matches(
          positions, block_size, segment_ids=segments, validity=validity
      )
  )
  mask = dense_mask(positions, segments, validity, block_size=block_size)
  attention = lambda q, k, v: splash.splash_attention(
      q,
      k,
      v,
      block_size=block_size,
      positions=positions,
      segment_ids=segments,
      validity=validity,
      mask_mode="auto",
  )
  assert_matches_dense(attention, q, k, v, mask, validity)
  with pytest.raises(ValueError, match="static_mask_matches"):
    splash.splash_attention(
        q,
        k,
        v,
        block_size=block_size,
        positions=positions,
        segment_ids=segments,
        validity=validity,
        mask_mode="static",
    )
  # Traced: no exception possible, so the outputs are NaN, not wrong numbers.
  traced = jax.jit(
      lambda q, k, v, p, s, m: splash.splash_attention(
          q,
          k,
          v,
          block_size=block_size,
          positions=p,
          segment_ids=s,
          validity=m,
          mask_mode="static",
      )
  )(q, k, v, positions, segments, validity)
  assert bool(jnp.all(jnp.isnan(traced)))


def test_traced_auto_mode_picks_the_right_mask_per_batch():
  block_size, cp = 16, 2
  rng = np.random.default_rng(2)
  q, k, v = qkv(6)
  auto = jax.jit(
      lambda q, k, v, p, s, m: splash.splash_attention(
          q,
          k,
          v,
          block_size=block_size,
          positions=p,
          segment_ids=s,
          validity=m,
          cp_size=cp,
      )
  )
  re = lambda x: context_parallel.reorder_for_context_parallel(x, cp)
  for aligned in (True, False):
    positions, segments, validity = map(
        re, packed_rows(rng, 2, L, block_size, aligned=aligned)
    )
    assert (
        bool(
            splash.static_mask_matches(
                positions,
                block_size,
                segment_ids=segments,
                validity=validity,
                cp_size=cp,
            )
        )
        == aligned
    )
    got = auto(re(q), re(k), re(v), positions, segments, validity)
    mask = dense_mask(positions, segments, validity, block_size=block_size)
    want = dense_attention(re(q), re(k), re(v), mask)
    keep = validity[:, :, None, None]
    np.testing.assert_array_less(
        np.abs(np.where(keep, got - want, 0)).max(), 1e-5
    )


# --- tile accounting ------------------------------------------------------


@pytest.mark.parametrize(
    "mask,shards",
    [
        (splash_mask.CausalMask((512, 512)), 1),
        (splash.BlockCausalMask((512, 512), 48), 2),
        (splash.BlockCausalMask((512, 512), 256), 1),
        (splash.LoadBalancedBlockCausalMask(512, 16, 4), 4),
        (splash.LoadBalancedBlockCausalMask(512, 100, 2), 2),
    ],
)
def test_tile_counts_match_brute_force(mask, shards):
  tile = 64 if shards < 4 else 32
  counts = splash.tile_counts(mask, tile, 128, q_seq_shards=shards)
  dense = _materialise(mask).reshape(512 // tile, tile, 4, 128).any(axis=(1, 3))
  full = _materialise(mask).reshape(512 // tile, tile, 4, 128).all(axis=(1, 3))
  kind = np.where(full, 2, np.where(dense, 1, 0)).reshape(shards, -1)
  want = np.stack([(kind == c).sum(axis=1) for c in range(3)], axis=1)
  np.testing.assert_array_equal(counts, want)
  assert counts.sum() == (512 // tile) * 4
