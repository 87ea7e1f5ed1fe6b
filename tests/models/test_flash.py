"""Block-diffusion attention for Tunix models: flash (Splash/Tokamax) vs dense.

Flash forwards run Splash in interpret mode on CPU inside the legacy
`with mesh:` context Tunix's flash path reads. L=256 with 128-wide tiles.
"""

import threading

import jax
from jax.sharding import AxisType
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash
from tunix_blockdiff.models import flash as shim
from tunix_blockdiff.attention import tokamax_path

VOCAB, L, BLOCK = 64, 256, 16
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh(
      (1, 1, 1), ("fsdp", "sp", "tp"), axis_types=(AxisType.Auto,) * 3
  )


@pytest.fixture(scope="module")
def dense_model():
  return tiny_models.tiny_qwen3(VOCAB, seed=0)


@pytest.fixture(scope="module")
def flash_model():
  # Same seed: the flash flag changes the attention path, not the weights.
  return tiny_models.tiny_qwen3(
      VOCAB, seed=0, use_flash_attention=True, flash_attention_block_size=128
  )


def _rows(doc_starts):
  """Two rows: one document, and documents starting at `doc_starts`."""
  positions = np.stack([np.arange(L), np.arange(L)]).astype(np.int32)
  segments = np.zeros((2, L), np.int32)
  for doc, start in enumerate(doc_starts):
    positions[1, start:] = np.arange(L - start)
    segments[1, start:] = doc + 1
  return positions, segments


@pytest.fixture(scope="module")
def batches():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (2, L)).astype(np.int32)
  aligned_pos, aligned_seg = _rows([48, 160])
  aligned_valid = np.ones((2, L), bool)
  aligned_valid[1, 40:48] = False  # padding up to the next block.
  aligned_valid[0, -7:] = False
  unaligned_pos, unaligned_seg = _rows([37, 150])
  return {
      "aligned": (tokens, aligned_pos, aligned_seg, aligned_valid),
      "unaligned": (
          tokens,
          unaligned_pos,
          unaligned_seg,
          np.ones((2, L), bool),
      ),
  }


def _dense_logits(model, batch):
  tokens, positions, segments, validity = batch
  return modeling.block_diffusion_logits(
      model,
      tokens,
      positions,
      block_size=BLOCK,
      validity=validity,
      segment_ids=segments,
  )


def _assert_close_at_valid(got, want, validity):
  err = np.abs(
      np.where(np.asarray(validity)[..., None], np.asarray(got - want), 0.0)
  )
  assert err.max() <= TOL, err.max()


@pytest.mark.parametrize(
    "layout,kernel,mask_mode",
    [
        ("aligned", "splash", "static"),
        ("unaligned", "splash", "dynamic"),
        ("unaligned", "tokamax", "auto"),
    ],
)
def test_flash_qwen3_matches_dense_logits(
    mesh, dense_model, flash_model, batches, layout, kernel, mask_mode
):
  if kernel == "tokamax" and not tokamax_path.tokamax_available():
    pytest.skip("tokamax is not installed")
  batch = batches[layout]
  want = _dense_logits(dense_model, batch)
  logits_fn = shim.make_logits_fn(
      flash_model,
      block_size=BLOCK,
      validity=batch[3],
      segment_ids=batch[2],
      kernel=kernel,
      mask_mode=mask_mode,
  )
  with mesh:
    got = jax.jit(logits_fn)(batch[0], batch[1])
  _assert_close_at_valid(got, want, batch[3])


def test_flash_qwen2_matches_dense_logits(mesh, batches):
  dense = tiny_models.tiny_qwen2(VOCAB, seed=1)
  flash = tiny_models.tiny_qwen2(
      VOCAB, seed=1, use_flash_attention=True, flash_attention_block_size=128
  )
  tokens, positions, segments, validity = batches["aligned"]
  with mesh:
    got = jax.jit(
        lambda t, p: shim.block_diffusion_logits(
            flash,
            t,
            p,
            block_size=BLOCK,
            validity=validity,
            segment_ids=segments,
            alignment="shifted",
            mask_mode="static",
        )
    )(tokens, positions)
  want = modeling.block_diffusion_logits(
      dense,
      tokens,
      positions,
      block_size=BLOCK,
      validity=validity,
      segment_ids=segments,
      alignment="shifted",
  )
  _assert_close_at_valid(got, want, validity)


def test_dense_models_take_the_attention_mask_path(dense_model, batches):
  batch = batches["unaligned"]
  got = shim.block_diffusion_logits(
      dense_model, batch[0], batch[1], block_size=BLOCK, segment_ids=batch[2]
  )
  want = _dense_logits(dense_model, batch)
  np.testing.assert_array_equal(got, want)
  # The context manager is a no-op for them and patches nothing.
  with shim.enable_block_diffusion_attention(dense_model, BLOCK):
    assert qwen3_lib.mask_lib.__class__.__name__ == "module"


