"""Tunix `RolloutConfig` -> `DenoiseConfig`, and the engine's argument checks.

The block-diffusion fields (block size, mask id, threshold, alignment, steps
per block) are fixed when the engine is built; the sampling fields
(temperature, top-k, top-p, EOS) come from each call's Tunix
`RolloutConfig`, with Tunix's conventions: `top_k <= 0` and `top_p >= 1`
mean "no filter", and greedy decoding (temperature 0) drops both.
"""

from __future__ import annotations

import dataclasses
import numbers

from tunix.rl.rollout import base_rollout

from tunix_blockdiff import config as config_lib


def optional_positive_int(name: str, value) -> int | None:
  """None, or `value` as an int >= 1 (TypeError/ValueError naming `name`)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}")
  return int(value)


def check_cached_modes(use_cache: bool, **modes) -> None:
  """Each mode of the cached driver (`lockstep=`, ...) is a bool, and on
  only with `use_cache` (TypeError/ValueError naming the mode)."""
  for name, value in modes.items():
    if not isinstance(value, bool):
      raise TypeError(f"{name} must be a bool, got {value!r}")
    if value and not use_cache:
      raise ValueError(f"{name}=True is a mode of the cached driver; it"
                       " needs use_cache=True")


def default_mask_id(tokenizer) -> int | None:
  """`tokenizer.mask_id()` (or `mask_token_id`), None when it has neither."""
  for name in ("mask_id", "mask_token_id"):
    try:
      value = getattr(tokenizer, name)
    except AttributeError:
      continue
    value = value() if callable(value) else value
    if value is not None:
      return int(value)
  return None


def denoise_config_for(
    base_config: config_lib.DenoiseConfig,
    rollout_config: base_rollout.RolloutConfig | None,
) -> config_lib.DenoiseConfig:
  """The `DenoiseConfig` of a `generate` call under `rollout_config`.

  Args:
    base_config: The engine's block-diffusion fields (and default EOS/pad).
    rollout_config: Tunix's per-call sampling settings; None keeps
      `base_config`.

  Returns:
    `base_config` with temperature, top-k, top-p and EOS from
    `rollout_config`.

  Raises:
    ValueError: `rollout_config.eos_tokens` names more than one EOS.
  """
  if rollout_config is None:
    return base_config
  top_k = rollout_config.top_k
  if top_k is not None and top_k <= 0:  # Tunix: -1 means "all tokens".
    top_k = None
  top_p = rollout_config.top_p
  if top_p is not None and top_p >= 1.0:
    top_p = None
  eos = base_config.eos_token_id
  if rollout_config.eos_tokens:
    if len(rollout_config.eos_tokens) != 1:
      raise ValueError(
          "BlockDiffusionRollout supports one EOS token; got eos_tokens="
          f"{rollout_config.eos_tokens}"
      )
    eos = int(rollout_config.eos_tokens[0])
  temperature = float(rollout_config.temperature)
  return dataclasses.replace(
      base_config,
      temperature=temperature,
      top_k=top_k if temperature > 0 else None,
      top_p=top_p if temperature > 0 else None,
      eos_token_id=eos,
  )


__all__ = ["default_mask_id", "denoise_config_for", "optional_positive_int"]
