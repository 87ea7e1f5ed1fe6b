"""Per-family inverse of Tunix's safetensors loaders: parameters and config.

Each family has one `<family>_param_to_hf` (a Tunix parameter -> its Hugging
Face tensors, in torch layout: linear weights `[out, in]`) and one
`<family>_hf_config` (a Tunix `ModelConfig` -> the `config.json` dict that
`hf_configs.CONFIG_FROM_HF[family]` maps back to it). They invert the key
tables of `tunix.models.<family>.params*._get_key_and_transform_mapping`,
which `checkpoints.load_hf` reads through. `FAMILIES` holds both per family.
A `ModelConfig` field that `config.json` cannot carry is a `ValueError`
naming it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import hf_configs

# One parameter -> [(HF key, tensor)]: Gemma3's fused q/k/v weights become
# two or three HF tensors, every other parameter one.
ParamToHF = Callable[[tuple, np.ndarray], list[tuple[str, np.ndarray]]]


def _heads_to_hf(value: np.ndarray) -> np.ndarray:
  """`[D, H, hd]` -> torch `[H * hd, D]`."""
  return value.reshape(value.shape[0], -1).T


def qwen3_param_to_hf(path: tuple, value: np.ndarray) -> tuple[str, np.ndarray]:
  """One Tunix Qwen3 (or Llama3) parameter -> (HF key, torch-layout tensor).

  Args:
    path: The parameter's nnx state path, e.g. `("layers", 0, "attn",
      "q_proj", "w")`.
    value: Its value: q/k/v `[D, H, hd]`, o `[H, hd, D]`, MLP `[in, out]`,
      `lm_head` `[D, V]`, embedding `[V, D]`, norms `[n]`.

  Returns:
    The Hugging Face key and the tensor (`[out, in]` for linear layers).
  """
  path = tuple(path)
  if path == ("embedder", "input_embedding"):
    return "model.embed_tokens.weight", value
  if path == ("final_norm", "w"):
    return "model.norm.weight", value
  if path == ("lm_head", "w"):
    return "lm_head.weight", value.T
  if len(path) < 4 or path[0] != "layers":
    raise ValueError(f"not a Tunix Qwen3 parameter path: {path}")
  _, i, *rest = path
  prefix = f"model.layers.{i}"
  if rest[0] == "attn":
    name = rest[1]
    if name in ("q_norm", "k_norm"):
      return f"{prefix}.self_attn.{name}.weight", value
    if name == "o_proj":  # [H, hd, D] -> [D, H * hd]
      return (
          f"{prefix}.self_attn.o_proj.weight",
          value.reshape(-1, value.shape[-1]).T,
      )
    return f"{prefix}.self_attn.{name}.weight", _heads_to_hf(value)
  if rest[0] == "mlp":
    return f"{prefix}.mlp.{rest[1]}.weight", value.T
  # input_layernorm / post_attention_layernorm
  return f"{prefix}.{rest[0]}.weight", value


def _llama_layout(path: tuple, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
  """Qwen3 and Llama3 share Hugging Face's Llama key layout."""
  return [qwen3_param_to_hf(path, value)]


def qwen2_param_to_hf(path: tuple, value: np.ndarray):
  """One Tunix Qwen2 parameter -> [(HF key, tensor)]: Llama's + q/k/v biases."""
  path = tuple(path)
  if len(path) == 4 and path[-1] in ("q_bias", "k_bias", "v_bias"):
    _, i, _, name = path  # [H * hd], as Hugging Face stores it
    return [(f"model.layers.{i}.self_attn.{name[0]}_proj.bias", value)]
  return _llama_layout(path, value)


_GEMMA3_NORMS = {
    "pre_attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_FUSED = {"q_einsum": "q", "kv_einsum": "kv", "qkv_einsum": "qkv"}


def gemma3_param_to_hf(path: tuple, value: np.ndarray):
  """One Tunix Gemma3 parameter -> [(HF key, tensor)].

  The fused einsum weights (q `[N, D, H]`, kv `[2, K, D, H]`, qkv
  `[3, N, D, H]`) split into `q_proj`/`k_proj`/`v_proj` `[heads * H, D]`;
  `attn_vec_einsum` `[N, H, D]` is `o_proj` `[D, N * H]`. The output head is
  the embedding (tied), so there is no `lm_head`.
  """
  path = tuple(path)
  if path == ("embedder", "input_embedding"):
    return [("model.embed_tokens.weight", value)]
  if path == ("final_norm", "scale"):
    return [("model.norm.weight", value)]
  if len(path) < 4 or path[0] != "layers":
    raise ValueError(f"not a Tunix Gemma3 parameter path: {path}")
  _, i, *rest = path
  prefix = f"model.layers.{i}"
  if rest[0] in _GEMMA3_NORMS:
    return [(f"{prefix}.{_GEMMA3_NORMS[rest[0]]}.weight", value)]
  if rest[0] == "mlp":
    return [(f"{prefix}.mlp.{rest[1]}.weight", value.T)]
  name = rest[1]
  attn = f"{prefix}.self_attn"
  if name in ("_query_norm", "_key_norm"):
    return [(f"{attn}.{name[1]}_norm.weight", value)]
  if name == "attn_vec_einsum":
    return [(f"{attn}.o_proj.weight", value.reshape(-1, value.shape[-1]).T)]
  if name not in _GEMMA3_FUSED:
    raise ValueError(f"not a Tunix Gemma3 parameter path: {path}")
  parts = value[None] if name == "q_einsum" else value
  return [
      (f"{attn}.{p}_proj.weight", _heads_to_hf(part.transpose(1, 0, 2)))
      for p, part in zip(_GEMMA3_FUSED[name], parts)
  ]


def _dense_config(config, model_type: str, architecture: str, tied: bool):
  """The `config.json` fields Qwen3, Qwen2 and Llama3 share."""
  return {
      "architectures": [architecture],
      "model_type": model_type,
      "num_hidden_layers": int(config.num_layers),
      "vocab_size": int(config.vocab_size),
      "hidden_size": int(config.embed_dim),
      "intermediate_size": int(config.hidden_dim),
      "num_attention_heads": int(config.num_heads),
      "head_dim": int(config.head_dim),
      "num_key_value_heads": int(config.num_kv_heads),
      "rope_theta": int(config.rope_theta),
      "rms_norm_eps": float(config.norm_eps),
      "tie_word_embeddings": bool(tied),
      "hidden_act": "silu",
      "rope_scaling": None,
  }


def qwen3_hf_config(config, **extra: Any) -> dict[str, Any]:
  """A Hugging Face Qwen3 `config.json` dict from a Tunix Qwen3 `ModelConfig`.

  Args:
    config: `tunix.models.qwen3.model.ModelConfig` (dense).
    **extra: Further keys (e.g. `bos_token_id`, `eos_token_id`).

  Returns:
    The dict `hf_configs.qwen3_config_from_hf` maps back to `config`.
  """
  if getattr(config, "num_experts", None):
    raise ValueError("save_qwen3_hf: mixture-of-experts Qwen3 is not supported")
  return {
      **_dense_config(
          config, "qwen3", "Qwen3ForCausalLM", config.use_tied_embedding
      ),
      # The base the model computes with (google-tunix 0.1.7's Qwen3 applies
      # its default whatever `config.rope_theta` says).
      "rope_theta": hf_configs.qwen3_applied_rope_theta(config),
      "attention_bias": False,
      "torch_dtype": "float32",
      **extra,
  }


def qwen2_hf_config(config, **extra: Any) -> dict[str, Any]:
  """A Hugging Face Qwen2 `config.json` dict from a Tunix Qwen2 config."""
  return {
      **_dense_config(
          config, "qwen2", "Qwen2ForCausalLM", config.use_tied_embedding
      ),
      "use_sliding_window": False,
      "torch_dtype": "float32",
      **extra,
  }


def llama3_hf_config(config, **extra: Any) -> dict[str, Any]:
  """A Hugging Face Llama `config.json` dict from a Tunix Llama3 config."""
  return {
      **_dense_config(config, "llama", "LlamaForCausalLM", config.weight_tying),
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": "float32",
      **extra,
  }


def _refuse_gemma3(config) -> None:
  """Gemma3 settings `hf_configs.gemma3_config_from_hf` cannot read back."""
  if config.vision_config is not None:
    raise ValueError("gemma3: a vision tower is not exported (text only)")
  if config.sliding_window_size is None:
    raise ValueError("gemma3: sliding_window_size=None has no config.json form")
  if float(config.local_scale_factor) != 1.0:
    raise ValueError(
        f"gemma3: local_scale_factor={config.local_scale_factor} has no"
        " config.json form (only the global layers' RoPE scales)"
    )


def gemma3_hf_config(config, **extra: Any) -> dict[str, Any]:
  """A Hugging Face `gemma3_text` `config.json` dict from a Tunix Gemma3."""
  _refuse_gemma3(config)
  period = len(gemma3_lib.GEMMA3_ATTENTION_PATTERN)
  norm = gemma3_lib.QueryPreAttentionNormalisation
  scalar = (
      config.head_dim
      if config.query_pre_attn_norm == norm.BY_ONE_OVER_SQRT_HEAD_DIM
      else config.embed_dim // config.num_heads
  )
  scale = float(config.global_scale_factor)
  return {
      "architectures": ["Gemma3ForCausalLM"],
      "model_type": "gemma3_text",
      "num_hidden_layers": int(config.num_layers),
      "vocab_size": int(config.num_embed),
      "hidden_size": int(config.embed_dim),
      "intermediate_size": int(config.hidden_dim),
      "num_attention_heads": int(config.num_heads),
      "head_dim": int(config.head_dim),
      "num_key_value_heads": int(config.num_kv_heads),
      "sliding_window": int(config.sliding_window_size),
      "sliding_window_pattern": period,
      "layer_types": [
          "full_attention" if (i + 1) % period == 0 else "sliding_attention"
          for i in range(int(config.num_layers))
      ],
      "rope_local_base_freq": int(config.local_base_frequency),
      "rope_theta": int(config.global_base_frequency),
      "rope_scaling": (
          None if scale == 1.0 else {"rope_type": "linear", "factor": scale}
      ),
      "query_pre_attn_scalar": int(scalar),
      "rms_norm_eps": 1e-6,
      "hidden_activation": "gelu_pytorch_tanh",
      "final_logit_softcapping": None,
      "attn_logit_softcapping": None,
      "tie_word_embeddings": True,
      "torch_dtype": "float32",
      **extra,
  }


class FamilyExport(NamedTuple):
  """How one family is written: its model class, parameters and config."""

  model_class: type
  param_to_hf: ParamToHF
  hf_config: Callable[..., dict[str, Any]]


FAMILIES = {
    "qwen3": FamilyExport(qwen3_lib.Qwen3, _llama_layout, qwen3_hf_config),
    "qwen2": FamilyExport(qwen2_lib.Qwen2, qwen2_param_to_hf, qwen2_hf_config),
    "llama3": FamilyExport(llama3_lib.Llama3, _llama_layout, llama3_hf_config),
    "gemma3": FamilyExport(
        gemma3_lib.Gemma3, gemma3_param_to_hf, gemma3_hf_config
    ),
}


def family_of_model(model) -> str:
  """The family name of a Tunix model (`FAMILIES` key), by its class."""
  for name, family in FAMILIES.items():
    if isinstance(model, family.model_class):
      return name
  raise TypeError(
      f"model must be a Tunix {' / '.join(FAMILIES)} model, got"
      f" {type(model).__name__}"
  )
