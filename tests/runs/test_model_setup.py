"""`runs.model_setup`: placing a recipe's model on the mesh, and LoRA flags."""

from flax import nnx
import jax
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import model_setup
from tunix_blockdiff.models import tiny


def _mesh(fsdp, tp):
  return jax.make_mesh((fsdp, 1, tp), ("fsdp", "sp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _model():
  return tiny.tiny_qwen3(32, num_layers=1, embed_dim=16, hidden_dim=32,
                         num_heads=2, head_dim=8, num_kv_heads=2,
                         random_mlp=True)


def test_shard_model_places_parameters_by_their_specs_and_keeps_values():
  model = _model()
  before = {k: np.asarray(v) for k, v in
            jax.tree_util.tree_leaves_with_path(nnx.state(model))}
  placed = model_setup.shard_model(model, _mesh(2, 2))
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(placed))
  assert {len(v.sharding.device_set) for _, v in leaves} == {4}
  assert any(not v.sharding.is_fully_replicated for _, v in leaves)
  for key, value in leaves:
    np.testing.assert_array_equal(np.asarray(value), before[key])
  assert model_setup.shard_model(model, None) is model


def test_a_parameter_that_does_not_divide_is_named():
  with pytest.raises(ValueError, match=r"mesh.tp=4.*not a multiple of 4"):
    model_setup.check_model_fits_mesh(_model(), _mesh(1, 4))


def test_lora_flags_and_the_common_re_exports():
  assert not model_setup.lora_enabled(None)
  assert model_setup.lora_enabled(omegaconf.OmegaConf.create({"rank": 2}))
  assert not model_setup.lora_enabled(
      omegaconf.OmegaConf.create({"enabled": False}))
  model = _model()
  assert model_setup.apply_lora(model, None, seed=0) is model
  for name in model_setup.__all__:
    assert getattr(common, name) is getattr(model_setup, name)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_on_a_mesh",
                                    "diffusion_gemma_moe"])
def test_traced_lora_equals_the_eager_qwix_call_and_shares_the_base(family):
  import qwix  # pylint: disable=g-import-not-at-top

  def build():
    if family == "qwen3":
      return _model()
    if family == "qwen3_on_a_mesh":  # LoRA placed by its specs there
      return model_setup.shard_model(_model(), _mesh(2, 2))
    return tiny.tiny_diffusion_gemma(16, num_experts=2, top_k_experts=1,
                                     moe_intermediate_size=8)

  provider = qwix.LoraProvider(module_path=".*_proj", rank=2, alpha=4.0)
  base = build()
  eager = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(3),
                                   **base.get_model_input())
  traced = model_setup.traced_lora(base, provider, seed=3)
  want = dict(nnx.to_flat_state(nnx.state(eager)))
  got = dict(nnx.to_flat_state(nnx.state(traced)))
  assert got.keys() == want.keys()
  assert any(isinstance(v, nnx.LoRAParam) for v in got.values())
  for key, value in want.items():
    assert type(got[key]) is type(value), key
    assert got[key].get_value().sharding == value.get_value().sharding, key
    np.testing.assert_array_equal(np.asarray(got[key].get_value()),
                                  np.asarray(value.get_value()),
                                  err_msg=str(key))
  # The input keeps no LoRA state, and its weights are not copied.
  assert not jax.tree.leaves(nnx.state(base, nnx.LoRAParam))
  for key, value in nnx.to_flat_state(nnx.state(base)):
    assert got[key].get_value() is value.get_value(), key
  # The same forward.
  inputs = base.get_model_input()
  np.testing.assert_array_equal(np.asarray(traced(**inputs)[0]),
                                np.asarray(eager(**inputs)[0]))


@pytest.mark.parametrize("packing,cp_size,want", [
    ("none", 1, "static"), ("block_aligned", 1, "static"),
    ("unaligned", 1, "dynamic"), ("none", 2, "dynamic")])
def test_training_mask_mode_follows_the_data_layout(packing, cp_size, want):
  auto = config_lib.AttentionConfig("splash")
  assert auto.mask_mode == "auto"
  chosen = model_setup.training_mask_mode(auto, packing, cp_size)
  assert chosen.mask_mode == want and chosen.tile == auto.tile
  assert model_setup.training_mask_mode(None, packing, cp_size) is None
  dynamic = config_lib.AttentionConfig("splash", mask_mode="dynamic")
  assert model_setup.training_mask_mode(dynamic, packing, cp_size) is dynamic
  static = config_lib.AttentionConfig("splash", mask_mode="static")
  if want == "static":
    assert model_setup.training_mask_mode(static, packing, cp_size) is static
  else:
    with pytest.raises(common.errors.UsageError,
                       match="static needs documents at block multiples"):
      model_setup.training_mask_mode(static, packing, cp_size)
  with pytest.raises(ValueError, match="mask_mode must be one of"):
    config_lib.AttentionConfig("splash", mask_mode="lazy")
