"""Rematerialisation of a Tunix model's layers while a loss is traced.

Every supported family (Qwen3, Qwen2, Llama3, Gemma3) reads its config's
`remat_config` (its module's `RematConfig`: `NONE`, `BLOCK` for the
attention block, `DECODER` for the whole decoder layer) when a forward is
traced, from one config object that all its layers share. `remat_scope`
sets it for the duration of a trace only, so that training recomputes
activations in the backward pass (less memory at long sequences) while the
same model decodes, scores and exports without it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

REMAT_POLICIES = ("none", "block", "decoder")


def check_policy(policy: str) -> str:
  """`policy` if it is one of `REMAT_POLICIES`, else a ValueError."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {policy!r}")
  return policy


def _remat_enum(model):
  config = getattr(model, "config", None)
  module = sys.modules.get(type(config).__module__)
  enum = getattr(module, "RematConfig", None)
  if enum is None or not hasattr(config, "remat_config"):
    raise ValueError(
        f"remat: {type(model).__name__} has no Tunix remat_config (the Qwen3,"
        " Qwen2, Llama3 and Gemma3 models have one); use remat 'none'")
  return config, enum


@contextlib.contextmanager
def remat_scope(model, policy: str) -> Iterator[None]:
  """Forwards of `model` traced inside rematerialise per `policy`.

  Args:
    model: A Tunix causal LM.
    policy: `none` (a no-op), `block` or `decoder`.

  Raises:
    ValueError: an unknown policy, or a model without `remat_config`.
  """
  if check_policy(policy) == "none":
    yield
    return
  config, enum = _remat_enum(model)
  saved = config.remat_config
  config.remat_config = enum[policy.upper()]
  try:
    yield
  finally:
    config.remat_config = saved
