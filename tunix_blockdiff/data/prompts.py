"""Prompt-only rows for generation, read through `sources` like SFT rows.

A row is `{"prompt": str}` (other fields, such as a reference completion,
are ignored) or `{"messages": [{"role", "content"}, ...]}`, rendered with
the tokenizer's chat template (`rows.render_chat`): the turns before a final
assistant turn, plus the generation prompt. A bad row raises `RowError`
whose message starts with `file:line`; `read_prompts` applies the
`bad_rows` policy (`skip`: counted, the first few printed; `error`: raised).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, NamedTuple, Sequence

from tunix_blockdiff import errors
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.data import sources as sources_lib

_MAX_REPORTED = 3


def _chat_prompt(messages: Any, where: str, tokenizer) -> str:
  """The rendered chat prompt: turns before a final assistant turn."""
  if not isinstance(messages, Sequence) or isinstance(messages, str):
    raise sources_lib.RowError(
        f"{where}: field 'messages' must be a list of {{'role', 'content'}}"
        f" turns, got {type(messages).__name__}"
    )
  turns = []
  for i, turn in enumerate(messages):
    if (
        not isinstance(turn, Mapping)
        or not isinstance(turn.get("role"), str)
        or not isinstance(turn.get("content"), str)
    ):
      raise sources_lib.RowError(
          f"{where}: turn {i} of 'messages' must be"
          f" {{'role': str, 'content': str}}, got {turn!r:.80}"
      )
    turns.append({"role": turn["role"], "content": turn["content"]})
  if turns and turns[-1]["role"] == "assistant":
    turns = turns[:-1]
  if not turns:
    raise sources_lib.RowError(f"{where}: 'messages' has no turn to prompt with")
  return rows_lib.render_chat(tokenizer, turns)


def prompt_of_row(row: Any, where: str, tokenizer) -> str:
  """The prompt text of one row (`{"prompt"}` or `{"messages"}`).

  Raises:
    RowError: The row has neither form, a mistyped or empty prompt, or text
      the tokenizer cannot encode (message starts with `where`).
  """
  if not isinstance(row, Mapping):
    raise sources_lib.RowError(
        f"{where}: a row must be an object, got {type(row).__name__}"
    )
  if "messages" in row:
    text = _chat_prompt(row["messages"], where, tokenizer)
  elif "prompt" in row:
    text = row["prompt"]
    if not isinstance(text, str) or not text:
      raise sources_lib.RowError(
          f"{where}: field 'prompt' must be a non-empty string, got {text!r:.80}"
      )
  else:
    raise sources_lib.RowError(
        f"{where}: a row needs a 'prompt' or 'messages' field, got keys"
        f" {sorted(row)}"
    )
  # Raises a RowError for text the tokenizer cannot spell.
  rows_lib.encode_pair(tokenizer, text, "", where=where)
  return text


class Prompts(NamedTuple):
  """The usable prompts of a file and what was skipped.

  Attributes:
    texts: Prompt strings, in file order.
    skipped: Bad rows skipped (`bad_rows="skip"`).
  """

  texts: list[str]
  skipped: int


def read_prompts(
    paths: str, tokenizer, *, file_format: str = "auto", bad_rows: str = "skip"
) -> Prompts:
  """The prompts of `paths` under the `bad_rows` policy.

  Raises:
    MissingFileError: `paths` names nothing.
    UsageError: An unreadable file; a bad row under `bad_rows="error"`
      (`file:line: ...`); no usable row at all.
  """
  try:
    source = sources_lib.open_source(paths, format=file_format)
  except OSError as e:
    raise errors.UsageError(
        f"cannot read prompts {paths}: {errors.one_line(e)}"
    ) from None
  texts, skipped = [], 0
  for index in range(len(source)):
    try:
      where, row = source[index]
      texts.append(prompt_of_row(row, where, tokenizer))
    except sources_lib.RowError as e:
      if bad_rows == "error":
        raise
      skipped += 1
      if skipped <= _MAX_REPORTED:
        print(f"skipping bad prompt row {errors.one_line(e)}", file=sys.stderr)
  if skipped:
    print(f"skipped {skipped} bad prompt rows of {paths} (--bad-rows skip)")
  if not texts:
    raise errors.UsageError(f"no usable prompt rows in {paths}")
  return Prompts(texts, skipped)


__all__ = ["Prompts", "prompt_of_row", "read_prompts"]
