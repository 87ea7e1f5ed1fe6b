"""The paths a recipe names, checked for what they must be before any work.

Dataset files that exist, a Hugging Face model directory, the output_dir
of an sft, rl or opd run with a saved checkpoint. Each refusal is a
one-line `UsageError` naming the key (`runs.schema.refuse`).
"""

from __future__ import annotations

import pathlib
from typing import Any

from tunix_blockdiff import errors
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import schema as s

def check_paths(key: str, value: Any) -> list[str]:
  """The files a dataset path, glob or list names; refuses one naming none."""
  try:
    return sources_lib.resolve_paths(value)
  except errors.MissingFileError as e:
    raise s.refuse(key, value, f"must name existing files: {e}") from None


def check_hf_dir(key: str, value: Any) -> pathlib.Path:
  """`value`, a Hugging Face model directory (config.json, *.safetensors)."""
  if value is None or not str(value).strip():
    raise s.refuse(key, value, "must be set: a Hugging Face model directory"
                   " with config.json and *.safetensors")
  path = pathlib.Path(str(value)).expanduser()
  if not path.is_dir():
    raise s.refuse(key, value, "must be a Hugging Face model directory"
                   f" (config.json and *.safetensors): {path} is not a"
                   " directory")
  if not (path / "config.json").is_file():
    raise s.refuse(key, value, "must be a Hugging Face model directory:"
                   f" {path} has no config.json")
  if not list(path.glob("*.safetensors")):
    raise s.refuse(key, value, "must be a Hugging Face model directory:"
                   f" {path} has no *.safetensors files")
  return path


def check_run_dir(key: str, value: Any) -> pathlib.Path:
  """`value`, the output_dir of an sft, rl or opd run with a checkpoint."""
  path = pathlib.Path(str(value)).expanduser()
  if not path.is_dir():
    raise s.refuse(key, value, "must be the output_dir of an sft, rl or opd"
                   f" run: {path} is not a directory")
  policy = rl_checkpoints.policy_dir(path)
  if not (policy / "recipe.yaml").is_file():
    raise s.refuse(key, value, "must be the output_dir of an sft, rl or opd"
                   f" run: {policy / 'recipe.yaml'} not found")
  steps = [p for p in (policy / "checkpoints").glob("*")
           if p.is_dir() and p.name.isdigit()]
  if not steps:
    raise s.refuse(key, value, "must be a run with a saved checkpoint: no"
                   f" step under {policy / 'checkpoints'} (did it finish?)")
  return path


__all__ = ["check_hf_dir", "check_paths", "check_run_dir"]
