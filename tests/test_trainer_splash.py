"""The trainer's logits through Splash (`AttentionConfig`) equal the dense.

Pallas interpret mode on CPU, a tiny Qwen3, rows of 128 slots (two-stream:
256) with packed documents and padding, under the `with mesh:` context that
Tunix's flash branch reads. Also: the choice and its refusals.
"""

import jax
from jax.sharding import AxisType
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.models import flash
from tunix_blockdiff.models import tiny as tiny_models

VOCAB, L, BLOCK = 64, 128, 16


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB - 1, (2, L)).astype(np.int32)
  inputs = np.where(rng.random((2, L)) < 0.5, VOCAB - 1, tokens)
  positions = np.stack([np.arange(L), np.arange(L)]).astype(np.int32)
  segments = np.zeros((2, L), np.int32)
  positions[1, 50:] = np.arange(L - 50)  # a second document at slot 50
  segments[1, 50:] = 1
  validity = np.ones((2, L), bool)
  validity[0, -9:] = False
  return dict(inputs=inputs, tokens=tokens, positions=positions,
              segment_ids=segments, validity=validity)


@pytest.mark.parametrize("stream,alignment", [
    ("single", "same_position"), ("single", "shifted"),
    ("two_stream", "same_position"), ("two_stream", "shifted")])
def test_splash_logits_equal_dense(batch, stream, alignment):
  model = tiny_models.tiny_qwen3(VOCAB, seed=0)
  config = config_lib.BlockDiffusionConfig(
      block_size=BLOCK, mask_token_id=VOCAB - 1, stream=stream,
      alignment=alignment,
      canvas=config_lib.CANVAS_FOR_ALIGNMENT[alignment])
  want = trainer_lib.diffusion_logits(model, config, **batch)
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  splash = config_lib.AttentionConfig("splash")
  with mesh:
    got = jax.jit(lambda b: trainer_lib.diffusion_logits(
        model, config, attention=splash, **b))(batch)
  valid = batch["validity"][..., None]
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                             atol=1e-4)
  # The model is back on its dense path afterwards.
  assert not model.config.use_flash_attention


def test_splash_with_a_chunked_head_gives_the_dense_loss(batch):
  model = tiny_models.tiny_qwen3(VOCAB, seed=0)
  config = config_lib.BlockDiffusionConfig(block_size=BLOCK,
                                           mask_token_id=VOCAB - 1)
  inputs = dict(batch, targets=batch["tokens"], loss_weights=(
      (batch["inputs"] == VOCAB - 1) & batch["validity"]).astype(np.float32))
  want = trainer_lib.make_diffusion_loss_fn(config)(model, **inputs)
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  loss_fn = trainer_lib.make_diffusion_loss_fn(
      config, config_lib.AttentionConfig("splash"), head_chunk=96)
  with mesh:
    got = jax.jit(lambda b: loss_fn(model, **b))(inputs)
  np.testing.assert_allclose(got.primary_loss.unreduced_sum,
                             want.primary_loss.unreduced_sum, rtol=1e-5)
  np.testing.assert_allclose(got.aux_metrics["accuracy"].unreduced_sum,
                             want.aux_metrics["accuracy"].unreduced_sum)


def test_auto_is_splash_on_a_tpu_where_it_can_run():
  auto = config_lib.AttentionConfig("auto")
  assert auto.uses_splash(256, "tpu", True)
  assert auto.tile_for(1536, "tpu") == 512 and auto.tile_for(384, "tpu") == 128
  assert not auto.uses_splash(256, "cpu", True)
  assert not auto.uses_splash(100, "tpu", True)  # no tile divides 100
  assert not auto.uses_splash(256, "tpu", False)  # e.g. Llama3
  assert config_lib.AttentionConfig("splash", tile=256).tile_for(384, "tpu") is None


def test_splash_where_it_cannot_run_is_refused_in_one_line():
  splash = config_lib.AttentionConfig("splash")
  with pytest.raises(ValueError, match="Qwen2 and Qwen3"):
    splash.uses_splash(256, "tpu", False)
  with pytest.raises(ValueError, match="multiple of the tile"):
    splash.uses_splash(200, "cpu", True)
  with pytest.raises(ValueError, match="implementation"):
    config_lib.AttentionConfig("flash")
  with pytest.raises(ValueError, match="multiple of 128"):
    config_lib.AttentionConfig("splash", tile=192)
  with pytest.raises(TypeError, match="attention must be"):
    trainer_lib.make_diffusion_loss_fn(
        config_lib.BlockDiffusionConfig(block_size=4, mask_token_id=1),
        attention="splash")
  with pytest.raises(ValueError, match="Qwen2 and Qwen3"):
    with flash.splash_branch(tiny_models.tiny_llama3(VOCAB, seed=0), 128):
      pass
