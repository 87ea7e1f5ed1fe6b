"""Prompt tokenisation for rollouts: left-padded ids and the prompt mask.

What the rollout engine (`rl/engine.py`) and the trajectory scorer need
from a batch of text prompts, apart from the engine itself: the
left-padded int32 ids [B, P] (BOS first when the tokenizer has one, as
Tunix's sampler encodes), each row's length, and the bool prompt mask of
left-padded ids.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenizedPrompts:
  """Left-padded prompt ids.

  Attributes:
    tokens: int32 [B, P] ids, left-padded with the tokenizer's pad id.
    lengths: int32 [B] real tokens per row (BOS included).
    truncated: How many prompts were longer than P and keep their last P
      tokens.
    longest: The longest prompt in tokens before truncation (0 for none).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  truncated: int
  longest: int


def tokenize_prompts(
    tokenizer, prompts: Sequence[str], max_prompt_length: int
) -> TokenizedPrompts:
  """Encodes `prompts` as left-padded ids of width `max_prompt_length`.

  Args:
    tokenizer: Has `encode(text) -> ids`, `bos_id()` (None: no BOS) and
      `pad_id()`, as a Tunix `TokenizerAdapter` does.
    prompts: B prompt strings.
    max_prompt_length: P, the width; longer prompts keep their last P tokens
      (counted in `truncated`).

  Returns:
    `TokenizedPrompts` with tokens int32 [B, P] and lengths int32 [B].
  """
  if max_prompt_length < 1:
    raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
  bos = tokenizer.bos_id()
  pad = tokenizer.pad_id()
  rows, truncated, longest = [], 0, 0
  for text in prompts:
    ids = list(tokenizer.encode(text))
    if bos is not None and (not ids or ids[0] != bos):
      ids = [bos] + ids
    longest = max(longest, len(ids))
    if len(ids) > max_prompt_length:
      truncated += 1
      ids = ids[-max_prompt_length:]
    rows.append(ids)
  tokens = np.full((len(rows), max_prompt_length), pad, np.int32)
  lengths = np.zeros((len(rows),), np.int32)
  for b, ids in enumerate(rows):
    if ids:
      tokens[b, max_prompt_length - len(ids) :] = ids
    lengths[b] = len(ids)
  return TokenizedPrompts(tokens, lengths, truncated, longest)


def prompt_mask_from_tokens(prompt_tokens, pad_id: int) -> np.ndarray:
  """bool [B, P]: slots from each row's first non-pad token on (left pad)."""
  tokens = np.asarray(prompt_tokens)
  return np.cumsum(tokens != pad_id, axis=1) > 0


__all__ = ["TokenizedPrompts", "prompt_mask_from_tokens", "tokenize_prompts"]
