"""Tunix `ModelConfig`s from Hugging Face `config.json` files, per family.

Each `<family>_config_from_hf` reads the fields Tunix's model of that family
has, and raises a `ValueError` naming the field for anything the Tunix model
(google-tunix 0.1.7) cannot represent, so a checkpoint never loads as a
different model than the one it holds: RoPE scaling (Tunix's Qwen2, Qwen3 and
Llama3 apply plain RoPE), Qwen2's sliding window, Llama biases, Gemma3 logit
soft-capping or a layer pattern other than Tunix's five local : one global.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping

import jax.numpy as jnp
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
DTYPES = tuple(_DTYPES)  # the dtype names a recipe may give

# Hugging Face `model_type` -> family name.
MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen2": "qwen2",
    "llama": "llama3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
FAMILIES = ("qwen3", "qwen2", "llama3", "gemma3")

_DENSE_KEYS = (
    "num_hidden_layers",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)


def as_dtype(name: str | None):
  """`'float32' | 'bfloat16' | 'float16' | None` -> a jnp dtype or None."""
  if name is None:
    return None
  if name not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
  return _DTYPES[name]


def family_of(hf_config: Mapping[str, Any]) -> str:
  """The Tunix family of a `config.json` from its `model_type`."""
  model_type = hf_config.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(
        f"config.json model_type {model_type!r} is not a Tunix causal LM"
        " family this package loads; supported model_type values:"
        f" {sorted(MODEL_TYPES)}"
    )
  return MODEL_TYPES[model_type]


def _check_model_type(hf_config, family: str, default: str) -> None:
  model_type = hf_config.get("model_type", default)
  if MODEL_TYPES.get(model_type) != family:
    expected = [t for t, f in MODEL_TYPES.items() if f == family]
    shown = expected[0] if len(expected) == 1 else expected
    raise ValueError(f"model_type must be {shown!r}, got {model_type!r}")


def _check_keys(hf_config, keys) -> None:
  missing = [key for key in keys if key not in hf_config]
  if missing:
    raise ValueError(f"config.json is missing {missing}")


def _refuse(hf_config, key: str, why: str, allowed=(None, False)) -> None:
  value = hf_config.get(key)
  if value not in allowed and value != {}:
    raise ValueError(
        f"config.json {key}={value!r} is not supported: {why} (allowed:"
        f" {[a for a in allowed]})"
    )


def _head_dim(hf_config) -> int:
  heads = int(hf_config["num_attention_heads"])
  return int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)


def _dense_fields(hf_config, family: str, default_theta: int) -> dict:
  """The fields Qwen3, Qwen2 and Llama3 configs share."""
  _check_keys(hf_config, _DENSE_KEYS)
  _refuse(
      hf_config,
      "rope_scaling",
      f"Tunix's {family} applies plain RoPE, so a scaled-RoPE checkpoint"
      " would load as a different model",
  )
  _refuse(
      hf_config,
      "hidden_act",
      f"Tunix's {family} feed-forward uses SiLU",
      allowed=(None, "silu"),
  )
  return dict(
      num_layers=int(hf_config["num_hidden_layers"]),
      vocab_size=int(hf_config["vocab_size"]),
      embed_dim=int(hf_config["hidden_size"]),
      hidden_dim=int(hf_config["intermediate_size"]),
      num_heads=int(hf_config["num_attention_heads"]),
      head_dim=_head_dim(hf_config),
      num_kv_heads=int(hf_config["num_key_value_heads"]),
      rope_theta=int(hf_config.get("rope_theta", default_theta)),
      norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
  )


def _param_dtype_only(family: str, dtype: str, param_dtype: str | None):
  """Families whose activations follow the parameters' dtype."""
  if param_dtype is not None and param_dtype != dtype:
    raise ValueError(
        f"Tunix's {family} computes in its parameters' dtype: dtype"
        f" ({dtype!r}) and param_dtype ({param_dtype!r}) must agree"
    )
  return as_dtype(dtype)


def _no_flash(family: str, use_flash_attention: bool) -> None:
  if use_flash_attention:
    raise ValueError(
        f"use_flash_attention: Tunix's {family} has no flash attention path"
    )


