"""Tunix's diffusion extension points, implemented for this package.

Tunix main defines the model-agnostic diffusion contracts
(`tunix.diffusion`): a `DiffusionBatchAdapter` turns a pipeline's batch into a
`DiffusionTokenBatch`, a `DiffusionLogitsFn` scores its `model_inputs` with
target-aligned logits, and `compute_diffusion_logits` checks both. Tunix
pull request #1891 proposes the SFT layer on top, `diffusion_loss_fn` and
`configure_diffusion_sft`, which wire the two callables into a stock
`PeftTrainer` through `with_gen_model_input_fn` and `with_loss_fn`.

This module provides:

  * `BlockDiffusionBatchAdapter`: batches of `tunix_blockdiff.data`
    (`SFTBatches`, `eval_batches`) -> `DiffusionTokenBatch`.
  * `BlockDiffusionLogitsFn`: block-causal single-stream or two-stream
    (BD3-LM) logits of a Tunix causal LM, aligned to the targets.
  * `diffusion_loss_fn` and `configure_diffusion_sft`, with #1891's names,
    argument order and meaning, usable on a stock `PeftTrainer`.

The types come from `compat`: Tunix's own on Tunix main, fallbacks with the
same fields and checks on google-tunix 0.1.7.

Relation to `BlockDiffusionTrainer`: the loss is the same (with uniform
weights, or with `denominator="targets"`), and with one micro-batch per
optimizer step a `PeftTrainer` configured here takes exactly the steps of a
`BlockDiffusionTrainer` on the same batches. With gradient accumulation, Tunix
main's `PeftTrainer` sums gradients and denominators itself (exact token
mean); google-tunix 0.1.7's averages micro-batch means (`optax.MultiSteps`),
and `BlockDiffusionTrainer` is what adds exact accumulation there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

import jax.numpy as jnp

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.objective import loss as loss_lib

# `DiffusionTokenBatch.model_inputs` keys: what `BlockDiffusionLogitsFn` reads.
MODEL_INPUT_KEYS = ("inputs", "tokens", "positions", "segment_ids", "validity")
# Loss normalisations: #1891's weight sum, or the target count (ours, MaxText).
DENOMINATORS = ("loss_weights", "targets")

TrainerT = TypeVar("TrainerT")


def _missing(mapping: Mapping[str, Any], keys, what: str) -> None:
  missing = [key for key in keys if key not in mapping]
  if missing:
    raise ValueError(
        f"{what} is missing fields {missing}; build batches with"
        " tunix_blockdiff.data (SFTBatches, eval_batches)"
    )


@dataclasses.dataclass(frozen=True)
class BlockDiffusionBatchAdapter:
  """A `DiffusionBatchAdapter` for batches of `tunix_blockdiff.data`.

  Stateless, so one instance serves training and evaluation; it runs inside
  the trainer's jitted step (checks use static shapes only) or eagerly (then
  `DiffusionTokenBatch.validate` also checks the values).
  """

  def __call__(self, batch: Mapping[str, Any], /) -> compat.DiffusionTokenBatch:
    """Prepares one batch.

    Args:
      batch: A batch dict whose fields (see `data.BATCH_FIELDS`) are all
        [B, L]; read are `inputs`, `tokens`, `positions`, `segment_ids`,
        `validity` (int/bool), `targets` (int) and `loss_weights` (float).

    Returns:
      `DiffusionTokenBatch` with `model_inputs` = the `MODEL_INPUT_KEYS`
      fields, `target_ids` = `targets` and `loss_weights` = `loss_weights`,
      all [B, L].

    Raises:
      TypeError: `batch` is not a mapping.
      ValueError: a field is missing or not [B, L] like `targets`.
    """
    if not isinstance(batch, Mapping):
      raise TypeError(
          "batch must be a mapping of [B, L] arrays, got"
          f" {type(batch).__name__}"
      )
    _missing(batch, MODEL_INPUT_KEYS + ("targets", "loss_weights"), "batch")
    shape = tuple(jnp.shape(batch["targets"]))
    if len(shape) != 2:
      raise ValueError(f"batch['targets'] must have shape [B, L], got {shape}")
    for name in MODEL_INPUT_KEYS + ("loss_weights",):
      if tuple(jnp.shape(batch[name])) != shape:
        raise ValueError(
            f"batch[{name!r}] must have the [B, L] shape of batch['targets']"
            f" {shape}, got {tuple(jnp.shape(batch[name]))}"
        )
    return compat.DiffusionTokenBatch.create(
        model_inputs={name: batch[name] for name in MODEL_INPUT_KEYS},
        target_ids=batch["targets"],
        loss_weights=batch["loss_weights"],
    )


@dataclasses.dataclass(frozen=True)
class BlockDiffusionLogitsFn:
  """A `DiffusionLogitsFn`: target-aligned logits of a Tunix causal LM.

  The configured stream decides the forward pass: `single` and
  `clean_prefix` run the corrupted canvas under the block-causal mask,
  `two_stream` runs `[tokens | inputs]` under the two-stream mask; the
  configured alignment then maps logits to target slots (exactly
  `trainer.diffusion_logits`, as `BlockDiffusionTrainer` computes them).

  Attributes:
    config: The objective (`block_size`, `stream`, `alignment` are read).
  """

  config: config_lib.BlockDiffusionConfig

  def __post_init__(self):
    if not isinstance(self.config, config_lib.BlockDiffusionConfig):
      raise TypeError(
          "config must be a BlockDiffusionConfig, got"
          f" {type(self.config).__name__}"
      )

  def __call__(self, model: Any, model_inputs: Mapping[str, Any], /):
    """float32 [B, L, V] logits; `out[:, i]` predicts target slot i.

    Args:
      model: A Tunix causal LM (`model(tokens, positions, cache, mask)`).
      model_inputs: The `model_inputs` of a `BlockDiffusionBatchAdapter`
        batch: `MODEL_INPUT_KEYS` -> [B, L] arrays.
    """
    if not isinstance(model_inputs, Mapping):
      raise TypeError(
          "model_inputs must be a mapping with keys"
          f" {MODEL_INPUT_KEYS}, got {type(model_inputs).__name__}"
      )
    _missing(model_inputs, MODEL_INPUT_KEYS, "model_inputs")
    return trainer_lib.diffusion_logits(
        model, self.config, **{k: model_inputs[k] for k in MODEL_INPUT_KEYS}
    )


def diffusion_loss_fn(
    model: Any,
    batch: compat.DiffusionTokenBatch,
    logits_fn: compat.DiffusionLogitsFn,
    *,
    denominator: str = "loss_weights",
) -> compat.LossOutput:
  """Weighted float32 cross-entropy of target-aligned diffusion logits.

  The logits come from `compat.compute_diffusion_logits` (batch and logits
  checked); no autoregressive shift is applied. Logits and targets at
  zero-weight slots are replaced before the cross-entropy, so whatever they
  hold (NaN, inf, an out-of-range id) reaches neither loss nor gradient.

  Args:
    model: The model `logits_fn` scores.
    batch: `DiffusionTokenBatch` with int [B, L] `target_ids` and [B, L]
      nonnegative `loss_weights`.
    logits_fn: `(model, batch.model_inputs) -> float [B, L, V]`.
    denominator: `loss_weights` (Tunix #1891: the weight sum, so the loss is
      the weighted mean) or `targets` (the number of slots with a positive
      weight, as `BlockDiffusionTrainer` and MaxText normalise). The two agree
      for 0/1 weights; under `loss_weighting="elbo"` (weights 1/t) only
      `targets` keeps the ELBO scale of `BlockDiffusionTrainer`.

  Returns:
    `LossOutput` whose `primary_loss` is `WeightedMetric(sum_i w_i CE_i,
    denominator)` (float32 scalars), with aux metrics `accuracy` (a
    `WeightedMetric` over targets) and `target_tokens`.
  """
  if denominator not in DENOMINATORS:
    raise ValueError(
        f"denominator must be one of {DENOMINATORS}, got {denominator!r}"
    )
  logits = compat.compute_diffusion_logits(model, batch, logits_fn)
  weights = jnp.asarray(batch.loss_weights).astype(jnp.float32)
  active = weights > 0
  logits = jnp.where(active[..., None], logits.astype(jnp.float32), 0.0)
  targets = jnp.where(active, jnp.asarray(batch.target_ids), 0)
  out = loss_lib.diffusion_loss(logits, targets, weights)
  if denominator == "targets":
    return out
  return compat.LossOutput(
      primary_loss=compat.WeightedMetric(
          unreduced_sum=out.primary_loss.unreduced_sum,
          denominator=jnp.sum(weights),
      ),
      aux_metrics=out.aux_metrics,
  )


def _understands_loss_output(trainer: Any) -> bool:
  """Whether `trainer`'s steps reduce a `LossOutput` themselves."""
  return compat.TUNIX_HAS_LOSS_OUTPUT or isinstance(
      trainer, trainer_lib.ExactAccumulation
  )