class _InterpretSplash:
  """Stock Tunix flash attention is TPU-only; this runs it interpreted."""

  def __init__(self, original):
    self._original = original

  def __getattr__(self, name):
    return getattr(self._original, name)

  def make_splash_mha(self, *args, **kwargs):
    kwargs["interpret"] = True
    return self._original.make_splash_mha(*args, **kwargs)


def test_autoregressive_decoding_stays_causal(
    mesh, dense_model, flash_model, monkeypatch
):
  """Prefill (flash branch) and token-by-token decoding with a KV cache."""
  monkeypatch.setattr(qwen3_lib, "splash", _InterpretSplash(qwen3_lib.splash))
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 128)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(128), (2, 128))
  causal = masks.block_causal_mask(positions, positions, 1)
  want = modeling.call_model(dense_model, tokens, positions, causal)

  def prefill():
    with mesh:
      return jax.jit(
          lambda t: modeling.call_model(flash_model, t, positions, causal)
      )(tokens)

  def decode(steps=4):
    cache = flash_model.init_cache(2, steps, jnp.float32)
    step = jax.jit(lambda t, p, c, m: flash_model(t, p, c, m))
    out = []
    for i in range(steps):
      mask = jnp.broadcast_to(jnp.arange(steps) <= i, (2, 1, steps))
      logits, cache = step(
          tokens[:, i : i + 1], positions[:, i : i + 1], cache, mask
      )
      out.append(logits[:, 0])
    return jnp.stack(out, axis=1)

  # A block-diffusion forward (scope entered inside it) really differs from
  # causal, and the ordinary flash prefill traced after it is causal again.
  with mesh:
    blockwise = jax.jit(
        lambda t: shim.block_diffusion_logits(
            flash_model, t, positions, block_size=BLOCK, mask_mode="static"
        )
    )(tokens)
  assert np.abs(np.asarray(blockwise - want)).max() > 1e-3
  np.testing.assert_allclose(prefill(), want, atol=TOL)
  # Token-by-token decoding never takes the flash branch: unchanged even when
  # traced inside a scope.
  decoded = decode()
  np.testing.assert_allclose(decoded, want[:, :4], atol=TOL)
  with shim.enable_block_diffusion_attention(flash_model, BLOCK):
    np.testing.assert_array_equal(decode(), decoded)


def test_scope_restores_the_module_and_nests(flash_model):
  original_mask_lib, original_splash = qwen3_lib.mask_lib, qwen3_lib.splash
  with shim.enable_block_diffusion_attention(flash_model, 4) as outer:
    assert qwen3_lib.mask_lib is not original_mask_lib
    assert qwen2_lib.mask_lib.__class__.__name__ == "module"  # Only Qwen3's.
    mask = qwen3_lib.mask_lib.CausalMask((64, 64))
    assert mask == shim.splash.BlockCausalMask((64, 64), 4)
    with shim.enable_block_diffusion_attention(flash_model, 8, cp_size=2):
      inner = qwen3_lib.mask_lib.CausalMask((64, 64))
      assert inner == shim.splash.LoadBalancedBlockCausalMask(64, 8, 2)
    assert qwen3_lib.mask_lib.CausalMask((64, 64)) == mask
    assert outer.block_size == 4
    # Other threads see the stock causal mask while the scope is open.
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(qwen3_lib.mask_lib.CausalMask((64, 64)))
    )
    thread.start()
    thread.join()
    assert type(seen[0]) is type(original_mask_lib.CausalMask((64, 64)))
  assert qwen3_lib.mask_lib is original_mask_lib
  assert qwen3_lib.splash is original_splash
  with pytest.raises(RuntimeError, match="boom"):
    with shim.enable_block_diffusion_attention(flash_model, 4):
      raise RuntimeError("boom")
  assert qwen3_lib.mask_lib is original_mask_lib


def test_errors_are_clear(mesh, flash_model, batches):
  with pytest.raises(ValueError, match="auto"):
    with shim.enable_block_diffusion_attention(
        flash_model, 4, mask_mode="auto"
    ):
      pass
  with pytest.raises(ValueError, match="cp_size"):
    shim.FlashBlockDiffusion(4, cp_size=3)
  with pytest.raises(ValueError, match="kernel"):
    shim.FlashBlockDiffusion(4, kernel="cudnn")
  with pytest.raises(ValueError, match="runs only on gpu"):
    shim.FlashBlockDiffusion(
        4, kernel="tokamax", tokamax_implementation="triton"
    )

  class FlashGemma:

    class config:  # pylint: disable=invalid-name
      use_flash_attention = True

  with pytest.raises(ValueError, match="use_flash_attention=False"):
    with shim.enable_block_diffusion_attention(FlashGemma(), 4):
      pass
  tokens, positions, segments, validity = batches["unaligned"]
  with pytest.raises(ValueError, match="with mesh"):
    shim.block_diffusion_logits(
        flash_model, tokens, positions, block_size=BLOCK
    )
  with pytest.raises(ValueError, match="static_mask_matches"):
    with mesh:
      shim.block_diffusion_logits(
          flash_model,
          tokens,
          positions,
          block_size=BLOCK,
          segment_ids=segments,
          mask_mode="static",
      )
  # A dynamic scope without the (document, position) carrier: named error.
  with pytest.raises(ValueError, match="model_segment_ids"):
    with (
        mesh,
        shim.enable_block_diffusion_attention(
            flash_model, BLOCK, mask_mode="dynamic"
        ),
    ):
      jax.eval_shape(
          lambda t, p: flash_model(t, p, None, None), tokens, positions
      )


