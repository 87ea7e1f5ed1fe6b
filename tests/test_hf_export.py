"""`hf_export.save_qwen3_hf` is the inverse of `checkpoints.load_qwen3`."""

import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import tiny as tiny_models

VOCAB = 48


def _random_qwen3(tied: bool, seed: int = 0):
  config = tiny_models.qwen3_config(
      VOCAB,
      num_layers=2,
      embed_dim=16,
      hidden_dim=24,
      num_heads=4,
      head_dim=8,
      num_kv_heads=2,
  )
  config.use_tied_embedding = tied
  model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
  # Random values everywhere (norms too), so a swapped mapping cannot pass.
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  nnx.update(
      model,
      jax.tree.map(
          lambda x: jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype), state
      ),
  )
  return model


def _logits(model):
  tokens = jnp.asarray(
      np.random.default_rng(1).integers(0, VOCAB, (2, 7)), jnp.int32
  )
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  mask = jnp.tril(jnp.ones((7, 7), bool))[None].repeat(2, 0)
  return np.asarray(model(tokens, positions, None, mask)[0])


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_reproduces_parameters_and_logits(tmp_path, tied):
  model = _random_qwen3(tied)
  hf_export.save_qwen3_hf(model, tmp_path, eos_token_id=2)
  hf_config = json.loads((tmp_path / "config.json").read_text())
  assert hf_config["eos_token_id"] == 2
  assert checkpoints.qwen3_config_from_hf(hf_config).num_kv_heads == 2
  loaded = checkpoints.load_qwen3(tmp_path)
  original = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  restored = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
  assert original.keys() == restored.keys()
  for key, variable in original.items():
    np.testing.assert_array_equal(
        np.asarray(restored[key].get_value()), np.asarray(variable.get_value())
    )
  np.testing.assert_allclose(
      _logits(loaded), _logits(model), rtol=1e-6, atol=1e-6
  )


def test_tokenizer_files_are_copied(tmp_path):
  source = tmp_path / "tok"
  source.mkdir()
  (source / "tokenizer.json").write_text("{}")
  (source / "tokenizer_config.json").write_text("{}")
  out = hf_export.save_qwen3_hf(
      _random_qwen3(True), tmp_path / "hf", tokenizer_json=source
  )
  assert (out / "tokenizer.json").is_file()
  assert (out / "tokenizer_config.json").is_file()
  assert not (out / "special_tokens_map.json").exists()


def test_bad_inputs(tmp_path):
  with pytest.raises(TypeError, match="Tunix Qwen3"):
    hf_export.save_qwen3_hf(object(), tmp_path)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    hf_export.save_qwen3_hf(
        _random_qwen3(True), tmp_path, tokenizer_json=tmp_path / "nope"
    )
  with pytest.raises(ValueError, match="parameter path"):
    hf_export.qwen3_param_to_hf(("encoder", "w"), np.zeros(3))
  import qwix

  base = _random_qwen3(True)
  lora = qwix.apply_lora_to_model(
      base,
      qwix.LoraProvider(module_path=".*q_proj", rank=2, alpha=2.0),
      rngs=nnx.Rngs(0),
      **base.get_model_input(),
  )
  with pytest.raises(ValueError, match="merge_lora"):
    hf_export.save_qwen3_hf(lora, tmp_path)
