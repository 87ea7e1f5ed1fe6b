"""Prompts of the `rl` and `opd` jobs (their rewards: `runs.rl_reward`).

Prompts come from the SFT warm start's built-in task (the default) or from
dataset files named by the recipe's `dataset` section. As in Tunix, every
column of the prompt rows besides the prompt (`answer`, ...) reaches the
reward function as a keyword argument holding one value per completion.

Rows are dicts `{"prompt": str, "answer": ..., <other columns>}`; batches for
Tunix's learners are dicts of NumPy arrays (`prompts` and one array per
column).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import prompt_files

Row = dict[str, Any]



@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Training and held-out prompt rows, and where they came from.

  Attributes:
    train: Rows for training, in order (`num_train` of them).
    held_out: Rows for evaluation (never a training prompt for tasks; for
      datasets, the `dataset.eval` rows or a seeded split of `train`).
    source: `task:<name>` or the dataset's train path.
    columns: Row keys besides `prompt`, passed to reward functions.
    skipped_rows: Dataset rows skipped as bad (`dataset.bad_rows: skip`).
    task: The built-in task, None for datasets.
  """

  train: list[Row]
  held_out: list[Row]
  source: str
  columns: tuple[str, ...]
  skipped_rows: int = 0
  task: tasks_lib.Task | None = None


# -----------------------------------------------------------------------------
# Prompts.
# -----------------------------------------------------------------------------


def task_prompts(sft_cfg, num_train: int, seed: int) -> PromptSet:
  """`num_train` training rows of the SFT task, and its held-out rows.

  Held-out = the SFT job's eval set; training rows never share a prompt
  with it.
  """
  task = tasks_lib.get_task(
      sft_cfg.task.name, **common.to_dict(sft_cfg.task.get("kwargs") or {})
  )
  held_out = task.sample(
      int(sft_cfg.task.num_eval), seed=int(sft_cfg.task.seed) + 1
  )
  held_out_prompts = {p for p, _ in held_out}
  # Oversample: some draws repeat a held-out prompt and are dropped.
  candidates = task.sample(2 * num_train + 256, seed=seed)
  train = [pair for pair in candidates if pair[0] not in held_out_prompts]
  if len(train) < num_train:
    raise errors.UsageError(
        f"task {task.name!r} yields only {len(train)} training prompts outside"
        f" the held-out set; {num_train} are needed"
    )
  return PromptSet(
      train=[{"prompt": p, "answer": a} for p, a in train[:num_train]],
      held_out=[{"prompt": p, "answer": a} for p, a in held_out],
      source=f"task:{task.name}",
      columns=("answer",),
      task=task,
  )


def cycle_rows(rows: Sequence[Row], num: int, seed: int) -> list[Row]:
  """`num` rows: passes over `rows`, each in a fresh seeded order."""
  if not rows:
    raise errors.UsageError("no training prompt rows")
  rng = np.random.default_rng(seed)
  out: list[Row] = []
  while len(out) < num:
    out.extend(rows[i] for i in rng.permutation(len(rows)))
  return out[:num]


def dataset_prompts(
    dataset_cfg,
    *,
    num_train: int,
    num_held_out: int,
    need_answer: bool,
    validate_prompt: Callable[[str], None],
) -> PromptSet:
  """Training and held-out rows from the recipe's `dataset` files.

  Training rows cycle over `dataset.train` in seeded random orders (epochs)
  until `num_train`; held-out rows are `dataset.eval` (first `num_eval`,
  then first `num_held_out`) or, without `dataset.eval`, `num_held_out`
  rows split off `dataset.train` in a seeded order.
  """
  section = prompt_files.check_dataset_section(dataset_cfg)
  read = functools.partial(
      prompt_files.read_prompt_rows,
      file_format=str(section["format"]),
      fields=section["fields"],
      need_answer=need_answer,
      validate_prompt=validate_prompt,
      bad_rows=section["bad_rows"],
  )
  train, skipped = read(str(section["train"]))
  if section.get("eval"):
    held_out, skipped_eval = read(str(section["eval"]))
    skipped += skipped_eval
    if section.get("num_eval") is not None:
      held_out = held_out[: int(section["num_eval"])]
  else:
    order = np.random.default_rng(section["seed"]).permutation(len(train))
    if len(train) <= num_held_out:
      raise errors.UsageError(
          f"dataset.train has {len(train)} usable rows; without dataset.eval"
          f" {num_held_out} are held out (eval.num_prompts) and at least one"
          " must remain for training"
      )
    held_out = [train[i] for i in order[:num_held_out]]
    train = [train[i] for i in order[num_held_out:]]
  held_out = held_out[:num_held_out]
  if not held_out:
    raise errors.UsageError(f"no held-out prompt rows in {section.get('eval')}")
  columns = tuple(sorted(k for k in train[0] if k != "prompt")) if train else ()
  held_columns = tuple(sorted(k for k in held_out[0] if k != "prompt"))
  if train and held_columns != columns:
    raise errors.UsageError(
        f"dataset.eval rows have columns {list(held_columns)}, dataset.train"
        f" rows {list(columns)}: the reward sees both"
    )
  return PromptSet(
      train=cycle_rows(train, num_train, seed=section["seed"] + 1),
      held_out=held_out,
      source=str(section["train"]),
      columns=columns,
      skipped_rows=skipped,
  )


