"""Released block-diffusion checkpoints: their formats, read onto Tunix.

SDAR (JetAstra; its RL-trained TraDo models share the format) and
Fast-dLLM v2 (NVlabs) publish Qwen-architecture transformers that generate
by block diffusion: a Qwen3 or Qwen2.5 body, a mask token, a block size and
a logit alignment. This module says, per format, how a `config.json` is
recognised (`model_type` or `architectures`), which Tunix family it loads
as, and the block-diffusion settings and decoding defaults that go with it:

| format         | family | block | alignment       | decoding default        |
|----------------|--------|-------|-----------------|-------------------------|
| `sdar`         | qwen3  | 4     | `same_position` | threshold 0.85, >= 1/step |
| `fast_dllm_v2` | qwen2  | 32    | `shifted`       | threshold 0.9, sub-blocks of 8 |
| `a2d_qwen3` (`a2d_qwen2`, `a2d_llama`) | qwen3 (qwen2, llama3) | 32* | `same_position` | 1 token per step (static) |

*dllm's A2D checkpoints (Tiny-A2D: Qwen3-0.6B as BD3LM or MDLM) do not
record a block size: 32 is its BD3LM sampler's default, and a recipe may set
another (an MDLM checkpoint was trained over whole sequences).

The weights are the base family's own Hugging Face names, so loading is the
family's loader on a `config.json` rewritten to the base `model_type`
(`base_config`). A variant the package cannot represent is refused in one
line naming the field (`detect`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ReleasedFormat:
  """One released checkpoint format.

  Attributes:
    name: Registry name (`sdar`, `fast_dllm_v2`).
    family: The Tunix family its body loads as (`hf_configs.FAMILIES`).
    base_model_type: That family's Hugging Face `model_type`.
    model_types: `config.json` `model_type` values of this format.
    architectures: `config.json` `architectures` entries of this format.
    block_size_key: The `config.json` key holding the block size (None:
      the format does not record one; a recipe's own is then accepted).
    default_block_size: The block size when the key is absent.
    default_mask_token_id: The mask id when neither `mask_token_id` nor the
      tokenizer's mask token gives one (None: required).
    alignment: `same_position` or `shifted`.
    canvas: The canvas that pairs with it (`all_masked`, or
      `seed_and_mask`: the clean first slot a shifted model's block starts
      from, the token Fast-dLLM v2 appends from the previous block).
    decoding: `generate`'s defaults (threshold, steps_per_block,
      temperature, max_new_tokens), from the format's reference decoder.
    refused: `model_type` values of this family the package refuses, with
      why.
  """

  name: str
  family: str
  base_model_type: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  block_size_key: str | None
  default_block_size: int
  default_mask_token_id: int | None
  alignment: str
  canvas: str
  decoding: Mapping[str, Any]
  refused: Mapping[str, str] = dataclasses.field(default_factory=dict)


FORMATS = {
    "sdar": ReleasedFormat(
        name="sdar",
        family="qwen3",
        base_model_type="qwen3",
        model_types=("sdar",),
        architectures=("SDARForCausalLM",),
        block_size_key="block_size",
        default_block_size=4,
        default_mask_token_id=None,
        alignment="same_position",
        canvas="all_masked",
        # SDAR's generate.py: block 4, low_confidence_dynamic with
        # threshold 0.85 (every slot above it, else the most confident).
        decoding={"threshold": 0.85, "steps_per_block": None,
                  "temperature": 0.0, "max_new_tokens": None},
        refused={"sdar_moe": "mixture-of-experts SDAR (30B-A3B) is not"
                 " supported: this package loads dense Qwen3 only"},
    ),
    "fast_dllm_v2": ReleasedFormat(
        name="fast_dllm_v2",
        family="qwen2",
        base_model_type="qwen2",
        model_types=("Fast_dLLM_Qwen", "fast_dllm_qwen"),
        architectures=("Fast_dLLM_QwenForCausalLM",),
        block_size_key="bd_size",
        default_block_size=32,
        default_mask_token_id=151665,
        alignment="shifted",
        canvas="seed_and_mask",
        # Fast-dLLM v2's generate: block 32 in sub-blocks of 8, threshold
        # 0.9 (`DenoiseConfig.sub_block_size`).
        decoding={"threshold": 0.9, "steps_per_block": None,
                  "sub_block_size": 8, "temperature": 0.0,
                  "max_new_tokens": None},
    ),
}
# dllm's AR-to-diffusion (A2D) conversions: the AR body, bidirectional
# within the blocks its BD3LM sampler passes as a staircase mask, the
# tokenizer's mask token, no shift; its sampler commits a fixed number of
# the most confident slots per step (1 at its defaults: 128 steps, 128 new
# tokens, blocks of 32).
for _name, _family, _type, _arch in (
    ("a2d_qwen3", "qwen3", "a2d-qwen3", "A2DQwen3LMHeadModel"),
    ("a2d_qwen2", "qwen2", "a2d-qwen2", "A2DQwen2LMHeadModel"),
    ("a2d_llama", "llama3", "a2d-llama", "A2DLlamaLMHeadModel"),
):
  FORMATS[_name] = ReleasedFormat(
      name=_name,
      family=_family,
      base_model_type={"llama3": "llama"}.get(_family, _family),
      model_types=(_type,),
      architectures=(_arch,),
      block_size_key=None,
      default_block_size=32,
      default_mask_token_id=None,
      alignment="same_position",
      canvas="all_masked",
      decoding={"threshold": 0.9, "steps_per_block": 32,
                "temperature": 0.0, "max_new_tokens": None},
  )


def detect(hf_config: Mapping[str, Any]) -> ReleasedFormat | None:
  """The released format of a `config.json`, or None for a plain model.

  Raises:
    ValueError: A refused variant of a known format, naming `model_type`.
  """
  model_type = hf_config.get("model_type")
  architectures = tuple(hf_config.get("architectures") or ())
  for fmt in FORMATS.values():
    if model_type in fmt.refused:
      raise ValueError(
          f"config.json model_type={model_type!r}: {fmt.refused[model_type]}")
    if model_type in fmt.model_types or set(architectures) & set(
        fmt.architectures):
      return fmt
  return None


def recognises(hf_config: Mapping[str, Any]) -> bool:
  """Whether a `config.json` is a released format, refused variants too."""
  try:
    return detect(hf_config) is not None
  except ValueError:
    return True


def base_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """`hf_config` as its base family's `config.json` (others: unchanged)."""
  fmt = detect(hf_config)
  if fmt is None:
    return dict(hf_config)
  return {**hf_config, "model_type": fmt.base_model_type}