def configure_diffusion_sft(
    trainer: TrainerT,
    batch_adapter: compat.DiffusionBatchAdapter,
    logits_fn: compat.DiffusionLogitsFn,
    *,
    denominator: str = "loss_weights",
) -> TrainerT:
  """Sets up a Tunix `PeftTrainer` for diffusion SFT; returns the trainer.

  The trainer's model input becomes `{"batch": batch_adapter(raw_batch)}` and
  its (train and eval) loss `diffusion_loss_fn(model, batch, logits_fn)`.
  Where the trainer reduces `LossOutput` itself (Tunix main, or a
  `BlockDiffusionTrainer`), the loss is returned as a `LossOutput`;
  google-tunix 0.1.7's `PeftTrainer` gets `(weighted mean, LossOutput)` with
  `has_aux=True`.

  Example (this package's data on a stock trainer):

    trainer = configure_diffusion_sft(
        peft_trainer.PeftTrainer(model, optax.adamw(1e-4), training_config),
        BlockDiffusionBatchAdapter(),
        BlockDiffusionLogitsFn(diffusion_config),
    )
    trainer.train(data.SFTBatches(examples, diffusion_config, data_config))

  Args:
    trainer: A `PeftTrainer` (or anything with its `with_loss_fn` and
      `with_gen_model_input_fn`).
    batch_adapter: `raw_batch -> DiffusionTokenBatch`.
    logits_fn: `(model, model_inputs) -> target-aligned logits [B, L, V]`.
    denominator: See `diffusion_loss_fn`.

  Returns:
    `trainer`, configured.

  Raises:
    TypeError: `trainer` lacks the setters, or a callable is not callable.
    ValueError: unknown `denominator`.
  """
  for name in ("with_loss_fn", "with_gen_model_input_fn"):
    if not callable(getattr(trainer, name, None)):
      raise TypeError(
          f"trainer must be a Tunix PeftTrainer (with {name}), got"
          f" {type(trainer).__name__}"
      )
  for name, value in (
      ("batch_adapter", batch_adapter),
      ("logits_fn", logits_fn),
  ):
    if not callable(value):
      raise TypeError(f"{name} must be callable, got {type(value).__name__}")
  if denominator not in DENOMINATORS:
    raise ValueError(
        f"denominator must be one of {DENOMINATORS}, got {denominator!r}"
    )

  def gen_model_input_fn(raw_batch: Any) -> dict[str, Any]:
    return {"batch": batch_adapter(raw_batch)}

  def loss_fn(model, batch: compat.DiffusionTokenBatch) -> compat.LossOutput:
    return diffusion_loss_fn(model, batch, logits_fn, denominator=denominator)

  def mean_and_output(model, batch):
    out = loss_fn(model, batch)
    return out.primary_loss.compute(), out

  trainer.with_gen_model_input_fn(gen_model_input_fn)
  if _understands_loss_output(trainer):
    trainer.with_loss_fn(loss_fn, has_aux=False)
  else:
    trainer.with_loss_fn(mean_and_output, has_aux=True)
  return trainer


__all__ = [
    "BlockDiffusionBatchAdapter",
    "BlockDiffusionLogitsFn",
    "DENOMINATORS",
    "MODEL_INPUT_KEYS",
    "configure_diffusion_sft",
    "diffusion_loss_fn",
]
