"""Tunix types used by the plugin, with field-identical fallbacks.

Tunix main defines `LossOutput` and `WeightedMetric` (tunix.sft.utils) and the
diffusion contracts `DiffusionTokenBatch` / `DiffusionLogitsFn`
(tunix.diffusion). google-tunix 0.1.7 has none of them. We import Tunix's when
it has them, so a Tunix trainer that understands `LossOutput` sees its own
type, and define identical fallbacks otherwise.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import flax
import jax
import jax.numpy as jnp

try:  # Tunix main.
  from tunix.sft.utils import LossOutput  # type: ignore[attr-defined]
  from tunix.sft.utils import WeightedMetric  # type: ignore[attr-defined]

  TUNIX_HAS_LOSS_OUTPUT = True
except ImportError:  # google-tunix <= 0.1.7.
  TUNIX_HAS_LOSS_OUTPUT = False

  @flax.struct.dataclass
  class WeightedMetric:
    """A metric reduced as `unreduced_sum / denominator` (Tunix fallback).

    Attributes:
      unreduced_sum: float32 scalar, the sum of the metric values.
      denominator: float32 scalar, the total weight (e.g. target tokens).
      eps: Optional epsilon added to the denominator.
      min_denom: Optional lower bound on the denominator.
    """

    unreduced_sum: jax.Array
    denominator: jax.Array
    eps: float | None = flax.struct.field(default=None, pytree_node=False)
    min_denom: float | None = flax.struct.field(default=None, pytree_node=False)

    def compute_scale(self) -> jax.Array:
      """1 / denominator, or 0 where the denominator is 0 (no NaNs)."""
      denom = self.denominator
      if self.eps is not None:
        denom = denom + self.eps
      if self.min_denom is not None:
        denom = jnp.maximum(denom, self.min_denom)
      safe = jnp.where(denom == 0, 1.0, denom)
      return jnp.where(denom == 0, 0.0, 1.0 / safe)

    def compute(self) -> jax.Array:
      """The weighted mean `unreduced_sum / denominator` (0 if empty)."""
      return self.unreduced_sum * self.compute_scale()

  @flax.struct.dataclass
  class LossOutput:
    """Unreduced primary loss plus auxiliary metrics (Tunix fallback).

    Attributes:
      primary_loss: The `WeightedMetric` to optimise.
      aux_metrics: Named auxiliary metrics.
    """

    primary_loss: WeightedMetric
    aux_metrics: Mapping[str, Any]


try:  # Tunix main.
  from tunix.diffusion.interfaces import DiffusionLogitsFn  # type: ignore
  from tunix.diffusion.types import DiffusionTokenBatch  # type: ignore

  TUNIX_HAS_DIFFUSION = True
except ImportError:
  TUNIX_HAS_DIFFUSION = False

  @flax.struct.dataclass(frozen=True)
  class DiffusionTokenBatch:
    """Target-aligned batch for diffusion training (Tunix fallback).

    Attributes:
      model_inputs: Batch-major pytree consumed by a `DiffusionLogitsFn`.
      target_ids: int [batch, length] target token ids.
      loss_weights: float/bool [batch, length] per-target weights.
    """

    model_inputs: Any
    target_ids: Any
    loss_weights: Any

    @classmethod
    def create(cls, *, model_inputs, target_ids, loss_weights):
      return cls(
          model_inputs=model_inputs,
          target_ids=target_ids,
          loss_weights=loss_weights,
      ).validate()

    def validate(self) -> "DiffusionTokenBatch":
      """Checks shapes and dtypes (static metadata only, jit-safe)."""
      shape = tuple(self.target_ids.shape)
      if len(shape) != 2:
        raise ValueError(
            f"target_ids must have shape [batch, length]; received {shape}"
        )
      if not jnp.issubdtype(self.target_ids.dtype, jnp.integer):
        raise TypeError(
            "target_ids must have an integer dtype; received"
            f" {self.target_ids.dtype}"
        )
      if tuple(self.loss_weights.shape) != shape:
        raise ValueError(
            "loss_weights must match target_ids shape; received"
            f" {tuple(self.loss_weights.shape)} and {shape}"
        )
      leaves = jax.tree.leaves(self.model_inputs)
      if not leaves:
        raise ValueError("model_inputs must contain at least one array")
      for index, leaf in enumerate(leaves):
        if not leaf.shape or leaf.shape[0] != shape[0]:
          raise ValueError(
              f"model_inputs leaf {index} must be batch-major with batch size"
              f" {shape[0]}"
          )
      return self

  class DiffusionLogitsFn(Protocol):
    """`(model, model_inputs) -> target-aligned logits [B, L, V]`."""

    def __call__(self, model: Any, model_inputs: Any, /) -> jax.Array:
      ...


__all__ = [
    "DiffusionLogitsFn",
    "DiffusionTokenBatch",
    "LossOutput",
    "TUNIX_HAS_DIFFUSION",
    "TUNIX_HAS_LOSS_OUTPUT",
    "WeightedMetric",
]
