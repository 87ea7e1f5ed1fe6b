"""Row forms -> token ids, and validated examples of a file source.

A row (a dict read by `sources`) takes one of three forms, recognised by its
fields (names overridable with `RowFields`):

  {"prompt", "completion"}  the completion follows the prompt;
  {"messages": [{"role", "content"}, ...]}  a chat, rendered with the
      tokenizer's own chat template: the prompt is every turn before the last
      assistant turn plus the generation prompt, the completion is that turn's
      content;
  {"text"}  a document for continuation: a seeded cut point (a pure function
      of (seed, row index)) splits its tokens into prompt and completion.

The prompt starts with BOS (pairs and text, when the tokenizer has one; a chat
template writes its own); the completion ends with EOS. A row that cannot be
used raises `RowError` whose message starts with `file:line`; `FileExamples`
applies the `bad_rows` policy (`skip`: counted and reported, `error`: raised).
"""

from __future__ import annotations

import array
import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from tunix_blockdiff import errors
from tunix_blockdiff.data import examples as examples_lib
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.data.sources import RowError

BAD_ROW_POLICIES = ("skip", "error")
_MAX_REPORTED = 3


@dataclasses.dataclass(frozen=True)
class RowFields:
  """The field names of each row form (recipe key `dataset.fields`)."""

  prompt: str = "prompt"
  completion: str = "completion"
  messages: str = "messages"
  text: str = "text"
  answer: str = "answer"


