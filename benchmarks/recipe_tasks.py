"""Held-out tasks for tuning the default recipe, written as jsonl files.

None of these is a task of `tunix_blockdiff.tasks`: they stand for a user's
own small task, trained through `dataset.train` exactly as the README says.
They use the character tokenizer's alphabet (lowercase letters, digits and
a few symbols) and fit the default recipe's 32-slot rows. Each answer is 5
to 11 characters, so that 3 tokens per model call is reachable at block 8
(an answer spans at most two blocks).

    python benchmarks/recipe_tasks.py OUT_DIR [--train 40000 --eval 256]

writes `OUT_DIR/<task>/{train,eval}.jsonl` for every task.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import string
from typing import Callable

import numpy as np

LETTERS = string.ascii_lowercase


def _word(rng: np.random.Generator, low: int, high: int) -> str:
  n = int(rng.integers(low, high + 1))
  return "".join(rng.choice(list(LETTERS), size=n))


def copy_word(rng):
  """`"copy kqzvbt>"` -> `"kqzvbt"`."""
  w = _word(rng, 5, 10)
  return f"copy {w}>", w


def sort_letters(rng):
  """`"srt kqzvbt>"` -> `"bkqtvz"`."""
  w = _word(rng, 5, 10)
  return f"srt {w}>", "".join(sorted(w))


def shift_letters(rng):
  """A character mapping, each letter to the next: `"nxt abz>"` -> `"bca"`."""
  w = _word(rng, 5, 10)
  return f"nxt {w}>", "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in w)


def swap_words(rng):
  """A word-level rewrite: `"swap ab cde>"` -> `"cde ab"`."""
  a, b = _word(rng, 2, 5), _word(rng, 2, 5)
  return f"swap {a} {b}>", f"{b} {a}"


def increment(rng):
  """Arithmetic with carries: `"inc 41999>"` -> `"42000"`."""
  n = int(rng.integers(5, 10))
  # More trailing nines than uniform digits give, so carries are common.
  digits = list(rng.integers(0, 10, size=n))
  digits[0] = int(rng.integers(1, 10))
  nines = int(rng.integers(0, 4))
  for i in range(1, min(nines, n - 1) + 1):
    digits[-i] = 9
  x = int("".join(str(d) for d in digits))
  return f"inc {x}>", str(x + 1)


TASKS: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    "copy": copy_word,
    "sort_letters": sort_letters,
    "shift": shift_letters,
    "swap_words": swap_words,
    "increment": increment,
}


def write_task(
    name: str, out: pathlib.Path, *, num_train: int, num_eval: int, seed: int
) -> tuple[pathlib.Path, pathlib.Path]:
  """Writes `out/name/{train,eval}.jsonl`; eval rows never occur in train."""
  make = TASKS[name]
  rng = np.random.default_rng([seed, sorted(TASKS).index(name)])
  eval_rows = {}
  while len(eval_rows) < num_eval:
    prompt, answer = make(rng)
    eval_rows[prompt] = answer
  train_rows = []
  while len(train_rows) < num_train:
    prompt, answer = make(rng)
    if prompt not in eval_rows:
      train_rows.append((prompt, answer))
  directory = out / name
  directory.mkdir(parents=True, exist_ok=True)
  paths = directory / "train.jsonl", directory / "eval.jsonl"
  for path, rows in zip(paths, (train_rows, list(eval_rows.items()))):
    with path.open("w") as f:
      for prompt, answer in rows:
        f.write(json.dumps({"prompt": prompt, "completion": answer}) + "\n")
  return paths


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out", type=pathlib.Path)
  parser.add_argument("--train", type=int, default=40_000)
  parser.add_argument("--eval", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tasks", default=",".join(TASKS))
  args = parser.parse_args(argv)
  for name in args.tasks.split(","):
    train, evals = write_task(
        name, args.out, num_train=args.train, num_eval=args.eval,
        seed=args.seed,
    )
    print(name, train, evals)


if __name__ == "__main__":
  main()