def test_model_segment_ids():
  positions = np.array([[0, 1, 0, 1, 2, 9]])
  segments = np.array([[0, 0, 1, 1, 1, 1]])
  validity = np.array([[1, 1, 1, 1, 1, 0]], bool)
  static = shim.model_segment_ids(
      positions, segment_ids=segments, validity=validity
  )
  np.testing.assert_array_equal(static, [[0, 0, 1, 1, 1, -1]])
  assert shim.model_segment_ids(positions) is None
  carrier = shim.model_segment_ids(
      positions, segment_ids=segments, validity=validity, position_aware=True
  )
  np.testing.assert_array_equal(carrier[..., 0], static)
  np.testing.assert_array_equal(carrier[..., 1], positions)


def _two_stream_rows(doc_starts, seed=3):
  """Two rows of L/2 slots (2L = 256: two 128-wide tiles), packed."""
  half = L // 2
  rng = np.random.default_rng(seed)
  clean = rng.integers(0, VOCAB, (2, half)).astype(np.int32)
  noised = np.where(rng.random((2, half)) < 0.5, VOCAB - 1, clean)
  positions, segments = _rows(doc_starts)
  positions, segments = positions[:, :half], segments[:, :half]
  validity = np.ones((2, half), bool)
  validity[0, -5:] = False
  return clean, noised, positions, segments, validity


@pytest.mark.parametrize("alignment,mask_mode,doc_starts", [
    ("same_position", "dynamic", [40, 100]),
    ("shifted", "dynamic", [40, 100]),
    ("same_position", "static", [48, 96]),
    ("shifted", "static", [48, 96]),
    ("shifted", "auto", [40, 100])])
def test_flash_two_stream_matches_dense(mesh, dense_model, flash_model,
                                        alignment, mask_mode, doc_starts):
  """`[x0 | xt]` through the position-aware kernel (`dynamic`), the lazy
  two-stream mask (`static`, documents at block multiples) or the choice
  between them (`auto`) == the dense two-stream logits."""
  clean, noised, positions, segments, validity = _two_stream_rows(doc_starts)
  common = dict(block_size=BLOCK, alignment=alignment, validity=validity,
                segment_ids=segments)
  want = modeling.two_stream_logits(dense_model, clean, noised, positions,
                                    **common)
  with mesh:
    got = jax.jit(lambda c, n: shim.two_stream_logits(
        flash_model, c, n, positions, q_tile=128, kv_tile=128,
        mask_mode=mask_mode, **common))(clean, noised)
  _assert_close_at_valid(got, want, validity)


def test_static_two_stream_on_a_layout_it_cannot_express(mesh, flash_model):
  """Documents off the block grid: refused when concrete, NaN when traced,
  never silently wrong."""
  clean, noised, positions, segments, validity = _two_stream_rows([40, 100])
  common = dict(block_size=BLOCK, validity=validity, segment_ids=segments,
                q_tile=128, kv_tile=128, mask_mode="static")
  with mesh:
    with pytest.raises(ValueError, match="mask_mode='static' needs"):
      shim.two_stream_logits(flash_model, clean, noised, positions, **common)
    got = jax.jit(lambda c, n, p: shim.two_stream_logits(
        flash_model, c, n, p, **common))(clean, noised, positions)
  assert np.isnan(np.asarray(got)).all()


def test_lazy_two_stream_mask_is_the_dense_one():
  for half, block in ((8, 2), (12, 3), (6, 1), (16, 16)):
    lazy = splash.TwoStreamBlockMask(2 * half, block)
    dense = masks.two_stream_mask(np.arange(half)[None], block)[0]
    np.testing.assert_array_equal(lazy[0:2 * half, 0:2 * half],
                                  np.asarray(dense))
  assert splash.TwoStreamBlockMask(8, 2) == splash.TwoStreamBlockMask(8, 2)
  assert len({splash.TwoStreamBlockMask(8, 2),
              splash.TwoStreamBlockMask(8, 4)}) == 2
  with pytest.raises(ValueError, match="length must be even"):
    splash.TwoStreamBlockMask(7, 1)


def test_two_stream_kernel_needs_a_chosen_mask_mode():
  with pytest.raises(ValueError, match="two_stream attention needs"):
    shim.FlashBlockDiffusion(BLOCK, mask_mode="auto", two_stream=True)
  with pytest.raises(ValueError, match="two_stream attention needs"):
    shim.FlashBlockDiffusion(BLOCK, mask_mode="static", two_stream=True,
                             cp_size=2)
