"""Test helper: a Tunix model of any family -> a tiny Hugging Face directory.

The inverse of Tunix's safetensors loaders, written independently of them:
Qwen3, Qwen2 and Llama3 share Hugging Face's Llama key layout
(`hf_export.qwen3_param_to_hf`; Qwen2 adds q/k/v biases), Gemma3 has its own
(fused einsum weights, four norms per layer). Values are randomised first
(norms too), so a swapped mapping cannot pass a logits comparison.
"""

import json
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from tunix_blockdiff.models import hf_export

_GEMMA3_NORMS = {
    "pre_attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _heads_to_hf(value):
  """[D, H, hd] -> torch [H * hd, D]."""
  return value.reshape(value.shape[0], -1).T


def _gemma3_to_hf(path, value):
  """One Tunix Gemma3 parameter -> [(HF key, torch-layout tensor)]."""
  if path == ("embedder", "input_embedding"):
    return [("model.embed_tokens.weight", value)]
  if path == ("final_norm", "scale"):
    return [("model.norm.weight", value)]
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
  if name == "attn_vec_einsum":  # [N, H, D] -> [D, N * H]
    return [(f"{attn}.o_proj.weight", value.reshape(-1, value.shape[-1]).T)]
  # q [N, D, H]; kv [2, K, D, H]; qkv [3, N, D, H] -> [N * H, D] each.
  stacked = {"q_einsum": "q", "kv_einsum": "kv", "qkv_einsum": "qkv"}[name]
  parts = value[None] if stacked == "q" else value
  return [
      (f"{attn}.{p}_proj.weight", _heads_to_hf(part.transpose(1, 0, 2)))
      for p, part in zip(stacked, parts)
  ]


def param_to_hf(family: str, path: tuple, value: np.ndarray):
  """One Tunix parameter -> [(HF key, tensor in torch layout)]."""
  path = tuple(path)
  if family == "gemma3":
    return _gemma3_to_hf(path, value)
  if path[-1] in ("q_bias", "k_bias", "v_bias"):  # Qwen2
    _, i, _, name = path
    return [(f"model.layers.{i}.self_attn.{name[0]}_proj.bias", value)]
  return [hf_export.qwen3_param_to_hf(path, value)]


def hf_config(family: str, config) -> dict:
  """The `config.json` of a Tunix `ModelConfig` of `family`."""
  common = {
      "num_hidden_layers": config.num_layers,
      "hidden_size": config.embed_dim,
      "intermediate_size": config.hidden_dim,
      "num_attention_heads": config.num_heads,
      "head_dim": config.head_dim,
      "num_key_value_heads": config.num_kv_heads,
      "torch_dtype": "float32",
  }
  if family == "gemma3":
    return common | {
        "model_type": "gemma3_text",
        "vocab_size": config.num_embed,
        "sliding_window": config.sliding_window_size,
        "rope_local_base_freq": config.local_base_frequency,
        "rope_theta": config.global_base_frequency,
        "query_pre_attn_scalar": config.head_dim,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "sliding_window_pattern": 6,
    }
  if family == "qwen3":
    return hf_export.qwen3_hf_config(config)
  tied = (
      config.weight_tying if family == "llama3" else config.use_tied_embedding
  )
  return common | {
      "model_type": {"qwen2": "qwen2", "llama3": "llama"}[family],
      "vocab_size": config.vocab_size,
      "rope_theta": config.rope_theta,
      "rms_norm_eps": config.norm_eps,
      "tie_word_embeddings": tied,
      "hidden_act": "silu",
      "rope_scaling": None,
  }


def randomize(model, seed: int = 0):
  """Every parameter drawn from N(0, 0.5^2), in place; returns the model."""
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype),
      nnx.state(model, nnx.Param),
  )
  nnx.update(model, state)
  return model


def write(directory: pathlib.Path, family: str, model) -> pathlib.Path:
  """Writes `model` (a Tunix model of `family`) as an HF directory."""
  tensors = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = np.asarray(variable.get_value(), np.float32)
    for key, tensor in param_to_hf(family, path, value):
      tensors[key] = np.ascontiguousarray(tensor, np.float32)
  directory.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
  config = hf_config(family, model.config)
  (directory / "config.json").write_text(json.dumps(config))
  return directory


def causal_logits(model, vocab: int, length: int) -> np.ndarray:
  """A causal LM's logits [2, length, vocab] on fixed random tokens.

  What the round-trip tests compare between a model and its reloaded copy;
  one jitted program per model structure (called eagerly, every op of the
  forward was compiled on its own).
  """
  tokens = jnp.asarray(
      np.random.default_rng(1).integers(0, vocab, (2, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), (2, length))
  mask = jnp.tril(jnp.ones((length, length), bool))[None].repeat(2, 0)
  return np.asarray(_forward(model, tokens, positions, mask))


@nnx.jit
def _forward(model, tokens, positions, mask):
  return model(tokens, positions, None, mask)[0]
