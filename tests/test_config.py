"""Tests for the frozen, validated BlockDiffusionConfig and DenoiseConfig."""

import dataclasses

import pytest

from tunix_blockdiff import config as config_lib

BlockDiffusionConfig = config_lib.BlockDiffusionConfig
DenoiseConfig = config_lib.DenoiseConfig


def test_block_diffusion_defaults_match_design():
  config = BlockDiffusionConfig(block_size=4, mask_token_id=7)
  assert config.alignment == "same_position"
  assert config.canvas == "all_masked"
  assert config.stream == "single"
  assert config.min_noise == pytest.approx(1e-3)
  assert config.loss_weighting == "uniform"


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_below_one_raises_naming_field(block_size):
  with pytest.raises(ValueError, match=r"block_size must be >= 1"):
    BlockDiffusionConfig(block_size=block_size, mask_token_id=0)
  with pytest.raises(ValueError, match=r"block_size must be >= 1"):
    DenoiseConfig(block_size=block_size, mask_token_id=0)


@pytest.mark.parametrize("block_size", [2.0, True, "4", None])
def test_block_size_must_be_an_int(block_size):
  with pytest.raises(TypeError, match=r"block_size must be an int"):
    BlockDiffusionConfig(block_size=block_size, mask_token_id=0)


def test_mask_token_id_negative_raises_naming_field():
  with pytest.raises(ValueError, match=r"mask_token_id must be >= 0"):
    BlockDiffusionConfig(block_size=4, mask_token_id=-1)
  with pytest.raises(ValueError, match=r"mask_token_id must be >= 0"):
    DenoiseConfig(block_size=4, mask_token_id=-1)
  # 0 is a legal id.
  assert BlockDiffusionConfig(block_size=4, mask_token_id=0).mask_token_id == 0


@pytest.mark.parametrize(
    "alignment, canvas",
    [("same_position", "seed_and_mask"), ("shifted", "all_masked")],
)
def test_unsupported_alignment_canvas_pairs_raise(alignment, canvas):
  with pytest.raises(ValueError, match=r"canvas=.*alignment=") as info:
    BlockDiffusionConfig(
        block_size=4, mask_token_id=0, alignment=alignment, canvas=canvas
    )
  assert "same_position+all_masked" in str(info.value)


@pytest.mark.parametrize(
    "alignment, canvas",
    [("same_position", "all_masked"), ("shifted", "seed_and_mask")],
)
def test_supported_alignment_canvas_pairs_build(alignment, canvas):
  config = BlockDiffusionConfig(
      block_size=2, mask_token_id=0, alignment=alignment, canvas=canvas
  )
  assert (config.alignment, config.canvas) == (alignment, canvas)


def test_unknown_alignment_or_canvas_raise_naming_field():
  with pytest.raises(ValueError, match=r"alignment must be one of"):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, alignment="left")
  with pytest.raises(ValueError, match=r"canvas must be one of"):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, canvas="random")
  with pytest.raises(ValueError, match=r"alignment must be one of"):
    DenoiseConfig(block_size=4, mask_token_id=0, alignment="left")


def test_seed_and_mask_needs_block_size_two():
  with pytest.raises(ValueError, match=r"block_size must be >= 2"):
    BlockDiffusionConfig(
        block_size=1,
        mask_token_id=0,
        alignment="shifted",
        canvas="seed_and_mask",
    )
  # block_size=1 is fine for all_masked (causal training).
  BlockDiffusionConfig(block_size=1, mask_token_id=0)


@pytest.mark.parametrize("min_noise", [0.0, -0.5, 1.0001, 2.0])
def test_min_noise_out_of_range_raises_naming_field(min_noise):
  with pytest.raises(
      ValueError, match=r"min_noise must satisfy 0 < min_noise <= 1"
  ):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, min_noise=min_noise)


