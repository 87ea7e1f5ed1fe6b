"""Released block-diffusion checkpoints (SDAR, Fast-dLLM v2) read onto Tunix.

Parity: `tests/data/released/<format>/` holds a tiny random checkpoint
written by the format's own PyTorch code and its logits under the format's
inference mask (`tools/released_goldens.py`); the Tunix model loaded from
it must give the same logits within 1e-4 (float32).
"""

import json
import pathlib
import shutil

import hypothesis
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import released

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "released"
FAMILY_CLASS = {"sdar": qwen3_lib.Qwen3, "fast_dllm_v2": qwen2_lib.Qwen2,
                "a2d_qwen3": qwen3_lib.Qwen3}


@pytest.mark.parametrize("name", sorted(FAMILY_CLASS))
def test_logits_match_the_reference_code_under_its_mask(name):
  model = checkpoints.load_hf(DATA / name, dtype="float32")
  assert type(model) is FAMILY_CLASS[name]
  err = released.compare_reference(DATA / name)
  assert err <= 1e-4, err
  ref = np.load(DATA / name / "reference.npz")
  # The mask matters: a causal mask gives other logits (a real check).
  causal = np.tril(np.ones(ref["mask"].shape[1:], bool))[None].repeat(2, 0)
  other, _ = model(jnp.asarray(ref["tokens"]), jnp.asarray(ref["positions"]),
                   None, jnp.asarray(causal))
  assert np.abs(np.asarray(other) - ref["logits"]).max() > 1e-3


def test_each_format_is_recognised_and_mapped():
  sdar = json.loads((DATA / "sdar" / "config.json").read_text())
  fast = json.loads((DATA / "fast_dllm_v2" / "config.json").read_text())
  assert released.detect(sdar).name == "sdar"
  assert released.detect(fast).name == "fast_dllm_v2"
  # By architectures alone too.
  assert released.detect({"architectures": ["SDARForCausalLM"]}).name == "sdar"
  assert released.detect({"model_type": "qwen3"}) is None
  assert released.base_config(sdar)["model_type"] == "qwen3"
  assert released.base_config(fast)["model_type"] == "qwen2"
  assert released.diffusion_settings(sdar) == {
      "block_size": 4, "mask_token_id": 63, "alignment": "same_position",
      "canvas": "all_masked"}
  assert released.diffusion_settings(fast) == {
      "block_size": 4, "mask_token_id": 63, "alignment": "shifted",
      "canvas": "seed_and_mask"}
  # Fast-dLLM v2's released configs have no mask key: its code's default.
  del fast["mask_token_id"]
  assert released.diffusion_settings(fast)["mask_token_id"] == 151665
  # Each format's settings make a valid BlockDiffusionConfig.
  for config in (sdar, fast):
    config_lib.BlockDiffusionConfig(**released.diffusion_settings(config))


def test_unsupported_variants_and_missing_fields_are_refused(tmp_path):
  with pytest.raises(ValueError, match="model_type='sdar_moe'.*dense"):
    released.detect({"model_type": "sdar_moe"})
  # generate still takes it for a released directory, to say why it fails.
  assert released.recognises({"model_type": "sdar_moe"})
  assert not released.recognises({"model_type": "qwen3"})
  with pytest.raises(ValueError, match="mask_token_id: missing"):
    released.diffusion_settings({"model_type": "sdar"})
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    released.diffusion_settings(
        {"model_type": "sdar", "mask_token_id": 5, "block_size": 0})
  with pytest.raises(ValueError, match="not a released"):
    released.diffusion_settings({"model_type": "qwen3"})
  moe = tmp_path / "moe"
  shutil.copytree(DATA / "sdar", moe)
  config = json.loads((moe / "config.json").read_text())
  (moe / "config.json").write_text(json.dumps(config | {
      "model_type": "sdar_moe"}))
  with pytest.raises(ValueError, match="sdar_moe"):
    checkpoints.load_hf(moe)


def test_the_mask_token_comes_from_the_tokenizer_when_config_lacks_it(
    tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"mask_token": "<|MASK|>"}))
  (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
      {"id": 60, "content": "<|endoftext|>"},
      {"id": 61, "content": "<|MASK|>"}]}))
  settings = released.diffusion_settings({"model_type": "sdar"}, tmp_path)
  assert settings["mask_token_id"] == 61


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    block=st.integers(1, 64), mask=st.integers(0, 10**6),
    key=st.sampled_from(["block_size", "mask_token_id", "alignment"]))
def test_a_recipe_that_differs_from_the_checkpoint_is_refused(
    block, mask, key):
  # (the canvas follows the alignment: changing one changes both)
  config = {"model_type": "sdar", "block_size": block, "mask_token_id": mask}
  canvas = "all_masked"
  own = config_lib.BlockDiffusionConfig(
      block_size=block, mask_token_id=mask, canvas=canvas)
  released.check_diffusion(config, None, own)  # agrees: no error
  changed = {"block_size": block + 1, "mask_token_id": mask + 1,
             "alignment": "shifted"}[key]
  fields = dict(block_size=block, mask_token_id=mask, canvas=canvas,
                alignment="same_position")
  fields[key] = changed
  if key == "alignment":
    fields["canvas"] = "seed_and_mask"
    fields["block_size"] = max(block, 2)
    config["block_size"] = fields["block_size"]
  with pytest.raises(ValueError, match=f"diffusion.{key}="):
    released.check_diffusion(
        config, None, config_lib.BlockDiffusionConfig(**fields))


def test_a2d_conversions_take_the_recipes_block_size():
  config = {"model_type": "a2d-qwen3", "mask_token_id": 7}
  fmt = released.detect(config)
  assert (fmt.name, fmt.family) == ("a2d_qwen3", "qwen3")
  assert released.base_config(config)["model_type"] == "qwen3"
  assert released.detect({"model_type": "a2d-llama"}).family == "llama3"
  assert released.base_config({"model_type": "a2d-llama"})[
      "model_type"] == "llama"
  assert released.diffusion_settings(config)["block_size"] == 32
  # The checkpoint records no block size: any recipe block is accepted,
  # the mask token and alignment are still checked.
  released.check_diffusion(config, None, config_lib.BlockDiffusionConfig(
      block_size=8, mask_token_id=7))
  with pytest.raises(ValueError, match="diffusion.mask_token_id=8"):
    released.check_diffusion(config, None, config_lib.BlockDiffusionConfig(
        block_size=8, mask_token_id=8))