def render_chat(tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
  """`messages` through the tokenizer's chat template, generation prompt on."""
  render = getattr(tokenizer, "apply_chat_template", None)
  if render is None:
    raise errors.UsageError(
        "rows in the {'messages'} form need a tokenizer with a chat template"
        f" (tokenizer.kind: hf); {type(tokenizer).__name__} has none"
    )
  return render(messages, add_generation_prompt=True)


class EncodedRow(NamedTuple):
  """A row as token ids (before validation) and as text.

  Attributes:
    prompt: Prompt ids (with BOS or the rendered chat prefix).
    completion: Completion ids, ending with EOS.
    prompt_text: The prompt as text (a chat prompt: the rendered template).
    reference: The completion as text (without EOS).
  """

  prompt: list[int]
  completion: list[int]
  prompt_text: str
  reference: str


def _encode(tokenizer, text: str, where: str) -> list[int]:
  """Token ids of `text`; RowError if the tokenizer cannot spell it."""
  try:
    ids = list(tokenizer.encode(text))
  except (ValueError, KeyError, UnicodeError) as e:
    # E.g. a character outside the character tokenizer's alphabet.
    raise RowError(f"{where}: the tokenizer cannot encode it: {e}") from None
  unk = getattr(tokenizer, "unk_id", lambda: None)()
  if unk is not None and unk in ids:
    raise RowError(
        f"{where}: the tokenizer cannot encode some characters of"
        f" {text[:40]!r} (they map to the unknown token id {unk})"
    )
  return ids


def encode_pair(
    tokenizer, prompt: str, completion: str, *, where: str = "text"
) -> tuple[list[int], list[int]]:
  """(prompt ids, completion ids + EOS); BOS first when the tokenizer has one.

  Raises:
    RowError: The tokenizer cannot encode the text (`where` names it).
  """
  bos = tokenizer.bos_id()
  prompt_ids = ([bos] if bos is not None else []) + _encode(
      tokenizer, prompt, where
  )
  return prompt_ids, _encode(tokenizer, completion, where) + [
      tokenizer.eos_id()
  ]


def _string(row: Mapping[str, Any], field: str, where: str) -> str:
  value = row[field]
  if not isinstance(value, str):
    raise RowError(
        f"{where}: field {field!r} must be a string, got {type(value).__name__}"
    )
  return value


def _chat(row, fields: RowFields, tokenizer, where: str) -> EncodedRow:
  messages = row[fields.messages]
  if not isinstance(messages, Sequence) or isinstance(messages, str):
    raise RowError(
        f"{where}: field {fields.messages!r} must be a list of"
        f" {{'role', 'content'}} turns, got {type(messages).__name__}"
    )
  turns = []
  for i, turn in enumerate(messages):
    if (
        not isinstance(turn, Mapping)
        or not isinstance(turn.get("role"), str)
        or not isinstance(turn.get("content"), str)
    ):
      raise RowError(
          f"{where}: turn {i} of {fields.messages!r} must be"
          f" {{'role': str, 'content': str}}, got {turn!r:.80}"
      )
    turns.append({"role": turn["role"], "content": turn["content"]})
  last = max(
      (i for i, t in enumerate(turns) if t["role"] == "assistant"), default=None
  )
  if last is None:
    raise RowError(f"{where}: {fields.messages!r} has no assistant turn")
  prompt_text = render_chat(tokenizer, turns[:last])
  reference = turns[last]["content"]
  completion = _encode(tokenizer, reference, where) + [tokenizer.eos_id()]
  return EncodedRow(
      _encode(tokenizer, prompt_text, where), completion, prompt_text, reference
  )


def _text(row, fields: RowFields, tokenizer, where, *, seed, index):
  ids = _encode(tokenizer, _string(row, fields.text, where), where)
  if len(ids) < 2:
    raise RowError(
        f"{where}: field {fields.text!r} has {len(ids)} tokens; a"
        " continuation needs at least 2 to cut"
    )
  cut = int(np.random.default_rng([seed, index]).integers(1, len(ids)))
  bos = tokenizer.bos_id()
  return EncodedRow(
      ([bos] if bos is not None else []) + ids[:cut],
      ids[cut:] + [tokenizer.eos_id()],
      tokenizer.decode(ids[:cut]),
      tokenizer.decode(ids[cut:]),
  )


def row_form(row: Any, fields: RowFields, where: str) -> str:
  """Which form a row has: `chat`, `text` or `pair` (prompt/completion).

  Raises:
    RowError: not an object, or none of the forms' fields (naming the
      columns found and the ones wanted).
  """
  if not isinstance(row, Mapping):
    raise RowError(
        f"{where}: a row must be an object, got {type(row).__name__}"
    )
  if fields.messages in row:
    return "chat"
  if fields.text in row and fields.prompt not in row:
    return "text"
  missing = [f for f in (fields.prompt, fields.completion) if f not in row]
  if missing:
    raise RowError(
        f"{where}: missing field {missing[0]!r}; a row needs"
        f" {{{fields.prompt!r}, {fields.completion!r}}},"
        f" {{{fields.messages!r}}} or {{{fields.text!r}}}, got keys"
        f" {sorted(row)}"
    )
  return "pair"


def encode_row(
    row: Any,
    *,
    where: str,
    index: int,
    tokenizer,
    fields: RowFields = RowFields(),
    seed: int = 0,
) -> EncodedRow:
  """One row (any form) as token ids and text.

  Args:
    row: The row read from a file.
    where: Its `file:line`, for messages.
    index: Its index in the dataset (seeds the text cut point).
    tokenizer: `encode`, `decode`, `bos_id`, `eos_id` (and
      `apply_chat_template` for chats).
    fields: Field names.
    seed: Seeds the text cut point.

  Raises:
    RowError: The row is unusable (missing or mistyped field, empty
      completion, text the tokenizer cannot encode).
    ValueError: A chat row and a tokenizer without a chat template.
  """
  form = row_form(row, fields, where)
  if form == "chat":
    return _chat(row, fields, tokenizer, where)
  if form == "text":
    return _text(row, fields, tokenizer, where, seed=seed, index=index)
  prompt = _string(row, fields.prompt, where)
  completion = _string(row, fields.completion, where)
  if not completion:
    raise RowError(f"{where}: field {fields.completion!r} is empty")
  prompt_ids, completion_ids = encode_pair(
      tokenizer, prompt, completion, where=where
  )
  return EncodedRow(prompt_ids, completion_ids, prompt, completion)


class FileExamples:
  """Validated `Example`s of a file source, encoded when accessed.

  A constructor pass streams every row once and keeps only the indices of
  the usable ones (8 bytes per row), so a corpus larger than memory works;
  item i re-reads and re-encodes its row. Bad rows follow `bad_rows`:
  `error` raises `RowError` (file:line first), `skip` counts them (`num_bad`,
  `bad_examples`, `report()`).

  Attributes:
    num_rows: Rows read.
    num_bad: Rows skipped.
    bad_examples: The first few skip messages.
  """

  def __init__(
      self,
      source,
      *,
      tokenizer,
      seq_len: int,
      vocab_size: int,
      mask_token_id: int | None = None,
      fields: RowFields = RowFields(),
      seed: int = 0,
      bad_rows: str = "skip",
      limit: int | None = None,
  ):
    if bad_rows not in BAD_ROW_POLICIES:
      raise errors.UsageError(
          f"dataset.bad_rows must be one of {BAD_ROW_POLICIES}, got"
          f" {bad_rows!r}"
      )
    if limit is not None and limit < 1:
      raise ValueError(f"limit must be >= 1 or None, got {limit}")
    self.source = source
    self._encode_args = dict(tokenizer=tokenizer, fields=fields, seed=seed)
    self._check_args = dict(
        seq_len=seq_len, vocab_size=vocab_size, mask_token_id=mask_token_id
    )
    self.bad_rows = bad_rows
    self.num_rows, self.num_bad, self.bad_examples = 0, 0, []
    good = array.array("q")  # 8 bytes per usable row
    for index in range(len(source)):
      if limit is not None and len(good) == limit:
        break
      self.num_rows += 1
      try:
        self._read(index)
      except RowError as e:
        if bad_rows == "error":
          raise
        self.num_bad += 1
        if len(self.bad_examples) < _MAX_REPORTED:
          self.bad_examples.append(str(e))
        continue
      good.append(index)
    if not good:
      raise errors.UsageError(
          f"no usable rows in {self.num_rows} rows read from"
          f" {sources_lib.describe(source)}"
          + (f"; first problem: {self.bad_examples[0]}" if self.num_bad else "")
      )
    self._rows = np.frombuffer(good, np.int64)

  def _read(self, index: int) -> tuple[examples_lib.Example, EncodedRow]:
    where, row = self.source[index]
    encoded = encode_row(row, where=where, index=index, **self._encode_args)
    try:
      example = examples_lib.validate_example(
          encoded.prompt,
          encoded.completion,
          example_id=index,
          where=where,
          **self._check_args,
      )
    except (ValueError, TypeError) as e:
      raise RowError(str(e)) from None
    return example, encoded

  def __len__(self) -> int:
    return int(self._rows.size)

  def __getitem__(self, i: int) -> examples_lib.Example:
    return self._read(int(self._rows[i]))[0]

  def encoded(self, i: int) -> EncodedRow:
    """Item i's ids and text (prompt, reference completion)."""
    return self._read(int(self._rows[i]))[1]

  def report(self) -> dict[str, Any]:
    """`{"rows", "used", "skipped", "first_skipped"}` for `summary.json`."""
    return {
        "rows": self.num_rows,
        "used": len(self),
        "skipped": self.num_bad,
        "first_skipped": list(self.bad_examples),
    }


__all__ = [
    "row_form",
    "BAD_ROW_POLICIES",
    "EncodedRow",
    "FileExamples",
    "RowFields",
    "encode_pair",
    "encode_row",
    "render_chat",
]
