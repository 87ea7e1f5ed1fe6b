"""`hf_export.save_qwen3_hf` is the inverse of `checkpoints.load_qwen3`."""

import dataclasses
import json

from flax import nnx
import hf_layout
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import model_setup

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
  return hf_layout.causal_logits(model, VOCAB, 7)


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
  lora = model_setup.traced_lora(
      base,
      qwix.LoraProvider(module_path=".*q_proj", rank=2, alpha=2.0),
      seed=0,
  )
  with pytest.raises(ValueError, match="merge_lora"):
    hf_export.save_qwen3_hf(lora, tmp_path)


@pytest.mark.parametrize(
    "text, size",
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
     ("1.5kb", 1500), ("4096", 4096), ("10 B", 10)],
)
def test_parse_size(text, size):
  assert hf_export.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0GB", "5XB", "-1MB", "GB"])
def test_parse_size_refuses(text):
  with pytest.raises(ValueError, match="is not a size"):
    hf_export.parse_size(text)


def test_plan_shards_keeps_order_and_isolates_large_tensors():
  tensors = {
      "a": np.zeros(10, np.float32),  # 40 bytes each
      "b": np.zeros(10, np.float32),
      "big": np.zeros(100, np.float32),  # 400 bytes > the limit
      "c": np.zeros(10, np.float32),
  }
  assert hf_export.plan_shards(tensors, 100) == [["a", "b"], ["big"], ["c"]]
  assert hf_export.plan_shards(tensors, 10**6) == [["a", "b", "big", "c"]]


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
  model = _random_qwen3(tied=False)
  hf_export.save_hf(model, tmp_path, max_shard_bytes=4000)
  index = json.loads((tmp_path / hf_export.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and not (tmp_path / hf_export.SINGLE_FILE).exists()
  import safetensors.numpy

  total = 0
  for name in files:
    tensors = safetensors.numpy.load_file(str(tmp_path / name))
    assert {k for k, v in index["weight_map"].items() if v == name} == set(
        tensors
    )
    total += sum(t.nbytes for t in tensors.values())
  assert index["metadata"]["total_size"] == total
  np.testing.assert_array_equal(
      _logits(checkpoints.load_hf(tmp_path)), _logits(model)
  )


def test_save_hf_keeps_the_parameter_dtype(tmp_path):
  model = _random_qwen3(tied=True)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model))
  nnx.update(model, bf16)
  hf_export.save_hf(model, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())[
      "torch_dtype"
  ] == "bfloat16"
  loaded = checkpoints.load_hf(tmp_path, dtype="bfloat16")
  for (path, a), (_, b) in zip(
      nnx.to_flat_state(nnx.state(model, nnx.Param)),
      nnx.to_flat_state(nnx.state(loaded, nnx.Param)),
  ):
    assert b.get_value().dtype == jnp.bfloat16, path
    np.testing.assert_array_equal(
        np.asarray(a.get_value(), np.float32),
        np.asarray(b.get_value(), np.float32),
    )


def test_family_refusals():
  with pytest.raises(TypeError, match="Tunix qwen3 / qwen2 / llama3 / gemma3"):
    hf_export.family_of_model(object())
  config = tiny_models.gemma3_config(VOCAB)
  with pytest.raises(ValueError, match="local_scale_factor"):
    hf_export.gemma3_hf_config(
        dataclasses.replace(config, local_scale_factor=2.0)
    )
  with pytest.raises(ValueError, match="parameter path"):
    hf_export.gemma3_param_to_hf(("layers", 0, "attn", "w"), np.zeros(3))
