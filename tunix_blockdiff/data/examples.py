"""Prompt/completion examples: the data configuration and validation.

`as_examples` turns token-id pairs into validated `Example`s with stable ids;
`validate_example` checks one pair, so a streaming source can validate row by
row. `DataConfig` says how examples become batches (`batches.py`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np

from tunix_blockdiff.attention import context_parallel

PACKINGS = ("none", "block_aligned", "unaligned")


def _check_int(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How examples become batches.

  Attributes:
    seq_len: Row length L.
    batch_size: Rows per batch B.
    vocab_size: Every token id must lie in [0, vocab_size).
    seed: Seeds the per-epoch shuffle and the corruption.
    packing: `none` (one document per row), `block_aligned` (several
      documents per row, each starting at a multiple of the block size, so
      physical and logical blocks coincide), or `unaligned` (documents packed
      back to back; masks follow per-document logical positions).
    cp_size: Context-parallel shards; > 1 reorders every batch into the
      load-balanced order (1 or even, `seq_len % (2 * cp_size) == 0`).
    pad_token_id: Token id written at padding slots.
    shuffle: Shuffle the examples (differently in every epoch).
    num_epochs: Passes over the data; None repeats forever.
    completion_fill_id: If set (usually the EOS id), every completion is
      extended with this token up to the end of its last block (capped at
      `seq_len`), as supervised completion slots. At inference the block
      holding EOS has masked slots after it; without the fill, training never
      shows the model such a block (the slots after EOS were padding, not
      even visible), so it keeps writing content instead of ending.
  """

  seq_len: int
  batch_size: int
  vocab_size: int
  seed: int = 0
  packing: str = "none"
  cp_size: int = 1
  pad_token_id: int = 0
  shuffle: bool = True
  num_epochs: int | None = None
  completion_fill_id: int | None = None

  def __post_init__(self):
    _check_int("seq_len", self.seq_len, 1)
    _check_int("batch_size", self.batch_size, 1)
    _check_int("vocab_size", self.vocab_size, 1)
    _check_int("seed", self.seed, 0)
    if self.packing not in PACKINGS:
      raise ValueError(
          f"packing must be one of {PACKINGS}, got {self.packing!r}"
      )
    _check_int("cp_size", self.cp_size, 1)
    # Raises a clear error for an odd cp_size or an indivisible seq_len.
    context_parallel.load_balance_order(self.seq_len, self.cp_size)
    _check_int("pad_token_id", self.pad_token_id, 0)
    if self.pad_token_id >= self.vocab_size:
      raise ValueError(
          f"pad_token_id must be < vocab_size={self.vocab_size}, got"
          f" {self.pad_token_id}"
      )
    if self.num_epochs is not None:
      _check_int("num_epochs", self.num_epochs, 1)
    if self.completion_fill_id is not None:
      _check_int("completion_fill_id", self.completion_fill_id, 0)
      if self.completion_fill_id >= self.vocab_size:
        raise ValueError(
            f"completion_fill_id must be < vocab_size={self.vocab_size}, got"
            f" {self.completion_fill_id}"
        )


class Example(NamedTuple):
  """One validated prompt/completion pair.

  Attributes:
    prompt: int32 [P] prompt ids (may be empty).
    completion: int32 [C] completion ids, C >= 1.
    example_id: Stable identity; with (seed, epoch) it fixes the corruption.
  """

  prompt: np.ndarray
  completion: np.ndarray
  example_id: int


def _ids(name: str, value, where: str) -> np.ndarray:
  array = np.asarray(value)
  if array.size == 0:
    return np.zeros((0,), np.int32)
  if array.ndim != 1:
    raise ValueError(
        f"{where}: {name} must be a 1-D sequence of token ids, got"
        f" shape {array.shape}"
    )
  if array.dtype.kind not in "iu":  # (np.issubdtype costs more than a check)
    raise TypeError(
        f"{where}: {name} must hold integer token ids, got dtype {array.dtype}"
    )
  return array.astype(np.int64, copy=False)


