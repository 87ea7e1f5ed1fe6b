"""`RolloutEngineMixin`: what the rollout engines share besides generation.

Shared by `BlockDiffusionRollout` and `DiffusionGemmaRollout` (each sets
`self._model` and `self._tokenizer` and calls `_init_engine(seed)`):

- The sampling noise, one key per call: call i of `generate` samples with
  `fold_in(base key, i)`, so the call counter is the RNG's whole state. The
  rl and opd jobs save `calls` with each checkpoint and set it back on
  resume, and a resumed run draws the noise an uninterrupted one would.
- `record_outputs`: `RLCluster.generate` merges micro-batch outputs into a
  plain `RolloutOutput`, dropping the trace; the clusters record the
  engine's own outputs here to keep it.
- The `BaseRollout` accessors (`update_params`, `pad_id`, `model`,
  `tokenizer`).
- `completions`: generated rows cut before their first EOS, and their text.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

from flax import nnx
import jax
import jaxtyping
import numpy as np
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from tunix_blockdiff.rollout import weights


def completions(
    tokens: np.ndarray, eos_id: int | None, tokenizer, *aligned: np.ndarray
) -> tuple[list[np.ndarray], list[str], list[list[np.ndarray]]]:
  """Each row of `tokens` [B, T] cut before its first EOS, and its text.

  Args:
    tokens: int [B, T] generated tokens.
    eos_id: The EOS id (None: no row is cut).
    tokenizer: Decodes a row's ids (`decode(list[int]) -> str`).
    *aligned: Arrays [B, T, ...] (log-probs, say) cut like `tokens`.

  Returns:
    (rows of `tokens` cut, their texts, per `aligned` array its rows cut).
  """
  out_tokens, texts, out_aligned = [], [], [[] for _ in aligned]
  for b, row in enumerate(np.asarray(tokens)):
    is_eos = row == eos_id
    end = int(np.argmax(is_eos)) if is_eos.any() else row.shape[0]
    out_tokens.append(row[:end])
    texts.append(tokenizer.decode(row[:end].tolist()))
    for out, array in zip(out_aligned, aligned):
      out.append(np.asarray(array[b])[:end])
  return out_tokens, texts, out_aligned


class RolloutEngineMixin:
  """Mixin of the rollout engines (see the module docstring)."""

  def _init_engine(self, seed: int) -> None:
    self._base_key = jax.random.key(seed)
    self._calls = 0
    self._recorders: list[list[Any]] = []

  # -- the RNG ----------------------------------------------------------------

  @property
  def calls(self) -> int:
    """`generate` calls so far: call i samples with `fold_in(seed key, i)`."""
    return self._calls

  @calls.setter
  def calls(self, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise TypeError(f"calls must be an int, got {type(value).__name__}")
    if value < 0:
      raise ValueError(f"calls must be >= 0, got {value}")
    self._calls = int(value)

  def _next_key(self, rollout_config: base_rollout.RolloutConfig) -> jax.Array:
    """The key of this call: `RolloutConfig.seed` (an int or a key) or the
    engine's seed, folded with the call count (then incremented)."""
    seed = rollout_config.seed
    if seed is None:
      base = self._base_key
    elif isinstance(seed, (int, np.integer)):
      base = jax.random.key(int(seed))
    else:
      base = seed
    key = jax.random.fold_in(base, self._calls)
    self._calls += 1
    return key

  # -- recording --------------------------------------------------------------

  def _record(self, output):
    """Appends a `generate` output to every open recorder; returns it."""
    for recorder in self._recorders:
      recorder.append(output)
    return output

  @contextlib.contextmanager
  def record_outputs(self) -> Iterator[list[Any]]:
    """Collects every `generate` output made inside the context."""
    records: list[Any] = []
    self._recorders.append(records)
    try:
      yield records
    finally:
      # By identity: nested recorders can hold equal lists.
      self._recorders[:] = [r for r in self._recorders if r is not records]

  # -- BaseRollout accessors --------------------------------------------------

  def update_params(
      self,
      params: jaxtyping.PyTree,
      filter_types: Optional[Tuple[Any, ...]] = None,
  ) -> None:
    """Loads new parameters into the rollout model (in place).

    Args:
      params: An `nnx.State` (or subset) of the actor's parameters.
      filter_types: The variable types `params` holds; when given, `params`
        is resharded onto the rollout model's shardings and cast to its
        dtypes first.
    """
    weights.update_params(self._model, params, filter_types)

  def pad_id(self) -> int:
    return int(self._tokenizer.pad_id())

  def model(self) -> nnx.Module:
    return self._model

  @property
  def tokenizer(self) -> tokenizer_adapter.TokenizerAdapter:
    return self._tokenizer


__all__ = ["RolloutEngineMixin"]
