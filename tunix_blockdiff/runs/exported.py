"""The `block_diffusion` section of an exported Hugging Face directory.

`tunix-blockdiff export RUN OUT` writes it into `OUT/config.json`, and
`tunix-blockdiff generate OUT` reads it, so the directory alone is enough to
generate. Keys (docs/export.md):

  version        1
  block_size, mask_token_id, alignment, canvas, stream, ...
                 the run's `diffusion` section (`BlockDiffusionConfig`)
  decoding       generate's defaults from the run: threshold, steps_per_block,
                 sub_block_size, temperature, max_new_tokens (the run's eval
                 budget or null)
  eval_prompts   up to 4 held-out prompts of the run: [{prompt, ids, answer}]
                 (generate's default prompts)
  eval_scored    whether generate scores exact match on them (a task run)
  tokenizer      {kind: hf, eos_token} (files beside config.json) or
                 {kind: char, alphabet} (`tasks.CharTokenizer`, in code)
  dtype, param_dtype  what generate loads the weights as (the run's)
  source         {run, checkpoint_step, model_kind}
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import errors
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.models import released
from tunix_blockdiff.runs import common

SECTION = "block_diffusion"
VERSION = 1
CONFIG_FILE = "config.json"
NUM_EVAL_PROMPTS = 4
DECODING_KEYS = ("threshold", "steps_per_block", "sub_block_size",
                 "temperature", "max_new_tokens")


def read_config(path: str | pathlib.Path) -> dict[str, Any] | None:
  """`path/config.json` parsed, or None when absent or not JSON."""
  file = pathlib.Path(path).expanduser() / CONFIG_FILE
  if not file.is_file():
    return None
  try:
    return json.loads(file.read_text())
  except json.JSONDecodeError:
    return None


def is_exported(path: str | pathlib.Path) -> bool:
  """Whether `path` is an HF directory generate reads on its own.

  One whose config.json has the section (`tunix-blockdiff export`), or a
  released block-diffusion checkpoint (`models.released`: SDAR, Fast-dLLM
  v2), whose section `released_section` derives.
  """
  config = read_config(path)
  if not isinstance(config, dict):
    return False
  # A refused variant counts: `read_section` then says why.
  return isinstance(config.get(SECTION), dict) or released.recognises(config)


def released_section(path: pathlib.Path, config) -> dict[str, Any]:
  """The section a released checkpoint implies (its format's defaults).

  Raises:
    UsageError: A refused variant or a missing setting, naming the field.
  """
  try:
    fmt = released.detect(config)
    settings = released.diffusion_settings(config, path)
  except ValueError as e:
    raise errors.UsageError(f"{pathlib.Path(path) / CONFIG_FILE}: {e}") from None
  decoding = dict(fmt.decoding)
  sub = decoding.get("sub_block_size")
  if sub is not None and (settings["block_size"] % sub
                          or sub >= settings["block_size"]):
    decoding["sub_block_size"] = None  # blocks no bigger than a sub-block
  return {
      "version": VERSION,
      **settings,
      "decoding": decoding,
      "eval_prompts": [],
      "eval_scored": False,
      "tokenizer": {"kind": "hf", "eos_token": None},
      "dtype": "float32",
      "param_dtype": None,
      "source": {"run": str(path), "checkpoint_step": 0,
                 "model_kind": fmt.name},
  }


def tokenizer_spec(tokenizer_cfg, tokenizer) -> dict[str, Any]:
  """The section's `tokenizer` entry for a run's tokenizer."""
  if tokenizer_cfg.kind == "char":
    return {"kind": "char", "alphabet": tokenizer.alphabet}
  return {"kind": "hf", "eos_token": tokenizer_cfg.get("eos_token")}


def decoding_defaults(cfg, generate_defaults, budget: int | None):
  """generate's decoding defaults for a run: its recipe's `eval` values."""
  eval_cfg = cfg.get("eval") or {}
  return {
      key: eval_cfg.get(key, generate_defaults[key])
      for key in DECODING_KEYS
      if key != "max_new_tokens"
  } | {"max_new_tokens": budget}


def section(
    cfg,
    *,
    run_dir: pathlib.Path,
    step: int,
    tokenizer,
    decoding: dict[str, Any],
    eval_prompts: list[dict[str, Any]],
    eval_scored: bool,
) -> dict[str, Any]:
  """The `block_diffusion` section of an SFT run (its recipe `cfg`)."""
  diffusion = common.diffusion_config_from(cfg.diffusion)
  from_hf = str(cfg.model.kind).endswith("_hf")
  return {
      "version": VERSION,
      **dataclasses.asdict(diffusion),
      "decoding": decoding,
      "eval_prompts": eval_prompts,
      "eval_scored": bool(eval_scored),
      "tokenizer": tokenizer_spec(cfg.tokenizer, tokenizer),
      "dtype": str(cfg.model.get("dtype") or "float32") if from_hf else "float32",
      "param_dtype": cfg.model.get("param_dtype") if from_hf else None,
      "source": {
          "run": str(run_dir),
          "checkpoint_step": int(step),
          "model_kind": str(cfg.model.kind),
      },
  }


def read_section(path: str | pathlib.Path) -> dict[str, Any]:
  """The checked `block_diffusion` section of an exported directory.

  Raises:
    UsageError: No section, another version, or a value
      `BlockDiffusionConfig` rejects (named).
  """
  config = read_config(path) or {}
  found = config.get(SECTION)
  if found is None and released.recognises(config):
    found = released_section(pathlib.Path(path), config)
  where = f"{pathlib.Path(path) / CONFIG_FILE} {SECTION}"
  if not isinstance(found, dict):
    raise errors.UsageError(f"{where}: missing (not an exported directory)")
  if found.get("version") != VERSION:
    raise errors.UsageError(
        f"{where}.version must be {VERSION}, got {found.get('version')!r}"
    )
  for key in ("decoding", "tokenizer", "source"):
    if not isinstance(found.get(key), dict):
      raise errors.UsageError(f"{where}.{key} must be a mapping")
  unknown = set(found["decoding"]) - set(DECODING_KEYS)
  if unknown:
    raise errors.UsageError(
        f"{where}.decoding: unknown keys {sorted(unknown)}; known:"
        f" {list(DECODING_KEYS)}"
    )
  diffusion_config(found, where=where)
  return found


def diffusion_config(found, *, where: str = SECTION):
  """The `BlockDiffusionConfig` a section records."""
  names = [f.name for f in dataclasses.fields(config_lib.BlockDiffusionConfig)]
  try:
    return config_lib.BlockDiffusionConfig(
        **{k: found[k] for k in names if k in found}
    )
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"{where}: {e}") from None


def build_tokenizer(path: pathlib.Path, found):
  """The tokenizer a section names (its files are beside config.json)."""
  spec = found["tokenizer"]
  if spec.get("kind") == "char":
    return tasks_lib.CharTokenizer(str(spec.get("alphabet", tasks_lib.ALPHABET)))
  if spec.get("kind") == "hf":
    if not (path / "tokenizer.json").is_file():
      raise errors.MissingFileError(
          f"{path / 'tokenizer.json'} not found: {SECTION}.tokenizer.kind=hf"
          " reads the tokenizer files beside config.json"
      )
    from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

    return checkpoints.HFTokenizer(path, eos_token=spec.get("eos_token"))
  raise errors.UsageError(
      f"{SECTION}.tokenizer.kind must be 'char' or 'hf', got"
      f" {spec.get('kind')!r}"
  )


class Loaded(NamedTuple):
  """What generate needs from an exported directory.

  Attributes:
    model: The Tunix model (`checkpoints.load_hf`).
    tokenizer: Its tokenizer.
    diffusion: The run's `BlockDiffusionConfig`.
    step: The checkpoint step the weights came from.
    eval_prompts: The run's held-out prompts: [{prompt, ids, answer}].
    scored: Whether generate scores exact match on them (a task run).
  """

  model: Any
  tokenizer: Any
  diffusion: config_lib.BlockDiffusionConfig
  step: int
  eval_prompts: list[dict[str, Any]]
  scored: bool


def load(path: pathlib.Path, mesh=None) -> Loaded:
  """The model, tokenizer and settings of an exported directory."""
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  found = read_section(path)
  tokenizer = build_tokenizer(path, found)
  model = checkpoints.load_hf(
      path,
      dtype=str(found.get("dtype") or "float32"),
      param_dtype=found.get("param_dtype"),
      mesh=mesh,
  )
  return Loaded(
      model,
      tokenizer,
      diffusion_config(found),
      int(found["source"].get("checkpoint_step", 0)),
      list(found.get("eval_prompts") or []),
      bool(found.get("eval_scored", False)),
  )


__all__ = [
    "Loaded",
    "SECTION",
    "decoding_defaults",
    "is_exported",
    "load",
    "read_section",
    "section",
]
