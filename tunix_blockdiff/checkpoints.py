"""Pretrained Tunix models from Hugging Face safetensors checkpoints.

A Hugging Face model directory (`config.json` plus `*.safetensors`, e.g. a
local copy of `Qwen/Qwen3-0.6B`) becomes a Tunix Qwen3 through Tunix's own
loader (`tunix.models.qwen3.params.create_model_from_safe_tensors`); only the
`ModelConfig` is read from `config.json` here, so any dense Qwen3 size loads
the same way, including the tiny checkpoints the tests write.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from tunix.models.qwen3 import model as qwen3_lib
from tunix.models.qwen3 import params as qwen3_params

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def as_dtype(name: str | None):
  """`'float32' | 'bfloat16' | 'float16' | None` -> a jnp dtype or None."""
  if name is None:
    return None
  if name not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
  return _DTYPES[name]


def read_hf_config(path: str | pathlib.Path) -> dict[str, Any]:
  """The `config.json` of a Hugging Face model directory."""
  config_file = pathlib.Path(path).expanduser() / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(
        f"{config_file} not found: model path must be a Hugging Face model"
        " directory with config.json and *.safetensors"
    )
  return json.loads(config_file.read_text())


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
  model_type = hf_config.get("model_type", "qwen3")
  if model_type != "qwen3":
    raise ValueError(f"model_type must be 'qwen3', got {model_type!r}")
  if hf_config.get("num_experts"):
    raise ValueError(
        "mixture-of-experts Qwen3 checkpoints are not supported by this"
        " loader; use a dense Qwen3"
    )
  required = (
      "num_hidden_layers",
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_attention_heads",
      "num_key_value_heads",
  )
  missing = [key for key in required if key not in hf_config]
  if missing:
    raise ValueError(f"config.json is missing {missing}")
  heads = int(hf_config["num_attention_heads"])
  head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
  return qwen3_lib.ModelConfig(
      num_layers=int(hf_config["num_hidden_layers"]),
      vocab_size=int(hf_config["vocab_size"]),
      embed_dim=int(hf_config["hidden_size"]),
      hidden_dim=int(hf_config["intermediate_size"]),
      num_heads=heads,
      head_dim=head_dim,
      num_kv_heads=int(hf_config["num_key_value_heads"]),
      rope_theta=int(hf_config.get("rope_theta", 1_000_000)),
      norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
      use_tied_embedding=bool(hf_config.get("tie_word_embeddings", False)),
      dtype=as_dtype(dtype),
      param_dtype=as_dtype(param_dtype or dtype),
      use_flash_attention=use_flash_attention,
  )


def load_qwen3(
    path: str | pathlib.Path,
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    use_flash_attention: bool = False,
) -> qwen3_lib.Qwen3:
  """Loads a Hugging Face Qwen3 checkpoint as a Tunix Qwen3.

  Args:
    path: Directory with `config.json` and `*.safetensors` (HF key names).
    dtype: Activation dtype name.
    param_dtype: Parameter dtype name (default: `dtype`); loaded tensors are
      cast to it.
    mesh: Optional mesh to shard the parameters on (Tunix's sharding rules).
    use_flash_attention: Tunix's Splash path (TPU).

  Returns:
    A Tunix `Qwen3` with the checkpoint's weights.
  """
  path = pathlib.Path(path).expanduser()
  config = qwen3_config_from_hf(
      read_hf_config(path),
      dtype=dtype,
      param_dtype=param_dtype,
      use_flash_attention=use_flash_attention,
  )
  if not list(path.glob("*.safetensors")):
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  return qwen3_params.create_model_from_safe_tensors(
      str(path), config, mesh=mesh, dtype=as_dtype(param_dtype or dtype)
  )


class HFTokenizer:
  """A Hugging Face tokenizer with the method names the jobs call.

  `encode`, `decode`, `bos_id`, `eos_id`, `pad_id`, as `tasks.CharTokenizer`.
  """

  def __init__(self, path: str | pathlib.Path, *, eos_token: str | None = None):
    import transformers  # pylint: disable=g-import-not-at-top

    self._tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(pathlib.Path(path).expanduser())
    )
    self._eos = (
        self._tokenizer.convert_tokens_to_ids(eos_token)
        if eos_token
        else self._tokenizer.eos_token_id
    )
    self.vocab_size = len(self._tokenizer)

  def bos_id(self) -> int | None:
    return self._tokenizer.bos_token_id

  def eos_id(self) -> int:
    return int(self._eos)

  def unk_id(self) -> int | None:
    """The unknown-token id (text the vocabulary cannot spell), if any."""
    return self._tokenizer.unk_token_id

  def pad_id(self) -> int:
    pad = self._tokenizer.pad_token_id
    return int(self._eos if pad is None else pad)

  def encode(self, text: str, **unused_kwargs) -> list[int]:
    return list(self._tokenizer.encode(text, add_special_tokens=False))

  def apply_chat_template(
      self, messages, *, add_generation_prompt: bool = True
  ) -> str:
    """`messages` rendered as text with the tokenizer's own chat template."""
    if not self._tokenizer.chat_template:
      from tunix_blockdiff import errors  # pylint: disable=g-import-not-at-top

      raise errors.UsageError(
          "rows in the {'messages'} form need a chat template; the tokenizer"
          f" at {self._tokenizer.name_or_path!r} has none"
      )
    return self._tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )

  def decode(self, ids, **unused_kwargs) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id() in ids:
      ids = ids[: ids.index(self.eos_id())]
    return self._tokenizer.decode(ids, skip_special_tokens=True)


__all__ = [
    "HFTokenizer",
    "as_dtype",
    "load_qwen3",
    "merge_lora",
    "qwen3_config_from_hf",
    "read_hf_config",
]


def merge_lora(lora_model, plain_model, *, rank: int, alpha: float):
  """A plain model whose weights are `W + (alpha / rank) * A @ B`.

  For serving and evaluation: the merged model computes what the qwix LoRA
  model computes, with no interception and no extra matmuls. Neither input is
  modified.

  Args:
    lora_model: A model after `qwix.apply_lora_to_model` (LoRA pairs
      `<name>_lora_a` [..., r] and `<name>_lora_b` [r, ...] beside `<name>`).
    plain_model: The same architecture without LoRA (e.g. the model LoRA was
      applied to); only its structure is used.
    rank: The LoRA rank r.
    alpha: The LoRA alpha.

  Returns:
    A new model of `plain_model`'s type with the merged weights.
  """
  if rank < 1:
    raise ValueError(f"rank must be >= 1, got {rank}")
  from flax import nnx  # pylint: disable=g-import-not-at-top

  lora = {
      tuple(path): variable.get_value()
      for path, variable in nnx.to_flat_state(nnx.state(lora_model))
  }
  graphdef, state = nnx.split(plain_model)
  merged = []
  for path, variable in nnx.to_flat_state(state):
    path = tuple(path)
    if path not in lora:
      raise ValueError(f"{path} of plain_model is not in lora_model")
    value = lora[path]
    a_key = path[:-1] + (f"{path[-1]}_lora_a",)
    b_key = path[:-1] + (f"{path[-1]}_lora_b",)
    if a_key in lora:
      delta = jnp.tensordot(
          lora[a_key].astype(jnp.float32),
          lora[b_key].astype(jnp.float32),
          axes=1,
      )
      value = (value.astype(jnp.float32) + delta * (alpha / rank)).astype(
          value.dtype
      )
    merged.append((path, variable.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(merged))
