"""The sft job's data: a built-in task, or the user's files (`dataset`).

`dataset: null` (the default) trains on `task` (`tunix_blockdiff.tasks`); a
`dataset` block replaces it with files read through `tunix_blockdiff.data`:

  dataset:
    train: path/or/glob      # jsonl | parquet | a save_to_disk directory
    eval: path/or/glob       # optional: eval loss and generation metrics
    format: auto             # auto | jsonl | parquet | hf_disk
    fields: {prompt: prompt, completion: completion, messages: messages,
             text: text, answer: answer}
    bad_rows: skip           # skip (counted, reported) | error (file:line)
    seed: 0                  # seeds the {"text"} cut points
    num_eval: null           # the first N eval rows; null: all

On user data the generation eval reports exact match (whitespace-trimmed
text), normalized edit similarity (`metrics.edit_similarity`, characters) and
tokens per model call, and prints a few samples coloured by commit step.
"""

from __future__ import annotations

import re
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from tunix_blockdiff import data as data_lib
from tunix_blockdiff import errors
from tunix_blockdiff import metrics
from tunix_blockdiff import trajectory
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.runs import common

DATASET_DEFAULTS = {
    "train": None,
    "eval": None,
    "format": "auto",
    "fields": dict(rows_lib.RowFields().__dict__),
    "bad_rows": "skip",
    "seed": 0,
    "num_eval": None,
}
NUM_SAMPLES = 3


class ExactMatch:
  """Scores a generation against the reference text (trimmed)."""

  def check(self, prompt: str, completion: str, reference: str) -> bool:
    del prompt
    return completion.strip() == reference.strip()


class SFTData(NamedTuple):
  """Training and evaluation data of the sft job.

  Attributes:
    name: The task name or the training path, for titles.
    train: Training `Example`s (a list, or `data.FileExamples`).
    eval: Held-out `Example`s; None when a dataset has no `eval`.
    eval_pairs: (prompt text, reference text) of each held-out example.
    task: Scores a generation: `check(prompt, completion, reference)`.
    bad_rows: Per split, `FileExamples.report()`; None for a task.
  """

  name: str
  train: Sequence[data_lib.Example]
  eval: Sequence[data_lib.Example] | None
  eval_pairs: list[tuple[str, str]]
  task: Any
  bad_rows: dict[str, Any] | None


def _check_keys(given: dict, valid: dict, prefix: str) -> None:
  for key in given:
    if key not in valid:
      raise errors.UsageError(
          f"unknown recipe key '{prefix}.{key}'"
          + errors.nearest(key, valid)
          + f"; valid keys: {sorted(valid)}"
      )


def dataset_settings(dataset_cfg) -> dict[str, Any]:
  """The `dataset` block with defaults filled in, checked.

  Raises:
    UsageError: An unknown key, a missing `train`, or a bad value.
  """
  given = common.to_dict(dataset_cfg)
  if not isinstance(given, dict):
    raise errors.UsageError(
        f"dataset must be a mapping of {sorted(DATASET_DEFAULTS)} or null,"
        f" got {given!r}"
    )
  _check_keys(given, DATASET_DEFAULTS, "dataset")
  settings = {**DATASET_DEFAULTS, **given}
  fields = settings["fields"] or {}
  if not isinstance(fields, dict):
    raise errors.UsageError(f"dataset.fields must be a mapping, got {fields!r}")
  _check_keys(fields, DATASET_DEFAULTS["fields"], "dataset.fields")
  settings["fields"] = {**DATASET_DEFAULTS["fields"], **fields}
  if not settings["train"]:
    raise errors.UsageError(
        "dataset.train is required when dataset is set: a path or glob of"
        " .jsonl/.parquet files or a save_to_disk directory"
    )
  if settings["bad_rows"] not in rows_lib.BAD_ROW_POLICIES:
    raise errors.UsageError(
        f"dataset.bad_rows must be one of {rows_lib.BAD_ROW_POLICIES}, got"
        f" {settings['bad_rows']!r}"
    )
  if settings["format"] not in data_lib.sources.FORMATS:
    raise errors.UsageError(
        f"dataset.format must be one of {data_lib.sources.FORMATS}, got"
        f" {settings['format']!r}"
    )
  num_eval, seed = settings["num_eval"], settings["seed"]
  if num_eval is not None and (not isinstance(num_eval, int) or num_eval < 1):
    raise errors.UsageError(
        f"dataset.num_eval must be an int >= 1 or null, got {num_eval!r}"
    )
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise errors.UsageError(f"dataset.seed must be an int >= 0, got {seed!r}")
  return settings