def test_min_noise_bounds_and_type():
  assert BlockDiffusionConfig(4, 0, min_noise=1.0).min_noise == 1.0
  assert BlockDiffusionConfig(4, 0, min_noise=1).min_noise == 1
  with pytest.raises(TypeError, match=r"min_noise must be a float"):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, min_noise="0.1")


@pytest.mark.parametrize("stream", ["single", "two_stream", "clean_prefix"])
def test_known_streams_build(stream):
  assert BlockDiffusionConfig(4, 0, stream=stream).stream == stream


def test_unknown_stream_and_loss_weighting_raise_naming_field():
  with pytest.raises(ValueError, match=r"stream must be one of"):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, stream="three_stream")
  with pytest.raises(ValueError, match=r"loss_weighting must be one of"):
    BlockDiffusionConfig(block_size=4, mask_token_id=0, loss_weighting="t2")
  assert (
      BlockDiffusionConfig(4, 0, loss_weighting="elbo").loss_weighting == "elbo"
  )


def test_configs_are_frozen_and_hashable():
  config = BlockDiffusionConfig(block_size=4, mask_token_id=0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.block_size = 8  # type: ignore[misc]
  denoise = DenoiseConfig(block_size=4, mask_token_id=0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    denoise.threshold = 0.5  # type: ignore[misc]
  # Usable as a static jit argument / dict key.
  assert hash(config) == hash(
      BlockDiffusionConfig(block_size=4, mask_token_id=0)
  )
  assert config == BlockDiffusionConfig(block_size=4, mask_token_id=0)


def test_denoise_defaults_match_design():
  config = DenoiseConfig(block_size=4, mask_token_id=3)
  assert config.threshold == pytest.approx(0.9)
  assert config.alignment == "same_position"
  assert config.steps_per_block is None
  assert config.temperature == 0.0
  assert config.top_k is None and config.top_p is None
  assert config.eos_token_id is None
  assert config.pad_token_id == 0


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.5])
def test_threshold_out_of_range_raises_naming_field(threshold):
  with pytest.raises(
      ValueError, match=r"threshold must satisfy 0 < threshold <= 1"
  ):
    DenoiseConfig(block_size=4, mask_token_id=0, threshold=threshold)


def test_threshold_one_is_allowed():
  assert (
      DenoiseConfig(block_size=4, mask_token_id=0, threshold=1.0).threshold
      == 1.0
  )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps_per_block": 0}, r"steps_per_block must be >= 1"),
        ({"temperature": -1.0}, r"temperature must be >= 0"),
        ({"top_k": 0}, r"top_k must be >= 1"),
        ({"top_p": 0.0}, r"top_p must satisfy 0 < top_p <= 1"),
        ({"top_p": 1.5}, r"top_p must satisfy 0 < top_p <= 1"),
        ({"eos_token_id": -2}, r"eos_token_id must be >= 0"),
        ({"pad_token_id": -1}, r"pad_token_id must be >= 0"),
        ({"eos_token_id": 0}, r"eos_token_id must differ from mask_token_id"),
    ],
)
def test_denoise_sampling_fields_validated(kwargs, message):
  with pytest.raises(ValueError, match=message):
    DenoiseConfig(block_size=4, mask_token_id=0, **kwargs)


def test_certainty_fields_default_off_and_validate_naming_the_field():
  config = BlockDiffusionConfig(4, 0)
  assert config.certainty_weight == 0.0
  assert config.certainty_temperature == 1.0
  on = BlockDiffusionConfig(4, 0, certainty_weight=1, certainty_temperature=2)
  assert (on.certainty_weight, on.certainty_temperature) == (1, 2)
  for bad in (-0.5, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"certainty_weight must be"):
      BlockDiffusionConfig(4, 0, certainty_weight=bad)
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match=r"certainty_temperature must be"):
      BlockDiffusionConfig(4, 0, certainty_temperature=bad)
  with pytest.raises(TypeError, match=r"certainty_weight must be a float"):
    BlockDiffusionConfig(4, 0, certainty_weight="0.1")
