"""Rewards of the `rl` and `opd` jobs.

The reward is exact match with the row's `answer` (the default) or a user
function named by the recipe's `reward` key, `package.module:function`, with
Tunix's reward signature `fn(prompts, completions, **kwargs) -> list[float]`.
As in Tunix, every column of the prompt rows besides the prompt (`answer`,
...) reaches it as a keyword argument holding one value per completion, as
does `mode` (`"train"` or `"eval"`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable, Sequence

from tunix_blockdiff import errors
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.runs import rl_data

RewardFn = Callable[..., Any]
REWARD_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def exact_match_reward(task: tasks_lib.Task | None = None) -> RewardFn:
  """Tunix reward fn: 1.0 where the completion is exactly the answer.

  With a task, its `check` decides; otherwise string equality with
  `str(answer)`.
  """

  def exact_match(prompts, completions, answer, **unused_kwargs):
    del unused_kwargs
    if task is not None:
      return [
          float(task.check(p, c, a))
          for p, c, a in zip(prompts, completions, answer)
      ]
    return [float(c == str(a)) for c, a in zip(completions, answer)]

  return exact_match


def load_reward_fn(spec: str, columns: Sequence[str] | None = None) -> RewardFn:
  """The user's reward function named `package.module:function`.

  The module is imported from `sys.path` (the current directory is tried
  too). With `columns`, the function must accept Tunix's call
  `fn(prompts=..., completions=..., mode=..., **columns)`.

  Args:
    spec: `package.module:function` (the attribute may be dotted).
    columns: Prompt-row columns passed as keyword arguments; None skips the
      signature check (the columns are not known yet).

  Raises:
    errors.UsageError (a ValueError): malformed spec, module not found,
      attribute missing, not callable, or cannot take Tunix's call.
  """
  if not isinstance(spec, str) or not REWARD_SPEC.match(spec):
    raise errors.UsageError(
        f"reward must look like 'package.module:function', got {spec!r}"
    )
  module_name, attr_path = spec.split(":")
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      raise errors.UsageError(
          f"reward {spec!r}: module {e.name!r} not found (looked on sys.path,"
          " PYTHONPATH and the current directory)"
      ) from None
    raise
  target = module
  for part in attr_path.split("."):
    if not hasattr(target, part):
      raise errors.UsageError(
          f"reward {spec!r}: {getattr(target, '__name__', target)!r} has no"
          f" attribute {part!r}"
      )
    target = getattr(target, part)
  if not callable(target):
    raise errors.UsageError(
        f"reward {spec!r} is a {type(target).__name__}, not a function"
    )
  if columns is None:
    return target
  try:
    signature = inspect.signature(target)
  except (TypeError, ValueError):  # Builtins without a signature.
    return target
  keywords = ["prompts", "completions", "mode", *columns]
  try:
    signature.bind(**{k: [] for k in keywords})
  except TypeError as e:
    raise errors.UsageError(
        f"reward {spec!r}{signature} cannot take Tunix's reward call with"
        f" keywords {keywords} ({e}); use fn(prompts, completions, **kwargs)"
    ) from None
  return target


def recipe_reward(cfg, prompts: rl_data.PromptSet) -> RewardFn:
  """The recipe's `reward` function, or exact match when it is null."""
  spec = cfg.get("reward")
  if spec:
    return load_reward_fn(str(spec), prompts.columns)
  if "answer" not in prompts.columns:
    raise errors.UsageError(
        "the default exact-match reward needs an answer column; set reward to"
        " package.module:function or add answers to the prompt rows"
    )
  return exact_match_reward(prompts.task)


__all__ = [
    "REWARD_SPEC",
    "exact_match_reward",
    "load_reward_fn",
    "recipe_reward",
]
