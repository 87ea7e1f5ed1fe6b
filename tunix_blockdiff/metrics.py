"""Quality metrics for generated text or token ids.

`edit_similarity` is the normalized Levenshtein similarity used to compare a
generation with its reference (1.0 identical, 0.0 nothing in common);
`first_line` cuts a text at its first line break (code completions are often
judged on their first line).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np


def levenshtein(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
  """Edit distance (insertions, deletions, substitutions, each cost 1).

  Args:
    a: A sequence (a string, or a list of token ids).
    b: Another sequence; items are compared with `==`.

  Returns:
    The minimum number of single-item edits turning `a` into `b`.
  """
  if len(a) < len(b):
    a, b = b, a
  if not b:
    return len(a)
  # Items are mapped to small ints so each row update is vectorized.
  codes: dict = {}
  a_ids = np.asarray([codes.setdefault(x, len(codes)) for x in a], np.int64)
  b_ids = np.asarray([codes.setdefault(x, len(codes)) for x in b], np.int64)
  previous = np.arange(len(b) + 1, dtype=np.int64)
  for i, item in enumerate(a_ids, start=1):
    # Substitution/deletion costs are vectorized; the insertion chain
    # (current[j - 1] + 1) is a running minimum of (cost - j) plus j.
    cost = np.empty_like(previous)
    cost[0] = i
    cost[1:] = np.minimum(previous[:-1] + (b_ids != item), previous[1:] + 1)
    offsets = np.arange(len(b) + 1, dtype=np.int64)
    previous = np.minimum.accumulate(cost - offsets) + offsets
  return int(previous[-1])


def edit_similarity(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
  """1 - levenshtein(a, b) / max(len(a), len(b)); 1.0 when both are empty.

  Args:
    a: A sequence (a string, or a list of token ids).
    b: Another sequence of the same kind.

  Returns:
    A float in [0, 1], symmetric in its arguments, 1.0 iff `a == b`.
  """
  longest = max(len(a), len(b))
  if longest == 0:
    return 1.0
  return 1.0 - levenshtein(a, b) / longest


def first_line(text: str) -> str:
  """The text up to (not including) its first line break."""
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  return text.split("\n", 1)[0].rstrip("\r")


__all__ = ["edit_similarity", "first_line", "levenshtein"]
