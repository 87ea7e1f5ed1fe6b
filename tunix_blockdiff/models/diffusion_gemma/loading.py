"""Loading a `transformers` DiffusionGemma checkpoint directory.

`load(path)` reads `config.json` (refusing unsupported fields by name),
single or sharded safetensors, and maps the reference's parameter names onto
`DiffusionGemma`. The encoder and decoder share their weights (the reference
ties them); only the per-pass layer scalars differ. The vision tower and its
embedder are skipped (this is the text model; image inputs are refused
elsewhere), audio weights are refused, and any other unknown tensor is an
error naming it, so nothing is silently dropped.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Iterator

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff.models.diffusion_gemma import config as config_lib
from tunix_blockdiff.models.diffusion_gemma import model as model_lib

_SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_REFUSED = ("audio", "embed_audio")
_PREFIXES = ("model.decoder.", "model.encoder.language_model.")
_NORMS = ("input_layernorm", "post_attention_layernorm",
          "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
          "pre_feedforward_layernorm_2")


def read_json(path: pathlib.Path) -> dict[str, Any] | None:
  return json.loads(path.read_text()) if path.exists() else None


def read_config(path: str | pathlib.Path, *, dtype: str = "float32",
                param_dtype: str | None = None):
  """(model config, sampler config) of a checkpoint directory."""
  path = pathlib.Path(path)
  config_json = read_json(path / "config.json")
  if config_json is None:
    raise FileNotFoundError(f"{path}/config.json not found")
  config = config_lib.from_hf(config_json, dtype=dtype,
                              param_dtype=param_dtype)
  sampler = config_lib.sampler_from_generation_config(
      read_json(path / "generation_config.json"), config)
  if config_json.get("tie_word_embeddings") is False:
    raise ValueError(
        "config.json tie_word_embeddings=False is not supported: the"
        " DiffusionGemma head is the embedding table"
    )
  return config, sampler


def _tensors(path: pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  index = read_json(path / "model.safetensors.index.json")
  files = (sorted(set(index["weight_map"].values())) if index
           else ["model.safetensors"])
  for name in files:
    if not (path / name).exists():
      raise FileNotFoundError(f"{path}/{name} not found")
    for key, value in safetensors.numpy.load_file(str(path / name)).items():
      yield key, value


def _target(key: str) -> tuple[tuple[Any, ...], str] | None:
  """(our parameter path, layout) for a reference tensor name, or None."""
  if key == "lm_head.weight":
    return None  # tied to the embedding
  prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
  if prefix is None:
    raise ValueError(f"unexpected tensor {key!r} in the checkpoint")
  rest = key[len(prefix):]
  encoder = prefix != _PREFIXES[0]
  if rest == "embed_tokens.weight":
    return ("embedding",), "same"
  if rest == "norm.weight":
    return ("norm", "scale"), "same"
  m = re.fullmatch(r"self_conditioning\.(\w+)\.weight", rest)
  if m and not encoder:
    name = m.group(1)
    if name == "pre_norm":
      return ("self_conditioning", "pre_norm", "scale"), "same"
    return ("self_conditioning", "mlp", name, "kernel"), "transpose"
  m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
  if not m:
    raise ValueError(f"unexpected tensor {key!r} in the checkpoint")
  i, rest = int(m.group(1)), m.group(2)
  base = ("layers", i)
  if rest == "layer_scalar":
    return base + ("encoder_scalar" if encoder else "decoder_scalar",), "same"
  if rest.removesuffix(".weight") in _NORMS:
    return base + (rest.removesuffix(".weight"), "scale"), "same"
  m = re.fullmatch(r"self_attn\.(q|k|v|o)_proj\.weight", rest)
  if m:
    return base + ("self_attn", f"{m.group(1)}_proj", "kernel"), "transpose"
  m = re.fullmatch(r"self_attn\.(q|k)_norm\.weight", rest)
  if m:
    return base + ("self_attn", f"{m.group(1)}_norm", "scale"), "same"
  m = re.fullmatch(r"mlp\.(gate|up|down)_proj\.weight", rest)
  if m:
    return base + ("mlp", f"{m.group(1)}_proj", "kernel"), "transpose"
  routed = {
      "router.proj.weight": (("moe", "router_proj", "kernel"), "transpose"),
      "router.scale": (("moe", "router_scale"), "same"),
      "router.per_expert_scale": (("moe", "per_expert_scale"), "same"),
      "experts.gate_up_proj": (("moe", "gate_up"), "experts"),
      "experts.down_proj": (("moe", "down"), "experts"),
  }
  if rest in routed:
    path, layout = routed[rest]
    return base + path, layout
  raise ValueError(f"unexpected tensor {key!r} in the checkpoint")


def load(path: str | pathlib.Path, *, dtype: str = "float32",
         param_dtype: str | None = None):
  """A `DiffusionGemma` and its sampler defaults from an HF directory.

  Args:
    path: Directory with `config.json` (`model_type: diffusion_gemma`),
      `model.safetensors` or a sharded `model.safetensors.index.json`, and
      optionally `generation_config.json`.
    dtype: Activation dtype name (`float32`, `bfloat16`, `float16`).
    param_dtype: Parameter dtype name (default: `dtype`).

  Returns:
    (model, sampler config, number of skipped vision tensors).

  Raises:
    ValueError: an unsupported config field, an audio or unknown tensor, a
      shape mismatch, or a parameter missing from the checkpoint.
  """
  path = pathlib.Path(path)
  config, sampler = read_config(path, dtype=dtype, param_dtype=param_dtype)
  abstract = nnx.eval_shape(
      lambda: model_lib.DiffusionGemma(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  loaded: dict[tuple[Any, ...], jax.Array] = {}
  skipped = 0
  pdtype = jnp.dtype(config.param_dtype)
  for key, value in _tensors(path):
    if key.startswith(_SKIPPED):
      skipped += 1
      continue
    if any(part in key for part in _REFUSED):
      raise ValueError(
          f"checkpoint tensor {key!r}: audio is not supported (text only)")
    target = _target(key)
    if target is None:
      continue
    where, layout = target
    if where in loaded and not where[-1].endswith("scalar"):
      continue  # the same tied tensor under the other pass's name
    if layout == "transpose":
      value = value.T
    elif layout == "experts":
      value = np.swapaxes(value, 1, 2)
    if where not in flat:
      raise ValueError(f"checkpoint tensor {key!r} has no place in the model"
                       f" ({'.'.join(map(str, where))})")
    expected = tuple(flat[where].value.shape)
    if tuple(value.shape) != expected:
      raise ValueError(
          f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, the"
          f" model expects {expected}"
      )
    loaded[where] = jnp.asarray(value, pdtype)
  for where in flat:
    if where in loaded:
      continue
    if where[-1] == "encoder_scalar":
      loaded[where] = loaded.get(where[:-1] + ("decoder_scalar",),
                                 jnp.ones((1,), pdtype))
    elif where[-1] == "decoder_scalar":
      loaded[where] = loaded.get(where[:-1] + ("encoder_scalar",),
                                 jnp.ones((1,), pdtype))
    else:
      raise ValueError(
          f"the checkpoint has no tensor for {'.'.join(map(str, where))}")
  for where, variable in flat.items():
    variable.value = loaded[where]
  model = nnx.merge(graphdef, nnx.from_flat_state(flat))
  return model, sampler, skipped