def prompt_length(tokenizer, prompt: str) -> int:
  """Tokens the rollout encodes for `prompt`: BOS (if any) + its ids."""
  bos = 1 if tokenizer.bos_id() is not None else 0
  return len(tokenizer.encode(prompt)) + bos


def prompt_validator(
    tokenizer, max_prompt_length: int | None
) -> Callable[[str], None]:
  """Raises ValueError for prompts the tokenizer rejects or that are too long.

  The count includes BOS when the tokenizer has one, as the rollout encodes.
  With `max_prompt_length=None` (sized from the rows later) only the
  tokenizer checks apply.
  """

  def validate(prompt: str) -> None:
    length = prompt_length(tokenizer, prompt)
    if max_prompt_length is not None and length > max_prompt_length:
      raise errors.UsageError(
          f"prompt of {length} tokens exceeds rollout.max_prompt_length="
          f"{max_prompt_length}"
      )

  return validate


def prompt_batches(rows: Sequence[Row], batch_size: int) -> Iterator[dict]:
  """Tunix RL inputs: `prompts` and one NumPy array per other column.

  Non-scalar column values (lists, dicts) become object arrays, so Tunix's
  per-generation `np.repeat` keeps one value per row.
  """
  columns = [k for k in (rows[0] if rows else {}) if k != "prompt"]
  for start in range(0, len(rows) - batch_size + 1, batch_size):
    chunk = rows[start : start + batch_size]
    batch = {"prompts": np.array([r["prompt"] for r in chunk])}
    for column in columns:
      values = [r[column] for r in chunk]
      if all(isinstance(v, (str, int, float, bool)) for v in values):
        batch[column] = np.array(values)
      else:
        batch[column] = np.empty(len(values), object)
        batch[column][:] = values
    yield batch


def prompt_pairs(rows: Sequence[Row]) -> list[tuple[str, str]]:
  """(prompt, answer) strings of rows (for causal teacher training)."""
  return [(r["prompt"], str(r["answer"])) for r in rows]


def recipe_prompts(
    cfg, sft_cfg, tokenizer, *, num_train: int, num_held_out: int, seed: int
) -> PromptSet:
  """Task rows (`dataset` null) or dataset rows, checked before compute."""
  if cfg.get("dataset") is None:
    prompts = task_prompts(sft_cfg, num_train, seed=seed)
    return dataclasses.replace(
        prompts, held_out=prompts.held_out[:num_held_out]
    )
  return dataset_prompts(
      cfg.dataset,
      num_train=num_train,
      num_held_out=num_held_out,
      need_answer=not cfg.get("reward"),
      validate_prompt=prompt_validator(
          tokenizer, _optional_int(cfg.rollout.get("max_prompt_length"))
      ),
  )


def _optional_int(value) -> int | None:
  return None if value is None else int(value)


def size_prompts(
    cfg, tokenizer, prompts: PromptSet, *, job: str
) -> tuple[int, dict[str, int]]:
  """The rollouts' prompt width, and how many prompts it truncates.

  `rollout.max_prompt_length: null` sizes the width from the rows (the
  longest training or held-out prompt, BOS included), so nothing is cut.
  A set width that some prompts exceed keeps their last tokens, as the
  rollout engine does; the counts are printed once here and go to
  `summary.json` (`prompt_truncation`), instead of a log line per prompt.

  Args:
    cfg: The rl/opd recipe (`rollout.max_prompt_length`).
    tokenizer: The policy's tokenizer.
    prompts: The job's prompt rows.
    job: `rl` or `opd`, for the printed line.

  Returns:
    (max_prompt_length, {"max_prompt_length", "longest_prompt",
    "truncated_train", "truncated_held_out"}).
  """
  lengths = {}
  for name, rows in (("train", prompts.train), ("held_out", prompts.held_out)):
    lengths[name] = [prompt_length(tokenizer, r["prompt"]) for r in rows]
  longest = max((max(v, default=0) for v in lengths.values()), default=0)
  limit = _optional_int(cfg.rollout.get("max_prompt_length"))
  if limit is None:
    limit = max(longest, 1)
  elif limit < 1:
    raise errors.UsageError(
        f"rollout.max_prompt_length must be >= 1 or null, got {limit}"
    )
  counts = {
      "max_prompt_length": limit,
      "longest_prompt": longest,
      "truncated_train": sum(n > limit for n in lengths["train"]),
      "truncated_held_out": sum(n > limit for n in lengths["held_out"]),
  }
  truncated = counts["truncated_train"] or counts["truncated_held_out"]
  if truncated and distributed.is_main_process():
    print(
        f"{job}: {counts['truncated_train']} of {len(lengths['train'])}"
        f" training and {counts['truncated_held_out']} of"
        f" {len(lengths['held_out'])} held-out prompts are longer than"
        f" rollout.max_prompt_length={limit} (longest {longest} tokens) and"
        f" keep their last {limit} tokens; rollout.max_prompt_length=null"
        " sizes it from the prompts",
        file=sys.stderr,
    )
  return limit, counts


__all__ = [
    "PromptSet",
    "cycle_rows",
    "dataset_prompts",
    "prompt_batches",
    "prompt_length",
    "prompt_pairs",
    "prompt_validator",
    "recipe_prompts",
    "size_prompts",
    "task_prompts",
]