# The RoPE base Tunix's Qwen3 attention applies when it does not read its
# config's `rope_theta` (google-tunix 0.1.7 calls `apply_rope` with its
# default, so every Qwen3 there computes with this base).
QWEN3_DEFAULT_ROPE_THETA = 1_000_000


@functools.cache
def qwen3_reads_rope_theta() -> bool:
  """Whether the installed Tunix's Qwen3 attention applies `rope_theta`."""
  return "rope_theta" in inspect.getsource(qwen3_lib.Attention.block)


def qwen3_applied_rope_theta(config) -> int:
  """The RoPE base a Tunix Qwen3 `config` computes with."""
  if qwen3_reads_rope_theta():
    return int(config.rope_theta)
  return QWEN3_DEFAULT_ROPE_THETA


def qwen3_config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    use_flash_attention: bool = False,
) -> qwen3_lib.ModelConfig:
  """A Tunix Qwen3 `ModelConfig` from a Hugging Face Qwen3 `config.json`.

  Args:
    hf_config: The parsed `config.json` (`model_type` qwen3, dense).
    dtype: Activation dtype name.
    param_dtype: Parameter dtype name (default: `dtype`).
    use_flash_attention: Tunix's Splash path (TPU).

  Returns:
    The `ModelConfig`.
  """
  _check_model_type(hf_config, "qwen3", "qwen3")
  if hf_config.get("num_experts"):
    raise ValueError(
        "mixture-of-experts Qwen3 checkpoints are not supported by this"
        " loader; use a dense Qwen3"
    )
  if not qwen3_reads_rope_theta():
    _refuse(
        hf_config,
        "rope_theta",
        "this Tunix's Qwen3 attention applies RoPE with base"
        f" {QWEN3_DEFAULT_ROPE_THETA} whatever its config says",
        allowed=(None, QWEN3_DEFAULT_ROPE_THETA,
                 float(QWEN3_DEFAULT_ROPE_THETA)),
    )
  return qwen3_lib.ModelConfig(
      **_dense_fields(hf_config, "qwen3", 1_000_000),
      use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)),
      dtype=as_dtype(dtype),
      param_dtype=as_dtype(param_dtype or dtype),
      use_flash_attention=use_flash_attention,
  )


def qwen2_config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    use_flash_attention: bool = False,
) -> qwen2_lib.ModelConfig:
  """A Tunix Qwen2 `ModelConfig` from a Hugging Face Qwen2 (2.5) config."""
  _check_model_type(hf_config, "qwen2", "qwen2")
  _refuse(
      hf_config,
      "use_sliding_window",
      "Tunix's qwen2 has no sliding-window attention",
  )
  return qwen2_lib.ModelConfig(
      **_dense_fields(hf_config, "qwen2", 1_000_000),
      use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)),
      dtype=as_dtype(dtype),
      param_dtype=as_dtype(param_dtype or dtype),
      use_flash_attention=use_flash_attention,
  )


def llama3_config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    use_flash_attention: bool = False,
) -> llama3_lib.ModelConfig:
  """A Tunix Llama3 `ModelConfig` from a Hugging Face Llama config.

  Tunix's Llama3 has no dtype fields: it computes in its parameters' dtype
  (the loader casts to `dtype`), and `param_dtype` must agree with `dtype`.
  """
  _check_model_type(hf_config, "llama3", "llama")
  _param_dtype_only("llama3", dtype, param_dtype)
  _no_flash("llama3", use_flash_attention)
  for key in ("attention_bias", "mlp_bias"):
    _refuse(hf_config, key, "Tunix's llama3 projections have no biases")
  return llama3_lib.ModelConfig(
      **_dense_fields(hf_config, "llama3", 500_000),
      weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
  )


