"""Pretrained Tunix models from Hugging Face safetensors checkpoints.

A Hugging Face model directory (`config.json` plus `*.safetensors`, e.g. a
local copy of `Qwen/Qwen3-0.6B`) becomes a Tunix model of its family (Qwen3,
Qwen2, Llama3 or Gemma3) through Tunix's own loader
(`tunix.models.<family>.params*.create_model_from_safe_tensors`); only the
`ModelConfig` is built here, from `config.json` (`hf_configs`), so any dense
size of a family loads the same way, including the tiny checkpoints the tests
write.
"""

from __future__ import annotations

import importlib
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from tunix_blockdiff.models import hf_configs
from tunix_blockdiff.models import released

as_dtype = hf_configs.as_dtype
qwen3_config_from_hf = hf_configs.qwen3_config_from_hf

# family -> the Tunix module with `create_model_from_safe_tensors`.
_TUNIX_LOADERS = {
    "qwen3": "tunix.models.qwen3.params",
    "qwen2": "tunix.models.qwen2.params",
    "llama3": "tunix.models.llama3.params",
    "gemma3": "tunix.models.gemma3.params_safetensors",
}


def read_hf_config(path: str | pathlib.Path) -> dict[str, Any]:
  """The `config.json` of a Hugging Face model directory."""
  config_file = pathlib.Path(path).expanduser() / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(
        f"{config_file} not found: model path must be a Hugging Face model"
        " directory with config.json and *.safetensors"
    )
  return json.loads(config_file.read_text())


def load_hf(
    path: str | pathlib.Path,
    *,
    family: str | None = None,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    use_flash_attention: bool = False,
):
  """Loads a Hugging Face checkpoint as the Tunix model of its family.

  Args:
    path: Directory with `config.json` and `*.safetensors` (HF key names);
      a released block-diffusion format (`models.released`: SDAR,
      Fast-dLLM v2) loads as its base family.
    family: `qwen3 | qwen2 | llama3 | gemma3`; None: from `model_type`.
      When given, `config.json` must be of that family.
    dtype: Activation dtype name (Llama3 and Gemma3 compute in their
      parameters' dtype, so `param_dtype` must then equal it).
    param_dtype: Parameter dtype name (default: `dtype`); loaded tensors are
      cast to it.
    mesh: Optional mesh to shard the parameters on (Tunix's sharding rules).
    use_flash_attention: Tunix's Splash path (TPU; Qwen3 and Qwen2 only).

  Returns:
    The Tunix model (`Qwen3`, `Qwen2`, `Llama3` or `Gemma3`) with the
    checkpoint's weights.
  """
  path = pathlib.Path(path).expanduser()
  # A released block-diffusion checkpoint (SDAR, Fast-dLLM v2) holds its
  # base family's weights under their own names.
  hf_config = released.base_config(read_hf_config(path))
  if family is None:
    family = hf_configs.family_of(hf_config)
  if family not in hf_configs.CONFIG_FROM_HF:
    raise ValueError(
        f"family must be one of {hf_configs.FAMILIES}, got {family!r}"
    )
  config = hf_configs.CONFIG_FROM_HF[family](
      hf_config,
      dtype=dtype,
      param_dtype=param_dtype,
      use_flash_attention=use_flash_attention,
  )
  if not list(path.glob("*.safetensors")):
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  loader = importlib.import_module(_TUNIX_LOADERS[family])
  return loader.create_model_from_safe_tensors(
      str(path), config, mesh=mesh, dtype=as_dtype(param_dtype or dtype)
  )


def load_qwen3(
    path: str | pathlib.Path,
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    use_flash_attention: bool = False,
):
  """Loads a Hugging Face Qwen3 checkpoint as a Tunix Qwen3 (`load_hf`)."""
  return load_hf(
      path,
      family="qwen3",
      dtype=dtype,
      param_dtype=param_dtype,
      mesh=mesh,
      use_flash_attention=use_flash_attention,
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
    "load_hf",
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
      if delta.shape != value.shape:
        raise ValueError(
            f"{path}: LoRA factors {lora[a_key].shape} x"
            f" {lora[b_key].shape} do not lay out as the weight"
            f" {value.shape}; merge_lora merges LoRA on linear layers only,"
            " not on einsum weights (e.g. Gemma3's q_einsum/kv_einsum):"
            " leave those out of lora.module_path to merge"
        )
      value = (value.astype(jnp.float32) + delta * (alpha / rank)).astype(
          value.dtype
      )
    merged.append((path, variable.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(merged))