def validate_example(
    prompt: Any,
    completion: Any,
    *,
    example_id: int,
    seq_len: int,
    vocab_size: int,
    mask_token_id: int | None = None,
    where: str | None = None,
) -> Example:
  """One prompt/completion pair of token ids, checked, as an `Example`.

  Args:
    prompt: int [P] prompt ids (may be empty).
    completion: int [C] completion ids (C >= 1).
    example_id: The example's stable id.
    seq_len: Row length; P + C must fit.
    vocab_size: Ids must lie in [0, vocab_size).
    mask_token_id: If given, the mask token may not appear in the data.
    where: Names the example in error messages (default `example <id>`;
      file sources pass `file:line`).

  Returns:
    The `Example` (int32 arrays).

  Raises:
    ValueError: Empty completion, longer than `seq_len`, an id outside the
      vocabulary, or the mask token.
    TypeError: Ids that are not integers.
  """
  where = f"example {example_id}" if where is None else where
  prompt = _ids("prompt", prompt, where)
  completion = _ids("completion", completion, where)
  if completion.size == 0:
    raise ValueError(
        f"{where}: completion is empty; every example needs at"
        " least one completion token to train on"
    )
  length = prompt.size + completion.size
  if length > seq_len:
    raise ValueError(
        f"{where} has {length} tokens (prompt {prompt.size} +"
        f" completion {completion.size}), longer than seq_len={seq_len}"
    )
  # One pass over both arrays (a dataset validates every example, and they
  # are short, so numpy's per-call cost dominates); which array and which
  # id is wrong is looked up only on failure.
  both = np.concatenate([prompt, completion])
  in_vocab = both.min() >= 0 and both.max() < vocab_size
  has_mask = mask_token_id is not None and (both == mask_token_id).any()
  if not in_vocab or has_mask:
    for name, ids in (("prompt", prompt), ("completion", completion)):
      bad = ids[(ids < 0) | (ids >= vocab_size)]
      if bad.size:
        raise ValueError(
            f"{where}: {name} token id {int(bad[0])} is outside the"
            f" vocabulary [0, {vocab_size})"
        )
      if mask_token_id is not None and (ids == mask_token_id).any():
        raise ValueError(
            f"{where}: {name} contains the mask token id"
            f" {mask_token_id}, which clean data must not use"
        )
  return Example(
      prompt.astype(np.int32), completion.astype(np.int32), example_id
  )


def as_examples(
    raw: Iterable[Any],
    *,
    seq_len: int,
    vocab_size: int,
    mask_token_id: int | None = None,
) -> list[Example]:
  """Validates prompt/completion pairs and gives each a stable id.

  Args:
    raw: Pairs `(prompt_ids, completion_ids)` or mappings with keys `prompt`
      and `completion`; ids are int sequences. The i-th item gets id i.
    seq_len: Row length; prompt + completion must fit.
    vocab_size: Ids must lie in [0, vocab_size).
    mask_token_id: If given, the mask token may not appear in the data (a
      clean slot holding it would read as a masked one).

  Returns:
    A list of `Example`.

  Raises:
    ValueError: An example is longer than `seq_len`, has an empty completion,
      or holds an id outside the vocabulary (or the mask token).
  """
  examples = []
  for index, item in enumerate(raw):
    # (A pair is never a Mapping; checked first, it skips the ABC check.)
    if not isinstance(item, (tuple, list)) and isinstance(item, Mapping):
      if "prompt" not in item or "completion" not in item:
        raise ValueError(
            f"example {index}: a mapping needs keys 'prompt' and 'completion'"
        )
      prompt, completion = item["prompt"], item["completion"]
    else:
      try:
        prompt, completion = item
      except (TypeError, ValueError):
        raise ValueError(
            f"example {index}: expected (prompt_ids, completion_ids), got"
            f" {type(item).__name__}"
        ) from None
    examples.append(
        validate_example(
            prompt,
            completion,
            example_id=index,
            seq_len=seq_len,
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
        )
    )
  return examples