def _load(settings, split: str, tokenizer, limit, **check) -> Any:
  examples = data_lib.FileExamples(
      data_lib.open_source(settings[split], format=settings["format"]),
      tokenizer=tokenizer,
      fields=rows_lib.RowFields(**settings["fields"]),
      seed=int(settings["seed"]),
      bad_rows=settings["bad_rows"],
      limit=limit,
      **check,
  )
  line = (
      f"dataset.{split}: {len(examples)} examples from {examples.num_rows} rows"
  )
  if examples.num_bad:
    line += (
        f", {examples.num_bad} bad rows skipped (bad_rows=skip; first:"
        f" {examples.bad_examples[0]})"
    )
  print(line, file=sys.stderr, flush=True)
  return examples


def build_sft_data(
    cfg,
    tokenizer,
    *,
    seq_len: int,
    vocab_size: int,
    mask_token_id: int,
    train: bool = True,
) -> SFTData:
  """The recipe's data: `dataset` when set, else `task`.

  Args:
    cfg: The recipe.
    tokenizer: The recipe's tokenizer.
    seq_len: Row length; longer examples are bad rows.
    vocab_size: The model's vocabulary size.
    mask_token_id: The mask token, which data must not contain.
    train: False skips reading a dataset's training files or drawing a
      task's training examples (`train` is then empty), for jobs that only
      need the held-out split.
  """
  dataset_cfg = cfg.get("dataset")
  if dataset_cfg is None:
    if cfg.get("task") is None:
      raise errors.UsageError(
          "the recipe has no data: set dataset.train (your files) or task"
      )
    task_data = common.build_task_data(
        cfg.task,
        tokenizer,
        seq_len=seq_len,
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
        train=train,
    )
    return SFTData(
        cfg.task.name,
        task_data.train,
        task_data.eval,
        task_data.eval_pairs,
        task_data.task,
        None,
    )
  settings = dataset_settings(dataset_cfg)
  check = dict(
      seq_len=seq_len, vocab_size=vocab_size, mask_token_id=mask_token_id
  )
  bad_rows = {"policy": settings["bad_rows"]}
  train_examples = []
  if train:
    train_examples = _load(settings, "train", tokenizer, None, **check)
    bad_rows["train"] = train_examples.report()
  eval_examples, eval_pairs = None, []
  if settings["eval"]:
    eval_examples = _load(
        settings, "eval", tokenizer, settings["num_eval"], **check
    )
    bad_rows["eval"] = eval_examples.report()
    for i in range(len(eval_examples)):
      encoded = eval_examples.encoded(i)
      eval_pairs.append((encoded.prompt_text, encoded.reference))
  name = str(settings["train"])
  return SFTData(
      name, train_examples, eval_examples, eval_pairs, ExactMatch(), bad_rows
  )


def mean_edit_similarity(
    completions: Sequence[str], pairs: Sequence[tuple[str, str]]
) -> float:
  """Mean character edit similarity of each completion to its reference."""
  return float(
      np.mean([
          metrics.edit_similarity(c.strip(), ref.strip())
          for c, (_, ref) in zip(completions, pairs)
      ])
  )


def _shown(text: str, limit: int = 160, keep_end: bool = False) -> str:
  """`text` on one line (`\\n` for breaks), cut to `limit` characters."""
  text = text.replace("\n", "\\n")
  if len(text) <= limit:
    return text
  return "…" + text[-limit:] if keep_end else text[:limit] + "…"


def render_samples(
    result: common.GenerationEval,
    pairs: Sequence[tuple[str, str]],
    tokenizer,
    block_size: int,
    *,
    num: int = NUM_SAMPLES,
    color: bool = True,
) -> str:
  """Prompt, reference and generation (coloured by commit step) of a few rows."""

  def decode_token(i: int) -> str:
    if i == tokenizer.eos_id():
      return "⏎"
    return tokenizer.decode([i]) or "·"

  lines = []
  num = min(num, len(pairs))
  rendered = trajectory.render_terminal(
      result.tokens[:num],
      result.commit_step[:num],
      decode_token,
      block_size,
      first_position=result.prompt_lengths[:num],
  ).split("\n")
  for i in range(num):
    prompt, reference = pairs[i]
    lines += [
        f"--- sample {i}",
        f"prompt:     {_shown(prompt, keep_end=True)}",
        f"reference:  {_shown(reference)}",
        f"generation: {rendered[i]}",
    ]
  lines.append(rendered[-1])
  text = "\n".join(lines)
  return text if color else re.sub(r"\x1b\[[0-9;]*m", "", text)


__all__ = [
    "DATASET_DEFAULTS",
    "ExactMatch",
    "SFTData",
    "build_sft_data",
    "dataset_settings",
    "mean_edit_similarity",
    "render_samples",
]
