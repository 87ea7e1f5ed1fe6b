"""HF safetensors -> Tunix model for every family, through `models.build_model`.

Each test writes a tiny random checkpoint in the Hugging Face layout
(`hf_layout`), loads it with the `<family>_hf` kind (Tunix's own loader
underneath) and compares logits with the in-memory original.
"""

import dataclasses
import importlib.util
import json
import pathlib
import sys

from flax import nnx
import jax.numpy as jnp
import numpy as np
import omegaconf
import pytest
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_configs
from tunix_blockdiff import models
from tunix_blockdiff.models import tiny as tiny_models

_spec = importlib.util.spec_from_file_location(
    "hf_layout", pathlib.Path(__file__).with_name("hf_layout.py")
)
hf_layout = sys.modules.get(_spec.name)
if hf_layout is None:
  hf_layout = importlib.util.module_from_spec(_spec)
  sys.modules[_spec.name] = hf_layout
  _spec.loader.exec_module(hf_layout)

VOCAB = 64
_CLASSES = {
    "qwen3": qwen3_lib.Qwen3,
    "qwen2": qwen2_lib.Qwen2,
    "llama3": llama3_lib.Llama3,
    "gemma3": gemma3_lib.Gemma3,
}


def _tiny(family, tied, **kwargs):
  config = getattr(tiny_models, f"{family}_config")(VOCAB, **kwargs)
  if family in ("qwen3", "qwen2"):
    config = dataclasses.replace(config, use_tied_embedding=tied)
  elif family == "llama3":
    config = dataclasses.replace(config, weight_tying=tied)
  return hf_layout.randomize(_CLASSES[family](config, rngs=nnx.Rngs(0)))


def _logits(model):
  return hf_layout.causal_logits(model, VOCAB, 9)


@pytest.mark.parametrize(
    "family, tied, kwargs",
    [
        # Qwen3: tests/test_real_model_loading.py.
        ("qwen2", False, {}),
        ("llama3", True, {}),
        # Grouped-query (q_einsum + kv_einsum) and multi-head (qkv_einsum)
        # Gemma3, with a window shorter than the 9 tokens compared.
        ("gemma3", True, {"sliding_window_size": 4}),
        ("gemma3", True, {"num_kv_heads": 4, "num_layers": 2}),
    ],
)
def test_hf_kind_loads_what_was_written(tmp_path, family, tied, kwargs):
  original = _tiny(family, tied, **kwargs)
  hf_layout.write(tmp_path, family, original)
  cfg = omegaconf.OmegaConf.create(
      {"kind": f"{family}_hf", "path": str(tmp_path), "dtype": "float32"}
  )
  loaded = models.build_model(cfg, seed=0)
  assert type(loaded) is type(original)
  assert models.model_vocab_size(loaded) == VOCAB
  np.testing.assert_allclose(
      _logits(loaded), _logits(original), rtol=1e-5, atol=1e-5
  )


def test_family_is_read_from_model_type(tmp_path):
  original = _tiny("llama3", False)
  hf_layout.write(tmp_path, "llama3", original)
  loaded = checkpoints.load_hf(tmp_path)
  assert type(loaded) is type(original)
  with pytest.raises(ValueError, match="model_type must be 'qwen2'"):
    checkpoints.load_hf(tmp_path, family="qwen2")
  with pytest.raises(ValueError, match="family must be one of"):
    checkpoints.load_hf(tmp_path, family="gpt2")


def _config(family):
  model = getattr(tiny_models, f"tiny_{family}")(VOCAB, num_layers=1)
  return hf_layout.hf_config(family, model.config)


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("llama3", {"rope_scaling": {"rope_type": "llama3"}}, "plain RoPE"),
        ("qwen2", {"rope_scaling": {"type": "yarn"}}, "plain RoPE"),
        ("qwen2", {"use_sliding_window": True}, "no sliding-window"),
        ("llama3", {"attention_bias": True}, "no biases"),
        ("llama3", {"hidden_act": "gelu"}, "SiLU"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "soft-capping"),
        ("gemma3", {"query_pre_attn_scalar": 7}, "query_pre_attn_scalar"),
        ("gemma3", {"rope_scaling": {"rope_type": "yarn"}}, "linearly"),
        ("gemma3", {"sliding_window_pattern": 2}, "layer_types"),
        ("gemma3", {"tie_word_embeddings": False}, "ties"),
        ("gemma3", {"rms_norm_eps": 1e-5}, "epsilon"),
        ("gemma3", {"sliding_window": None}, "missing"),
    ],
)
def test_unsupported_configs_name_the_field(family, change, match):
  hf_config = _config(family) | change
  if change.get("sliding_window", 0) is None:
    del hf_config["sliding_window"]
  with pytest.raises(ValueError, match=match):
    hf_configs.CONFIG_FROM_HF[family](hf_config)


def test_config_details():
  with pytest.raises(ValueError, match="not a Tunix causal LM family"):
    hf_configs.family_of({"model_type": "gpt2"})
  with pytest.raises(ValueError, match="must agree"):
    hf_configs.llama3_config_from_hf(
        _config("llama3"), dtype="float32", param_dtype="bfloat16"
    )
  with pytest.raises(ValueError, match="no flash attention"):
    hf_configs.gemma3_config_from_hf(
        _config("gemma3"), use_flash_attention=True
    )
  gemma = _config("gemma3")
  # A multimodal config: the text part is read, the vision tower ignored.
  config = hf_configs.gemma3_config_from_hf(
      {
          "model_type": "gemma3",
          "text_config": (
              gemma | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
          ),
      },
      dtype="bfloat16",
  )
  assert config.global_scale_factor == 8.0 and config.local_scale_factor == 1.0
  assert config.param_dtype == jnp.bfloat16 and config.vision_config is None
  per_head = gemma["hidden_size"] // gemma["num_attention_heads"]
  config = hf_configs.gemma3_config_from_hf(
      gemma | {"head_dim": 16, "query_pre_attn_scalar": per_head}
  )
  assert config.query_pre_attn_norm.name.endswith("EMBED_DIM_DIV_NUM_HEADS")
  layer_types = ["sliding_attention"] * 5 + ["full_attention"]
  hf_configs.gemma3_config_from_hf(
      gemma | {"num_hidden_layers": 6, "layer_types": layer_types}
  )
  with pytest.raises(ValueError, match="layer_types"):
    hf_configs.gemma3_config_from_hf(
        gemma | {"num_hidden_layers": 6, "layer_types": layer_types[::-1]}
    )


def test_build_model_needs_a_path(tmp_path):
  cfg = omegaconf.OmegaConf.create({"kind": "gemma3_hf", "path": None})
  with pytest.raises(ValueError, match="needs model.path"):
    models.build_model(cfg, seed=0)
  (tmp_path / "config.json").write_text(json.dumps(_config("gemma3")))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    checkpoints.load_hf(tmp_path)
