"""The prompt files of the `rl` and `opd` jobs: their `dataset` section,
their rows and the checks made before any compute.

A prompt file row is an object with a non-empty `prompt` (the column named
by `dataset.fields.prompt`), an `answer` unless the recipe names its own
`reward`, and any other columns, the same in every row; each becomes
`{"prompt", ["answer"], <other columns>}` (`prompt_row`). Bad rows are
skipped and counted or stop the job with their `file:line`
(`dataset.bad_rows`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from tunix_blockdiff import errors
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.runs import common

Row = dict[str, Any]

DATASET_KEYS = (
    "train",
    "eval",
    "format",
    "fields",
    "bad_rows",
    "seed",
    "num_eval",
)
# The shared `dataset.fields` schema; RL and OPD read `prompt` and `answer`.
FIELD_KEYS = ("prompt", "completion", "messages", "text", "answer")
BAD_ROWS = ("skip", "error")
MAX_REPORTED_BAD_ROWS = 5


def check_dataset_section(dataset_cfg) -> dict[str, Any]:
  """The `dataset` section as a dict with defaults, or a clear ValueError."""
  section = dict(common.to_dict(dataset_cfg))
  unknown = sorted(set(section) - set(DATASET_KEYS))
  if unknown:
    raise errors.UsageError(
        f"unknown dataset keys {unknown}; allowed: {list(DATASET_KEYS)}"
    )
  if not section.get("train"):
    raise errors.UsageError(
        "dataset.train must name the prompt file(s) (path or glob)"
    )
  fields = dict(section.get("fields") or {})
  unknown = sorted(set(fields) - set(FIELD_KEYS))
  if unknown:
    raise errors.UsageError(
        f"unknown dataset.fields keys {unknown}; allowed: {list(FIELD_KEYS)}"
    )
  section["fields"] = {"prompt": "prompt", "answer": "answer", **fields}
  section.setdefault("format", "auto")
  section["bad_rows"] = section.get("bad_rows") or "skip"
  if section["bad_rows"] not in BAD_ROWS:
    raise errors.UsageError(
        f"dataset.bad_rows must be one of {BAD_ROWS}, got"
        f" {section['bad_rows']!r}"
    )
  section["seed"] = int(section.get("seed") or 0)
  return section


def prompt_row(raw: Any, fields: dict[str, str]) -> Row:
  """A prompt file's row as `{"prompt", ["answer"], <other columns>}`."""
  prompt_key, answer_key = fields["prompt"], fields["answer"]
  if not isinstance(raw, dict):
    raw = {"": raw}  # Reported as a missing prompt.
  row = {k: v for k, v in raw.items() if k not in (prompt_key, answer_key)}
  row.pop("", None)
  row["prompt"] = raw.get(prompt_key)
  if answer_key in raw:
    row["answer"] = raw[answer_key]
  return row


def check_prompt_row(row: Row, fields: dict[str, str],
                     need_answer: bool) -> None:
  """Raises `UsageError` for a row without a prompt (or a needed answer)."""
  if not isinstance(row["prompt"], str) or not row["prompt"]:
    raise errors.UsageError(
        f"field {fields['prompt']!r} must be a non-empty string, got"
        f" {row['prompt']!r} (columns: {sorted(k for k in row if k != 'prompt')})"
    )
  if need_answer and "answer" not in row:
    raise errors.UsageError(
        f"field {fields['answer']!r} is missing (the default exact-match"
        " reward needs it; or set reward)"
    )


def check_prompt_files(section: dict[str, Any], need_answer: bool) -> None:
  """The prompt files of a checked `dataset` section open and hold a good row.

  For the check before any compute (`runs.job_schemas`).

  Raises:
    UsageError: naming the key, the files and the first bad row.
  """
  fields = section["fields"]

  def check(location, raw):
    try:
      check_prompt_row(prompt_row(raw, fields), fields, need_answer)
    except errors.UsageError as e:
      raise errors.UsageError(f"{location}: bad prompt row: {e}") from None

  for split in ("train", "eval"):
    if section.get(split):
      try:
        # Every row under `bad_rows: error` (prompt files are small).
        sources_lib.check_rows(section[split], check,
                               format=str(section.get("format", "auto")),
                               bad_rows=section["bad_rows"], limit=None)
      except errors.UsageError as e:
        raise errors.UsageError(f"dataset.{split}: {e}") from None


def read_prompt_rows(
    paths_or_glob: str,
    *,
    file_format: str,
    fields: dict[str, str],
    need_answer: bool,
    validate_prompt: Callable[[str], None],
    bad_rows: str,
) -> tuple[list[Row], int]:
  """(rows, number skipped) read with `data.sources.read_rows`.

  Each row becomes `{"prompt": row[fields.prompt], "answer":
  row[fields.answer], <other keys>}`. A row is bad when its prompt is not a
  non-empty string, `validate_prompt` rejects it (ValueError), its answer is
  missing while `need_answer`, or its keys differ from the first good row's.
  Bad rows raise (`bad_rows="error"`, with the row's `file:line`) or are
  skipped, counted and the first few printed (`"skip"`).
  """
  rows, skipped, columns = [], 0, None
  rows_in = sources_lib.read_rows(paths_or_glob, format=file_format)
  for location, raw in rows_in:
    row = prompt_row(raw, fields)
    try:
      check_prompt_row(row, fields, need_answer)
      validate_prompt(row["prompt"])
      keys = tuple(sorted(k for k in row if k != "prompt"))
      if columns is not None and keys != columns:
        raise errors.UsageError(
            f"row has columns {list(keys)}, earlier rows {list(columns)}"
        )
    except ValueError as e:
      if bad_rows == "error":
        raise errors.UsageError(f"{location}: bad prompt row: {e}") from None
      skipped += 1
      if skipped <= MAX_REPORTED_BAD_ROWS:
        print(f"skipping bad prompt row {location}: {e}", file=sys.stderr)
      continue
    columns = keys
    rows.append(row)
  if skipped:
    print(f"skipped {skipped} bad prompt rows of {paths_or_glob}")
  return rows, skipped


__all__ = [
    "BAD_ROWS",
    "DATASET_KEYS",
    "FIELD_KEYS",
    "MAX_REPORTED_BAD_ROWS",
    "Row",
    "check_dataset_section",
    "check_prompt_files",
    "check_prompt_row",
    "prompt_row",
    "read_prompt_rows",
]
