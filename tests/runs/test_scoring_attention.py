"""`rl_common.scoring_attention`: the rl/opd scorers' attention from recipes."""

import jax
import omegaconf
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import errors
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import rl_common


def _cfgs(rollout_attention=None, sft_attention="dense", prompt=12, new=8,
          tile=None, sft_mask_mode="auto"):
  cfg = omegaconf.OmegaConf.create({"rollout": {
      "attention": rollout_attention, "attention_tile": tile,
      "max_prompt_length": prompt, "max_tokens_to_generate": new}})
  sft = omegaconf.OmegaConf.create({"model": {
      "attention": sft_attention, "attention_mask_mode": sft_mask_mode}})
  return cfg, sft


def _policy():
  return tiny_models.tiny_qwen3(32, seed=0, num_layers=1)


def test_dense_and_auto_off_a_tpu_score_on_dense_masks():
  assert jax.default_backend() != "tpu"
  for attention in ("dense", "auto"):
    assert rl_common.scoring_attention(
        *_cfgs(sft_attention=attention), _policy()) is None


def test_splash_from_the_sft_recipe_or_the_rollout_section():
  # Rollout rows are the engine's layout, not the SFT packing: always the
  # per-example mask, whatever mask the SFT recipe trained with.
  for mask_mode in ("auto", "static"):
    got = rl_common.scoring_attention(
        *_cfgs(sft_attention="splash", prompt=40, new=24,
               sft_mask_mode=mask_mode), _policy())
    assert got == config_lib.AttentionConfig("splash", mask_mode="dynamic")
  got = rl_common.scoring_attention(
      *_cfgs(rollout_attention="splash", prompt=40, new=24, tile=128),
      _policy())
  assert got == config_lib.AttentionConfig("splash", tile=128,
                                           mask_mode="dynamic")
  # The rollout section wins over the policy's own choice.
  assert rl_common.scoring_attention(
      *_cfgs(rollout_attention="dense", sft_attention="splash"),
      _policy()) is None


def test_splash_that_cannot_tile_the_scored_rows_is_refused_in_one_line():
  with pytest.raises(errors.UsageError, match="model.attention.*multiple"):
    rl_common.scoring_attention(*_cfgs(rollout_attention="splash"),
                                _policy())
  with pytest.raises(errors.UsageError, match="rollout.attention: implementation"):
    rl_common.scoring_attention(*_cfgs(rollout_attention="fast"), _policy())
