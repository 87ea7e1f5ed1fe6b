"""Tunix Qwen3 -> Hugging Face model directory (the loader's inverse).

`save_qwen3_hf` writes `config.json` and `model.safetensors` with Hugging
Face key names and torch weight layouts (`[out, in]` linear weights), the
layout `checkpoints.load_qwen3` (Tunix's
`tunix.models.qwen3.params.create_model_from_safe_tensors`) reads, so a model
trained here loads through the same path as a downloaded Qwen3-0.6B
(`model.kind: qwen3_hf`). Tokenizer files can be copied alongside.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

from flax import nnx
import numpy as np

# Files of a Hugging Face tokenizer that travel with `tokenizer.json`.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def qwen3_param_to_hf(path: tuple, value: np.ndarray) -> tuple[str, np.ndarray]:
  """One Tunix Qwen3 parameter -> (HF key, tensor in torch layout).

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
    # q/k/v [D, H, hd] -> [H * hd, D]
    return (
        f"{prefix}.self_attn.{name}.weight",
        value.reshape(value.shape[0], -1).T,
    )
  if rest[0] == "mlp":
    return f"{prefix}.mlp.{rest[1]}.weight", value.T
  # input_layernorm / post_attention_layernorm
  return f"{prefix}.{rest[0]}.weight", value


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
      "architectures": ["Qwen3ForCausalLM"],
      "model_type": "qwen3",
      "num_hidden_layers": int(config.num_layers),
      "vocab_size": int(config.vocab_size),
      "hidden_size": int(config.embed_dim),
      "intermediate_size": int(config.hidden_dim),
      "num_attention_heads": int(config.num_heads),
      "head_dim": int(config.head_dim),
      "num_key_value_heads": int(config.num_kv_heads),
      "rope_theta": int(config.rope_theta),
      "rms_norm_eps": float(config.norm_eps),
      "tie_word_embeddings": bool(config.use_tied_embedding),
      "hidden_act": "silu",
      "attention_bias": False,
      "torch_dtype": "float32",
      **extra,
  }


def save_qwen3_hf(
    model,
    path: str | pathlib.Path,
    *,
    tokenizer_json: str | pathlib.Path | None = None,
    **config_extra: Any,
) -> pathlib.Path:
  """Writes a Tunix Qwen3 as a Hugging Face model directory.

  Weights are written in float32 (`torch_dtype: float32`); load them in
  another dtype with `load_qwen3(..., dtype=...)`.

  Args:
    model: A Tunix `Qwen3` without LoRA (merge LoRA first with
      `checkpoints.merge_lora`).
    path: Output directory (created; existing files are overwritten).
    tokenizer_json: Optional `tokenizer.json` (a file, or a directory holding
      it); `tokenizer_config.json` and `special_tokens_map.json` beside it are
      copied too, so `transformers.AutoTokenizer` and `tokenizer.kind: hf`
      load the directory.
    **config_extra: Extra `config.json` keys (e.g. `eos_token_id`).

  Returns:
    The directory, holding `config.json`, `model.safetensors` and the
    tokenizer files.
  """
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  config = getattr(model, "config", None)
  if config is None or not hasattr(config, "num_kv_heads"):
    raise TypeError(
        "model must be a Tunix Qwen3 (with a ModelConfig `config`), got"
        f" {type(model).__name__}"
    )
  if nnx.state(model, nnx.LoRAParam):
    raise ValueError(
        "model has LoRA parameters: merge them first"
        " (tunix_blockdiff.models.checkpoints.merge_lora)"
    )
  tokenizer_files = []
  if tokenizer_json is not None:
    source = pathlib.Path(tokenizer_json).expanduser()
    folder = source if source.is_dir() else source.parent
    if not (folder / "tokenizer.json").is_file():
      raise FileNotFoundError(
          f"tokenizer_json: no tokenizer.json at {tokenizer_json}"
      )
    tokenizer_files = [
        folder / name for name in TOKENIZER_FILES if (folder / name).is_file()
    ]
  hf_config = qwen3_hf_config(config, **config_extra)
  tensors = {}
  for param_path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key, value = qwen3_param_to_hf(
        tuple(param_path), np.asarray(variable.get_value(), np.float32)
    )
    tensors[key] = np.ascontiguousarray(value)
  out = pathlib.Path(path).expanduser()
  out.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  for file in tokenizer_files:
    if file.resolve() != (out / file.name).resolve():
      shutil.copyfile(file, out / file.name)
  return out


__all__ = ["qwen3_hf_config", "qwen3_param_to_hf", "save_qwen3_hf"]
