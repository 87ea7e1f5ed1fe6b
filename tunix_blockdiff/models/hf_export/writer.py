"""A Tunix model -> a Hugging Face directory (config.json + safetensors).

`save_hf` writes any family in `families.FAMILIES` with Hugging Face key
names and torch layouts, which `checkpoints.load_hf` (Tunix's own
safetensors loaders) reads back into the same model. Weights above
`max_shard_bytes` are split into `model-0000i-of-0000n.safetensors` with a
`model.safetensors.index.json`, as `transformers` writes them.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Any

from flax import nnx
import ml_dtypes
import numpy as np

from tunix_blockdiff.models.hf_export import families

# Files of a Hugging Face tokenizer that travel with `tokenizer.json`.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
  """`'5GB'` -> 5e9 bytes (GB = 10^9, GiB = 2^30; a bare number is bytes).

  Raises:
    ValueError: Not a positive size.
  """
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text).upper())
  if not match or float(match.group(1)) <= 0:
    raise ValueError(
        f"{text!r} is not a size: use e.g. 5GB, 500MB, 2GiB or a byte count"
    )
  return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def tokenizer_files(source: str | pathlib.Path) -> list[pathlib.Path]:
  """The `TOKENIZER_FILES` beside a `tokenizer.json` (a file or its folder).

  Raises:
    FileNotFoundError: No `tokenizer.json` there.
  """
  source = pathlib.Path(source).expanduser()
  folder = source if source.is_dir() else source.parent
  if not (folder / "tokenizer.json").is_file():
    raise FileNotFoundError(f"no tokenizer.json at {source}")
  return [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]


def hf_tensors(
    model, *, family: str | None = None, dtype: str | None = None
) -> tuple[str, dict[str, np.ndarray]]:
  """(family, {HF key: tensor}) of a Tunix model without LoRA.

  Args:
    model: A Tunix model of a `families.FAMILIES` family.
    family: Its family; None: from its class.
    dtype: `float32 | bfloat16 | float16`; None: the parameters' own dtype
      when they share one, else float32.

  Returns:
    The family and the tensors, C-contiguous, in one dtype.
  """
  family = family or families.family_of_model(model)
  if nnx.state(model, nnx.LoRAParam):
    raise ValueError(
        "model has LoRA parameters: merge them first"
        " (tunix_blockdiff.models.checkpoints.merge_lora)"
    )
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  if dtype is None:
    kinds = {np.dtype(v.get_value().dtype) for _, v in params}
    target = kinds.pop() if len(kinds) == 1 else _DTYPES["float32"]
    if target not in _DTYPES.values():
      target = _DTYPES["float32"]
  else:
    target = _DTYPES[dtype]
  tensors = {}
  for path, variable in params:
    value = np.asarray(variable.get_value())
    for key, tensor in families.FAMILIES[family].param_to_hf(tuple(path), value):
      tensors[key] = np.ascontiguousarray(tensor.astype(target))
  return family, tensors


def plan_shards(
    tensors: dict[str, np.ndarray], max_shard_bytes: int
) -> list[list[str]]:
  """Keys grouped in order into shards of at most `max_shard_bytes` each.

  A tensor larger than the limit gets a shard of its own (as `transformers`
  does); it is never split.
  """
  shards, size = [[]], 0
  for key, tensor in tensors.items():
    if shards[-1] and size + tensor.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(key)
    size += tensor.nbytes
  return shards


def write_safetensors(
    tensors: dict[str, np.ndarray],
    out: pathlib.Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
  """Writes `model.safetensors`, or shards + index above the limit.

  Returns:
    The file names written.
  """
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  shards = plan_shards(tensors, max_shard_bytes)
  metadata = {"format": "pt"}
  if len(shards) == 1:
    safetensors.numpy.save_file(tensors, str(out / SINGLE_FILE), metadata)
    return [SINGLE_FILE]
  names = [
      f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      for i in range(len(shards))
  ]
  weight_map = {}
  for name, keys in zip(names, shards):
    safetensors.numpy.save_file(
        {k: tensors[k] for k in keys}, str(out / name), metadata
    )
    weight_map.update({k: name for k in keys})
  index = {
      "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
      "weight_map": weight_map,
  }
  (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return names + [INDEX_FILE]


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
  first = next(iter(tensors.values()))
  return next(n for n, d in _DTYPES.items() if d == first.dtype)


def save_hf(
    model,
    path: str | pathlib.Path,
    *,
    family: str | None = None,
    tokenizer_json: str | pathlib.Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **config_extra: Any,
) -> pathlib.Path:
  """Writes a Tunix model of any family as a Hugging Face model directory.

  Args:
    model: A Tunix Qwen3, Qwen2, Llama3 or Gemma3 without LoRA (merge LoRA
      first with `checkpoints.merge_lora`).
    path: Output directory (created; existing files are overwritten).
    family: The model's family; None: from its class.
    tokenizer_json: Optional `tokenizer.json` (a file, or its directory);
      the other `TOKENIZER_FILES` beside it are copied too.
    dtype: Weight dtype written (`hf_tensors`); `torch_dtype` says which.
    max_shard_bytes: Largest safetensors file before sharding.
    **config_extra: Extra `config.json` keys (e.g. `eos_token_id`).

  Returns:
    The directory.
  """
  extra_files = [] if tokenizer_json is None else tokenizer_files(tokenizer_json)
  family, tensors = hf_tensors(model, family=family, dtype=dtype)
  hf_config = families.FAMILIES[family].hf_config(model.config)
  hf_config.update(torch_dtype=_dtype_name(tensors), **config_extra)
  out = pathlib.Path(path).expanduser()
  out.mkdir(parents=True, exist_ok=True)
  write_safetensors(tensors, out, max_shard_bytes=max_shard_bytes)
  (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  for file in extra_files:
    if file.resolve() != (out / file.name).resolve():
      shutil.copyfile(file, out / file.name)
  return out


def save_qwen3_hf(
    model,
    path: str | pathlib.Path,
    *,
    tokenizer_json: str | pathlib.Path | None = None,
    **config_extra: Any,
) -> pathlib.Path:
  """Writes a Tunix Qwen3 as a Hugging Face directory, in float32 (`save_hf`).

  Load it in another dtype with `load_qwen3(..., dtype=...)`.

  Args:
    model: A Tunix `Qwen3` without LoRA.
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
  config = getattr(model, "config", None)
  if config is None or not hasattr(config, "num_kv_heads"):
    raise TypeError(
        "model must be a Tunix Qwen3 (with a ModelConfig `config`), got"
        f" {type(model).__name__}"
    )
  if tokenizer_json is not None:
    try:
      tokenizer_files(tokenizer_json)
    except FileNotFoundError:
      raise FileNotFoundError(
          f"tokenizer_json: no tokenizer.json at {tokenizer_json}"
      ) from None
  return save_hf(
      model,
      path,
      family="qwen3",
      tokenizer_json=tokenizer_json,
      dtype="float32",
      **config_extra,
  )
