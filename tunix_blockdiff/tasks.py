"""Synthetic tasks with exactly checkable answers, and a character tokenizer.

The CPU recipes, tests and notebooks train on data generated here: no
downloads. Each task turns a seeded generator into (prompt, answer) strings
and checks a completion exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=:>|,. "
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")


class CharTokenizer:
  """A character-level tokenizer over a fixed alphabet, defined in code.

  Ids 0-3 are `<pad>`, `<bos>`, `<eos>`, `<mask>`; characters follow. The
  method names match what Tunix's samplers and `TokenizerAdapter` call
  (`encode`, `decode`, `bos_id`, `eos_id`, `pad_id`).
  """

  def __init__(self, alphabet: str = ALPHABET, vocab_size: int | None = None):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError("alphabet must not repeat characters")
    self.alphabet = alphabet
    self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
    needed = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size is None:
      vocab_size = needed
    if vocab_size < needed:
      raise ValueError(f"vocab_size must be >= {needed}, got {vocab_size}")
    self.vocab_size = vocab_size

  def pad_id(self) -> int:
    return 0

  def bos_id(self) -> int:
    return 1

  def eos_id(self) -> int:
    return 2

  def mask_id(self) -> int:
    return 3

  def encode(self, text: str, **unused_kwargs) -> list[int]:
    """Character ids of `text` (no BOS/EOS added)."""
    try:
      return [self._char_to_id[c] for c in text]
    except KeyError as e:
      raise ValueError(
          f"text contains {e.args[0]!r}, which is not in the alphabet"
      ) from None

  def decode(self, ids: Sequence[int], **unused_kwargs) -> str:
    """Text of `ids`, stopping at EOS and skipping other special ids."""
    chars = []
    offset = len(SPECIAL_TOKENS)
    for i in ids:
      i = int(i)
      if i == self.eos_id():
        break
      if offset <= i < offset + len(self.alphabet):
        chars.append(self.alphabet[i - offset])
    return "".join(chars)


@dataclasses.dataclass(frozen=True)
class Task:
  """A synthetic task: `make(rng) -> (prompt, answer)` strings.

  Attributes:
    name: Registry name.
    make: Draws one (prompt, answer) pair from a NumPy generator.
    max_prompt_chars: Longest prompt the task produces.
    max_answer_chars: Longest answer the task produces (without EOS).
  """

  name: str
  make: Callable[[np.random.Generator], tuple[str, str]]
  max_prompt_chars: int
  max_answer_chars: int

  def sample(self, num: int, seed: int) -> list[tuple[str, str]]:
    """`num` (prompt, answer) pairs, a pure function of `seed`."""
    rng = np.random.default_rng(seed)
    return [self.make(rng) for _ in range(num)]

  def check(self, prompt: str, completion: str, answer: str) -> bool:
    """Exact match of the completion (text before EOS) with the answer."""
    del prompt
    return completion == answer


def _digits(rng: np.random.Generator, low: int, high: int) -> str:
  n = int(rng.integers(low, high + 1))
  return "".join(map(str, rng.integers(0, 10, size=n).tolist()))


def reverse_task(min_digits: int = 6, max_digits: int = 10) -> Task:
  """Reverse a digit string: `"rev 12345>"` -> `"54321"`."""

  def make(rng):
    s = _digits(rng, min_digits, max_digits)
    return f"rev {s}>", s[::-1]

  return Task("reverse", make, max_digits + 5, max_digits)


def sort_task(min_digits: int = 6, max_digits: int = 10) -> Task:
  """Sort digits ascending: `"sort 3141>"` -> `"1134"`."""

  def make(rng):
    s = _digits(rng, min_digits, max_digits)
    return f"sort {s}>", "".join(sorted(s))

  return Task("sort", make, max_digits + 6, max_digits)


def add_task(min_digits: int = 3, max_digits: int = 4) -> Task:
  """Add two integers: `"123+45="` -> `"168"`."""

  def make(rng):
    a = int(_digits(rng, min_digits, max_digits))
    b = int(_digits(rng, min_digits, max_digits))
    return f"{a}+{b}=", str(a + b)

  return Task("add", make, 2 * max_digits + 2, max_digits + 1)


TASKS: dict[str, Callable[..., Task]] = {
    "reverse": reverse_task,
    "sort": sort_task,
    "add": add_task,
}


def get_task(name: str, **kwargs) -> Task:
  """A task by registry name (`reverse`, `sort`, `add`)."""
  if name not in TASKS:
    raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
  return TASKS[name](**kwargs)


def encode_example(
    tokenizer: CharTokenizer, prompt: str, answer: str
) -> tuple[list[int], list[int]]:
  """(prompt ids with BOS, answer ids with EOS)."""
  return (
      [tokenizer.bos_id()] + tokenizer.encode(prompt),
      tokenizer.encode(answer) + [tokenizer.eos_id()],
  )
