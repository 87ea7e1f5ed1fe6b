"""One `generate` case of `benchmarks/generation.py`, for the tools.

The arguments that name a case (model, batch, prompt width, new tokens,
schedule and the loop's modes) and the model, prompts and `DenoiseConfig`
built from them, shared by `time_generation_at.py` and `stage_hlo.py`.
Uses only `generation.py`'s `build_model`, `prompts` and `SCHEDULES`,
which old trees have too: `time_generation_at.py` runs against them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """A built case: the model and `generate`'s inputs.

  Attributes:
    model: the Tunix model (bfloat16; float32 for `tiny`).
    vocab: its vocabulary size; the mask token is `vocab - 1`.
    tokens: int32[batch, prompt_width] left-padded prompts.
    lengths: int32[batch] the prompts' lengths.
    config: the schedule's `DenoiseConfig`.
  """

  model: Any
  vocab: int
  tokens: np.ndarray
  lengths: np.ndarray
  config: Any


def add_arguments(parser: argparse.ArgumentParser,
                  cache_phases: int = 1) -> None:
  """Adds the case's options to `parser`; `--cache-phases` defaults as given."""
  parser.add_argument("--model", default="qwen3_0p6b",
                      help="qwen3_0p6b (Tunix's config) or tiny")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--prompt-width", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--schedule", default="b16s4",
                      help="a key of generation.py's SCHEDULES")
  parser.add_argument("--cache-phases", type=int, default=cache_phases)
  parser.add_argument("--lockstep", action="store_true")
  parser.add_argument("--fused-head", action="store_true")


def check_schedule(generation, schedule: str) -> None:
  """Raises ValueError unless `schedule` is a key of `generation.SCHEDULES`."""
  if schedule not in generation.SCHEDULES:
    raise ValueError(f"--schedule: one of {sorted(generation.SCHEDULES)}, "
                     f"got {schedule!r}")


def denoise_config(generation, schedule: str, vocab: int):
  """`generation.SCHEDULES[schedule]`'s `DenoiseConfig` (mask `vocab - 1`)."""
  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff import config as config_lib

  check_schedule(generation, schedule)
  return config_lib.DenoiseConfig(mask_token_id=vocab - 1,
                                  **generation.SCHEDULES[schedule])


def build(args: argparse.Namespace, generation) -> Case:
  """The case `args` names, from the `generation` benchmark module given."""
  check_schedule(generation, args.schedule)
  model, model_config = generation.build_model(
      args.model, "float32" if args.model == "tiny" else "bfloat16")
  vocab = model_config.vocab_size
  tokens, lengths = generation.prompts(args.batch, args.prompt_width, vocab,
                                       seed=args.batch)
  return Case(model, vocab, tokens, lengths,
              denoise_config(generation, args.schedule, vocab))
