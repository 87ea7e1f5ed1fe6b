"""Tunix types used by the plugin, with field-identical fallbacks.

Tunix main defines `LossOutput` and `WeightedMetric` (tunix.sft.utils) and the
diffusion contracts `DiffusionTokenBatch`, `DiffusionLogitsFn`,
`DiffusionBatchAdapter`, `compute_diffusion_logits` and
`validate_diffusion_logits` (tunix.diffusion). google-tunix 0.1.7 has none of
them. We import Tunix's when
it has them, so a Tunix trainer that understands `LossOutput` sees its own
type, and define fallbacks with the same fields, checks and meaning otherwise.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, TypeVar

import flax
import jax
import jax.numpy as jnp
import numpy as np

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
  from tunix.diffusion.interfaces import compute_diffusion_logits  # type: ignore
  from tunix.diffusion.interfaces import DiffusionBatchAdapter  # type: ignore
  from tunix.diffusion.interfaces import DiffusionLogitsFn  # type: ignore
  from tunix.diffusion.types import DiffusionTokenBatch  # type: ignore
  from tunix.diffusion.types import validate_diffusion_logits  # type: ignore

  TUNIX_HAS_DIFFUSION = True
except ImportError:
  TUNIX_HAS_DIFFUSION = False

  _ARRAY_TYPES = (jax.Array, jax.ShapeDtypeStruct, jax.core.Tracer, np.ndarray)

  def _static(name: str, value: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of an array-like, or a TypeError naming `name`."""
    if not isinstance(value, _ARRAY_TYPES):
      raise TypeError(
          f"{name} must be a JAX/NumPy array or ShapeDtypeStruct, got"
          f" {type(value).__name__}"
      )
    return tuple(value.shape), value.dtype

  def _is_real_or_bool(dtype: Any) -> bool:
    return any(
        jnp.issubdtype(dtype, kind)
        for kind in (jnp.bool_, jnp.integer, jnp.floating)
    )

  def _host_value(value: Any) -> np.ndarray | None:
    """The value on the host, or None while tracing (no host transfer)."""
    if isinstance(value, (jax.ShapeDtypeStruct, jax.core.Tracer)):
      return None
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
      return None
    return np.asarray(value)

  @flax.struct.dataclass(frozen=True)
  class DiffusionTokenBatch:
    """Target-aligned batch for diffusion training (Tunix fallback).

    Attributes:
      model_inputs: Batch-major pytree consumed by a `DiffusionLogitsFn`.
      target_ids: int [batch, length] target token ids.
      loss_weights: float/int/bool [batch, length] per-target weights, >= 0.
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
      """Checks shapes and dtypes (and values, when not tracing)."""
      shape, dtype = _static("target_ids", self.target_ids)
      if len(shape) != 2:
        raise ValueError(
            f"target_ids must have shape [batch, length]; received {shape}"
        )
      if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"target_ids must have an integer dtype; received {dtype}"
        )
      weight_shape, weight_dtype = _static("loss_weights", self.loss_weights)
      if weight_shape != shape:
        raise ValueError(
            "loss_weights must match target_ids shape; received"
            f" {weight_shape} and {shape}"
        )
      if not _is_real_or_bool(weight_dtype):
        raise TypeError(
            "loss_weights must have a real numeric or boolean dtype; received"
            f" {weight_dtype}"
        )
      weights = _host_value(self.loss_weights)
      if weights is not None:
        if not np.all(np.isfinite(weights)):
          raise ValueError("loss_weights must contain only finite values")
        if np.any(weights < 0):
          raise ValueError("loss_weights must be nonnegative")
        targets = _host_value(self.target_ids)
        if targets is not None and np.any(targets[weights > 0] < 0):
          raise ValueError("active target_ids must be nonnegative")
      leaves = jax.tree.leaves(self.model_inputs)
      if not leaves:
        raise ValueError("model_inputs must contain at least one array")
      for index, leaf in enumerate(leaves):
        leaf_shape, leaf_dtype = _static(f"model_inputs leaf {index}", leaf)
        if not leaf_shape or leaf_shape[0] != shape[0]:
          raise ValueError(
              f"model_inputs leaf {index} must be batch-major with batch size"
              f" {shape[0]}; received shape {leaf_shape}"
          )
        if not _is_real_or_bool(leaf_dtype):
          raise TypeError(
              f"model_inputs leaf {index} must have a real numeric or boolean"
              f" dtype; received {leaf_dtype}"
          )
      return self

  class DiffusionLogitsFn(Protocol):
    """`(model, model_inputs) -> target-aligned logits [B, L, V]`."""

    def __call__(self, model: Any, model_inputs: Any, /) -> jax.Array:
      ...

  _RawBatchT = TypeVar("_RawBatchT", contravariant=True)

  class DiffusionBatchAdapter(Protocol[_RawBatchT]):
    """`(raw_batch) -> DiffusionTokenBatch`: a pipeline's batch, prepared."""

    def __call__(self, batch: _RawBatchT, /) -> DiffusionTokenBatch:
      ...

  def validate_diffusion_logits(batch: DiffusionTokenBatch, logits: Any) -> Any:
    """Returns `logits` after checking they align with `batch.target_ids`.

    Static checks (jit-safe): float [B, L, V] with V >= 1 and [B, L] equal to
    the targets' shape; when values are on the host, active target ids < V.

    Raises:
      TypeError: `logits` is not an array or not floating point.
      ValueError: wrong rank, misaligned, empty vocabulary or a target id
        outside it.
    """
    shape, dtype = _static("logits", logits)
    if len(shape) != 3:
      raise ValueError(
          f"logits must have shape [batch, length, vocab]; received {shape}"
      )
    target_shape = tuple(batch.target_ids.shape)
    if shape[:2] != target_shape:
      raise ValueError(
          "logits must align with target_ids on [batch, length]; received"
          f" {shape[:2]} and {target_shape}"
      )
    if shape[2] < 1:
      raise ValueError("logits must have a non-empty vocabulary dimension")
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"logits must have a floating-point dtype; received {dtype}"
      )
    targets = _host_value(batch.target_ids)
    weights = _host_value(batch.loss_weights)
    if targets is not None and weights is not None:
      if np.any(targets[weights > 0] >= shape[2]):
        raise ValueError(
            f"active target_ids must be smaller than vocabulary size {shape[2]}"
        )
    return logits

  def compute_diffusion_logits(
      model: Any, batch: DiffusionTokenBatch, logits_fn: DiffusionLogitsFn
  ) -> Any:
    """`logits_fn(model, batch.model_inputs)`, with batch and logits checked.

    Args:
      model: The model (an `nnx.Module`).
      batch: The prepared batch; validated first.
      logits_fn: Returns float [B, L, V] logits aligned with the targets.

    Returns:
      The logits, unchanged, after `validate_diffusion_logits`.
    """
    batch.validate()
    logits = logits_fn(model, batch.model_inputs)
    return validate_diffusion_logits(batch, logits)


__all__ = [
    "DiffusionBatchAdapter",
    "DiffusionLogitsFn",
    "DiffusionTokenBatch",
    "LossOutput",
    "TUNIX_HAS_DIFFUSION",
    "TUNIX_HAS_LOSS_OUTPUT",
    "WeightedMetric",
    "compute_diffusion_logits",
    "validate_diffusion_logits",
]
