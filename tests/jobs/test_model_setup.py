"""`jobs.model_setup`: placing a recipe's model on the mesh, and LoRA flags."""

from flax import nnx
import jax
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import model_setup
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