def gemma3_text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text part of a Gemma3 config (`text_config` of a multimodal one)."""
  if hf_config.get("model_type") == "gemma3":
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("a model_type 'gemma3' config.json needs text_config")
    return dict(text, model_type="gemma3_text")
  return hf_config


def _gemma3_query_norm(hf_config, head_dim: int):
  norm = gemma3_lib.QueryPreAttentionNormalisation
  scalar = int(hf_config.get("query_pre_attn_scalar", head_dim))
  per_head = int(hf_config["hidden_size"]) // int(
      hf_config["num_attention_heads"]
  )
  if scalar == head_dim:
    return norm.BY_ONE_OVER_SQRT_HEAD_DIM
  if scalar == per_head:
    return norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
  raise ValueError(
      f"config.json query_pre_attn_scalar={scalar} is not supported: Tunix's"
      f" gemma3 scales queries by head_dim ({head_dim}) or hidden_size //"
      f" num_attention_heads ({per_head}) only"
  )


def _gemma3_rope_scale(hf_config) -> float:
  scaling = hf_config.get("rope_scaling")
  if not scaling:
    return 1.0
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind != "linear":
    raise ValueError(
        f"config.json rope_scaling {scaling!r} is not supported: Tunix's"
        " gemma3 scales the global layers' RoPE linearly only"
    )
  return float(scaling["factor"])


def _check_gemma3_layers(hf_config, num_layers: int) -> None:
  period = len(gemma3_lib.GEMMA3_ATTENTION_PATTERN)
  expected = [
      "full_attention" if (i + 1) % period == 0 else "sliding_attention"
      for i in range(num_layers)
  ]
  layer_types = hf_config.get("layer_types")
  pattern = hf_config.get("sliding_window_pattern")
  if (layer_types is not None and list(layer_types) != expected) or (
      pattern is not None and int(pattern) != period
  ):
    raise ValueError(
        "config.json layer_types / sliding_window_pattern is not supported:"
        f" Tunix's gemma3 repeats {period - 1} sliding-window layers and one"
        f" global layer, i.e. layer_types {expected}"
    )


def gemma3_config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    use_flash_attention: bool = False,
) -> gemma3_lib.ModelConfig:
  """A text-only Tunix Gemma3 `ModelConfig` from a Hugging Face config.

  Accepts `model_type` `gemma3_text` (1B, 270M) or `gemma3` (its
  `text_config`; the vision tower is not loaded). Tunix's Gemma3 computes in
  its parameters' dtype, ties its embeddings and fixes the RMSNorm epsilon at
  1e-6 and the activation at tanh-approximated GELU.
  """
  hf_config = gemma3_text_config(hf_config)
  _check_model_type(hf_config, "gemma3", "gemma3_text")
  _check_keys(hf_config, _DENSE_KEYS + ("sliding_window",))
  _param_dtype_only("gemma3", dtype, param_dtype)
  _no_flash("gemma3", use_flash_attention)
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    _refuse(hf_config, key, "Tunix's gemma3 has no logit soft-capping")
  _refuse(
      hf_config,
      "use_bidirectional_attention",
      "Tunix's gemma3 is a causal LM",
  )
  _refuse(
      hf_config,
      "hidden_activation",
      "Tunix's gemma3 feed-forward uses tanh-approximated GELU",
      allowed=(None, "gelu_pytorch_tanh"),
  )
  _refuse(
      hf_config,
      "tie_word_embeddings",
      "Tunix's gemma3 always ties its output head to the embedding",
      allowed=(None, True),
  )
  _refuse(
      hf_config,
      "rms_norm_eps",
      "Tunix's gemma3 fixes the RMSNorm epsilon at 1e-6",
      allowed=(None, 1e-6),
  )
  num_layers = int(hf_config["num_hidden_layers"])
  _check_gemma3_layers(hf_config, num_layers)
  head_dim = _head_dim(hf_config)
  return gemma3_lib.ModelConfig(
      num_layers=num_layers,
      num_embed=int(hf_config["vocab_size"]),
      embed_dim=int(hf_config["hidden_size"]),
      hidden_dim=int(hf_config["intermediate_size"]),
      num_heads=int(hf_config["num_attention_heads"]),
      head_dim=head_dim,
      num_kv_heads=int(hf_config["num_key_value_heads"]),
      sliding_window_size=int(hf_config["sliding_window"]),
      local_base_frequency=int(hf_config.get("rope_local_base_freq", 10_000)),
      global_base_frequency=int(hf_config.get("rope_theta", 1_000_000)),
      global_scale_factor=_gemma3_rope_scale(hf_config),
      query_pre_attn_norm=_gemma3_query_norm(hf_config, head_dim),
      param_dtype=as_dtype(dtype),
  )


CONFIG_FROM_HF = {
    "qwen3": qwen3_config_from_hf,
    "qwen2": qwen2_config_from_hf,
    "llama3": llama3_config_from_hf,
    "gemma3": gemma3_config_from_hf,
}