def _tokenizer_mask_id(path: pathlib.Path | None) -> int | None:
  """The id of the tokenizer's mask token, from the directory's files."""
  if path is None:
    return None
  try:
    token = json.loads((path / "tokenizer_config.json").read_text()).get(
        "mask_token")
    if isinstance(token, dict):
      token = token.get("content")
    vocab = json.loads((path / "tokenizer.json").read_text())
  except (OSError, json.JSONDecodeError):
    return None
  for added in vocab.get("added_tokens", []):
    if token is not None and added.get("content") == token:
      return int(added["id"])
  return None


def diffusion_settings(
    hf_config: Mapping[str, Any], path: str | pathlib.Path | None = None
) -> dict[str, Any]:
  """`BlockDiffusionConfig` fields of a released checkpoint.

  `block_size` from the format's key (else its default), `mask_token_id`
  from `config.json`, else the tokenizer's mask token in `path`, else the
  format's default; `alignment` and its `canvas` are the format's.

  Raises:
    ValueError: Not a released format, or no mask token id to be found.
  """
  fmt = detect(hf_config)
  if fmt is None:
    raise ValueError("config.json is not a released block-diffusion format"
                     f" (model_type {hf_config.get('model_type')!r})")
  mask = hf_config.get("mask_token_id")
  if mask is None:
    mask = _tokenizer_mask_id(
        None if path is None else pathlib.Path(path).expanduser())
  if mask is None:
    mask = fmt.default_mask_token_id
  if mask is None:
    raise ValueError(
        f"config.json mask_token_id: missing, and the tokenizer has no mask"
        f" token; a {fmt.name} checkpoint needs one")
  block = (fmt.default_block_size if fmt.block_size_key is None else
           hf_config.get(fmt.block_size_key, fmt.default_block_size))
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(
        f"config.json {fmt.block_size_key} must be a positive int, got"
        f" {block!r}")
  return {"block_size": block, "mask_token_id": int(mask),
          "alignment": fmt.alignment, "canvas": fmt.canvas}


def check_diffusion(hf_config: Mapping[str, Any], path, diffusion) -> None:
  """Refuses a recipe whose block diffusion differs from the checkpoint's.

  Fine-tuning a released checkpoint under another mask token, block size or
  alignment would train a different model than the one it is.

  Args:
    hf_config: The checkpoint's `config.json` (a released format).
    path: Its directory (for a mask token read from the tokenizer).
    diffusion: The recipe's `BlockDiffusionConfig`.

  Raises:
    ValueError: naming `diffusion.<key>`, the recipe's and the checkpoint's
      values.
  """
  fmt = detect(hf_config)
  for key, value in diffusion_settings(hf_config, path).items():
    if key == "block_size" and fmt.block_size_key is None:
      continue  # not recorded by the checkpoint: the recipe's own
    if getattr(diffusion, key) != value:
      raise ValueError(
          f"diffusion.{key}={getattr(diffusion, key)!r} differs from the"
          f" {fmt.name} checkpoint's {value!r}; set diffusion.{key}={value}")


def compare_reference(directory: str | pathlib.Path) -> float:
  """Max |logit| difference of `directory`'s Tunix model to its reference.

  `directory/reference.npz` (`tools/released_goldens.py`: the format's own
  PyTorch code on fixed tokens, positions and mask) against the model
  `checkpoints.load_hf` reads from the same directory, in float32.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff import arrays  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  directory = pathlib.Path(directory).expanduser()
  ref = np.load(directory / "reference.npz")
  model = checkpoints.load_hf(directory, dtype="float32")
  logits, _ = model(arrays.asarray(ref["tokens"]),
                    arrays.asarray(ref["positions"]), None,
                    arrays.asarray(ref["mask"]))
  return float(np.abs(np.asarray(logits) - ref["logits"]).max())


__all__ = [
    "FORMATS",
    "ReleasedFormat",
    "base_config",
    "check_diffusion",
    "compare_reference",
    "detect",
    "recognises",
    "diffusion_settings",
]
