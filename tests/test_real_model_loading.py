"""The real-model path: HF safetensors Qwen3 -> Tunix Qwen3 (tiny, offline).

The test writes its own checkpoint in the Hugging Face layout (config.json
plus model.safetensors with HF key names and torch weight layouts), exported
from a Tunix Qwen3 by `hf_export.save_qwen3_hf`, then loads it through
`tunix_blockdiff.models.checkpoints` (Tunix's loader underneath) and through the
`qwen3_0p6b.yaml` recipe of the sft job, with the recipe's LoRA.
"""

import importlib.util
import json
import pathlib

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

_TESTS = pathlib.Path(__file__).resolve().parent
VOCAB = 64
LAYERS, EMBED, HIDDEN, HEADS, HEAD_DIM, KV_HEADS = 2, 32, 64, 4, 8, 2


def _hf_config(tied: bool) -> dict:
  return {
      "architectures": ["Qwen3ForCausalLM"],
      "model_type": "qwen3",
      "num_hidden_layers": LAYERS,
      "vocab_size": VOCAB,
      "hidden_size": EMBED,
      "intermediate_size": HIDDEN,
      "num_attention_heads": HEADS,
      "head_dim": HEAD_DIM,
      "num_key_value_heads": KV_HEADS,
      "rope_theta": 1000000,
      "rms_norm_eps": 1e-6,
      "tie_word_embeddings": tied,
      "torch_dtype": "float32",
  }


def write_tiny_hf_checkpoint(
    directory: pathlib.Path, *, tied: bool, seed: int = 0
):
  """Writes a random tiny Qwen3 in HF format; returns the Tunix original."""
  config = tiny_models.qwen3_config(
      VOCAB,
      num_layers=LAYERS,
      embed_dim=EMBED,
      hidden_dim=HIDDEN,
      num_heads=HEADS,
      head_dim=HEAD_DIM,
      num_kv_heads=KV_HEADS,
  )
  config.use_tied_embedding = tied
  config.rope_theta = 10000
  model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
  # Random values everywhere (norms too), so a swapped mapping cannot pass.
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  state = jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype), state
  )
  nnx.update(model, state)
  hf_export.save_qwen3_hf(model, directory)
  return model


def _logits(model):
  return hf_layout.causal_logits(model, VOCAB, 9)


@pytest.mark.parametrize("tied", [False, True])
def test_load_qwen3_reproduces_the_exported_model(tmp_path, tied):
  original = write_tiny_hf_checkpoint(tmp_path, tied=tied)
  loaded = checkpoints.load_qwen3(tmp_path, dtype="float32")
  assert loaded.config.use_tied_embedding == tied
  assert loaded.config.num_kv_heads == KV_HEADS
  np.testing.assert_allclose(
      _logits(loaded), _logits(original), rtol=1e-5, atol=1e-5
  )


def test_config_and_path_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    checkpoints.load_qwen3(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(_hf_config(False)))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    checkpoints.load_qwen3(tmp_path)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    checkpoints.qwen3_config_from_hf(_hf_config(False) | {"num_experts": 8})
  with pytest.raises(ValueError, match="model_type must be 'qwen3'"):
    checkpoints.qwen3_config_from_hf({"model_type": "llama"})
  with pytest.raises(ValueError, match="missing"):
    checkpoints.qwen3_config_from_hf({"model_type": "qwen3"})
  # google-tunix 0.1.7's Qwen3 applies RoPE base 1e6 whatever the config
  # says: another base would load as a different model.
  with pytest.raises(ValueError, match="rope_theta=10000 is not supported"):
    checkpoints.qwen3_config_from_hf(_hf_config(False) | {"rope_theta": 10000})
  with pytest.raises(ValueError, match="dtype must be one of"):
    checkpoints.as_dtype("float8")
  config = checkpoints.qwen3_config_from_hf(_hf_config(True), dtype="bfloat16")
  assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.bfloat16
  assert config.head_dim == HEAD_DIM and config.hidden_dim == HIDDEN


def test_real_model_recipe_runs_on_a_tiny_checkpoint_with_lora(tmp_path):
  """`sft qwen3_0p6b.yaml`: load, shard, LoRA, train, checkpoint, summary."""
  from tunix_blockdiff.runs import common
  from tunix_blockdiff.jobs import sft

  ckpt = tmp_path / "hf"
  write_tiny_hf_checkpoint(ckpt, tied=True)
  # A tiny character-level HF tokenizer with a chat template, beside the
  # weights, renders the recipe's {"messages"} rows.
  spec = importlib.util.spec_from_file_location(
      "tests_data_hf_tokenizer", _TESTS / "data" / "hf_tokenizer.py"
  )
  hf_tokenizer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hf_tokenizer)
  assert hf_tokenizer.write_tiny_hf_tokenizer(ckpt) < VOCAB
  chat = _TESTS / "data" / "chat_tiny.jsonl"
  cfg = common.load_recipe([
      "qwen3_0p6b.yaml",
      f"model.path={ckpt}",
      f"output_dir={tmp_path / 'run'}",
      f"dataset.train={chat}",
      f"dataset.eval={chat}",
      "dataset.num_eval=4",
      f"diffusion.mask_token_id={VOCAB - 1}",
      "data.batch_size=4",
      "data.seq_len=96",
      "training.max_steps=2",
      "training.eval_every_n_steps=2",
      "eval.batch_size=8",
      "eval.thresholds=[0.9]",
      # Shards model and batch over 4 of the 8 simulated devices.
      "mesh={fsdp: 2, tp: 2}",
  ])
  assert cfg.lora.rank > 0
  summary = sft.run(cfg)
  assert summary["train_steps"] == 2
  assert np.isfinite(summary["final_train_loss"]) and np.isfinite(
      summary["eval_loss"]
  )
  assert 0.0 <= summary["eval_exact_match"] <= 1.0
  assert 0.0 <= summary["eval_edit_similarity"] <= 1.0
  assert summary["train_examples"] == 12 and summary["eval_examples"] == 4
  assert summary["bad_rows"]["train"]["skipped"] == 0  # all fit in 96
  assert summary["num_lora_params"] > 0
  assert (tmp_path / "run" / "summary.json").is_file()
  assert any((tmp_path / "run" / "checkpoints").iterdir())


def test_merge_lora_computes_what_the_lora_model_computes():
  import qwix

  base = tiny_models.tiny_qwen3(VOCAB, num_layers=1)
  provider = qwix.LoraProvider(
      module_path=".*q_proj|.*o_proj|.*down_proj", rank=2, alpha=4.0
  )
  lora = model_setup.traced_lora(base, provider, seed=0)
  rng = np.random.default_rng(0)
  # Nonzero B (qwix starts it at 0) so the merge has something to add.
  nnx.update(
      lora,
      jax.tree.map(
          lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
          nnx.state(lora, nnx.LoRAParam),
      ),
  )
  before = _logits(base)
  merged = checkpoints.merge_lora(lora, base, rank=2, alpha=4.0)
  assert not nnx.state(merged, nnx.LoRAParam)
  np.testing.assert_allclose(
      _logits(merged), _logits(lora), rtol=1e-5, atol=1e-5
  )
  assert np.abs(_logits(merged) - before).max() > 1e-2
  np.testing.assert_array_equal(_logits(base), before)  # inputs untouched
