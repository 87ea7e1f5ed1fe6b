"""Block-causal attention through Tokamax (XLA path on CPU) vs dense."""

import builtins

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import tokamax_path

requires_tokamax = pytest.mark.skipif(
    not tokamax_path.tokamax_available(),
    reason="the optional `tokamax` package is not installed",
)

B, L, N, K, H, BLOCK = 2, 64, 4, 2, 8, 16


def _dense(query, key, value, mask):
  key = jnp.repeat(key, N // K, axis=2)
  value = jnp.repeat(value, N // K, axis=2)
  logits = jnp.einsum("bqnh,bknh->bnqk", query, key) * H**-0.5
  logits = jnp.where(mask[:, None], logits, -1e30)
  return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(logits, axis=-1), value)


@requires_tokamax
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", None])
def test_tokamax_matches_dense_on_unaligned_load_balanced_rows(implementation):
  rng = np.random.default_rng(0)
  query = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
  key, value = (
      jnp.asarray(rng.normal(size=(B, L, K, H)), jnp.float32) for _ in range(2)
  )
  # Packed documents at unaligned starts, padding, then load-balanced order.
  positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
  segments = np.zeros((B, L), np.int32)
  positions[1, 21:] = np.arange(L - 21)
  segments[1, 21:] = 1
  validity = np.ones((B, L), bool)
  validity[0, -5:] = False
  batch = context_parallel.reorder_batch_for_context_parallel(
      dict(q=query, k=key, v=value, p=positions, s=segments, m=validity),
      2,
      seq_len=L,
  )
  mask = masks.block_causal_mask(
      batch["p"],
      batch["p"],
      BLOCK,
      q_segment_ids=batch["s"],
      kv_segment_ids=batch["s"],
      kv_valid=batch["m"],
  )
  keep = jnp.asarray(batch["m"], jnp.float32)[:, :, None, None]
  cotangent = jnp.asarray(rng.normal(size=query.shape), jnp.float32) * keep

  def run(attention, *args):
    out, vjp = jax.vjp(attention, *args)
    return out, vjp(cotangent)

  got, got_grads = jax.jit(
      lambda q, k, v: run(
          lambda q, k, v: tokamax_path.tokamax_block_causal_attention(
              q,
              k,
              v,
              block_size=BLOCK,
              positions=batch["p"],
              segment_ids=batch["s"],
              validity=batch["m"],
              implementation=implementation,
          ),
          q,
          k,
          v,
      )
  )(batch["q"], batch["k"], batch["v"])
  want, want_grads = run(
      lambda q, k, v: _dense(q, k, v, mask), batch["q"], batch["k"], batch["v"]
  )
  assert float(jnp.abs((got - want) * keep).max()) <= 1e-5
  for g, w in zip(got_grads, want_grads):
    assert float(jnp.abs(g - w).max()) <= 1e-4


def test_implementations_are_chosen_by_backend():
  assert tokamax_path.resolve_implementation(None, "cpu") == "xla"
  assert tokamax_path.resolve_implementation(None, "gpu") == "triton"
  assert tokamax_path.resolve_implementation(None, "tpu") == "mosaic"
  assert tokamax_path.resolve_implementation("mosaic", "tpu") == "mosaic"
  assert (
      tokamax_path.resolve_implementation("xla_chunked", "gpu") == "xla_chunked"
  )
  for implementation in ("triton", "cudnn", "mosaic"):
    with pytest.raises(
        ValueError, match=f"{implementation!r} runs only on .*'cpu'"
    ):
      tokamax_path.resolve_implementation(implementation, "cpu")
  with pytest.raises(ValueError, match="runs only on gpu.*'tpu'"):
    tokamax_path.resolve_implementation("triton", "tpu")
  with pytest.raises(ValueError, match="implementation must be one of"):
    tokamax_path.resolve_implementation("flash", "gpu")


def test_gpu_only_implementation_fails_before_compute_on_cpu():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ValueError, match="'triton' runs only on gpu"):
    tokamax_path.tokamax_block_causal_attention(
        q,
        q,
        q,
        block_size=2,
        positions=jnp.arange(8)[None],
        implementation="triton",
    )


def test_bad_mask_is_named():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(TypeError, match="mask must be bool"):
    tokamax_path.tokamax_attention(q, q, q, jnp.ones((1, 8, 8), jnp.int32))
  with pytest.raises(ValueError, match="mask must have shape"):
    tokamax_path.tokamax_attention(q, q, q, jnp.ones((1, 8, 4), bool))


def test_missing_tokamax_is_a_clear_import_error(monkeypatch):
  real_import = builtins.__import__

  def no_tokamax(name, *args, **kwargs):
    if name == "tokamax" or name.startswith("tokamax."):
      raise ImportError("No module named 'tokamax'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_tokamax)
  monkeypatch.delitem(__import__("sys").modules, "tokamax", raising=False)
  assert not tokamax_path.tokamax_available()
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ImportError, match="pip install tokamax"):
    tokamax_path.tokamax_attention(
        q, q, q, jnp.ones((1, 8, 8), bool), implementation="xla"
    )
