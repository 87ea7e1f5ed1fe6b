"""The actor trainer of block-diffusion RL: exact, denominator-aware steps.

Tunix's RL actor trainer (`tunix.rl.trainer.Trainer`, a `PeftTrainer`) in
google-tunix 0.1.7 accumulates gradients with `optax.MultiSteps`: the mean of
micro-batch means, so a micro-batch with 3 completion tokens weighs as much
as one with 300. The block-diffusion policy losses (`bd_grpo`, `bd_opd`)
return a `LossOutput` (a summed loss and its denominator, e.g. token count);
this trainer accumulates the gradients of the sums with their denominators
and divides once per optimizer step, as `BlockDiffusionTrainer` does for SFT.
The result is the gradient of the exact mean over the whole mini-batch.

RL metrics (`kl`, `pg_clipfrac`, ...) are read from `LossOutput.aux_metrics`.
"""

from __future__ import annotations

import copy
from typing import Any

from flax import nnx
from jax.interpreters import pxla
import numpy as np
import optax
from tunix.rl import trainer as rl_trainer

from tunix_blockdiff import compat
from tunix_blockdiff import distributed
from tunix_blockdiff import trainer as sft_trainer


def _metric_value(value) -> Any:
  if isinstance(value, compat.WeightedMetric):
    return value.compute()
  return value


class BlockDiffusionRLTrainer(sft_trainer.ExactAccumulation, rl_trainer.Trainer):
  """`tunix.rl.trainer.Trainer` with exact gradient accumulation.

  Drop-in for the actor trainer `RLCluster` builds (same constructor); with
  a loss returning `LossOutput` every optimizer step applies
  `sum(grad of summed loss) / sum(denominator)` over its micro-batches. A loss
  returning `(loss, aux)` is weighted 1 per micro-batch (Tunix's behaviour).
  """

  def __init__(
      self,
      model: nnx.Module,
      optimizer: optax.GradientTransformation,
      training_config,
      custom_checkpoint_metadata_fn,
      **kwargs,
  ):
    accumulation = self._accumulation_steps(training_config)
    self._tunix_accumulates = compat.TUNIX_HAS_LOSS_OUTPUT
    base_config = training_config
    if not self._tunix_accumulates:
      # PeftTrainer 0.1.7 would wrap the optimizer in optax.MultiSteps; it
      # gets no accumulation and this class accumulates exactly. A copy, not
      # dataclasses.replace: RLTrainingConfig re-derives the accumulation
      # steps from the batch sizes in __post_init__.
      base_config = copy.copy(training_config)
      base_config.gradient_accumulation_steps = None
    super().__init__(
        model, optimizer, base_config, custom_checkpoint_metadata_fn, **kwargs
    )
    self._setup_accumulation(training_config, accumulation)

  def _prepare_inputs(self, input_data: Any) -> Any:
    """Global arrays of a training example every process holds whole.

    Rollouts and scores are gathered on every process (see
    `distributed.call_sharded`), so each process holds the whole example;
    Tunix's `shard_input` would take each process's copy as its own rows
    and duplicate the batch under several processes. The rows are placed
    over the data axis here instead (the same placement on one process).
    """
    input_data = super()._prepare_inputs(input_data)
    mesh = pxla.thread_resources.env.physical_mesh
    axes = tuple(self.config.data_sharding_axis)
    if mesh.empty or len(axes) != 1 or not isinstance(axes[0], str):
      return input_data
    return distributed.globalize(input_data, mesh, axes[0])

  def _buffer_metrics(
      self, metrics_buffer, loss, step, additional_metrics=None
  ):
    if self._tunix_accumulates:
      return super()._buffer_metrics(
          metrics_buffer, loss, step, additional_metrics
      )
    # The step's loss is reported as sum of sums / sum of denominators, and
    # its gradient norm as that of the applied update (accumulating
    # micro-steps report 0), like BlockDiffusionTrainer.
    if metrics_buffer is None:
      metrics_buffer = sft_trainer.TokenWeightedMetricsBuffer(
          step=step, losses=[]
      )
    additional = dict(additional_metrics or {})
    if "grad_norm" in additional:
      additional["grad_norm"] = (additional["grad_norm"][0], _max)
    return super()._buffer_metrics(metrics_buffer, loss, step, additional)

  def _record_rl_metrics(self, buffer, aux) -> None:
    if buffer is None:
      return
    if isinstance(aux, compat.LossOutput):
      if isinstance(buffer, sft_trainer.TokenWeightedMetricsBuffer):
        buffer.weighted_losses.append(aux.primary_loss)
      metrics = aux.aux_metrics
    else:
      metrics = aux
    for name, op in self.rl_metrics_to_log.items():
      values, _ = buffer.additional_metrics.setdefault(name, ([], op))
      values.append(np.asarray(_metric_value(metrics[name])))

  def metric_history(self, name: str) -> list[float]:
    """Per-optimizer-step training values of an RL metric so far.

    Tunix writes an optimizer step's metrics one step late (to overlap I/O);
    the step it holds back is included here, so the list has one value per
    completed optimizer step (the value Tunix logs for it).
    """
    logger = self.metrics_logger
    history = []
    if logger.metric_exists(self.metrics_prefix, name, "train"):
      history = np.asarray(
          logger.get_metric_history(self.metrics_prefix, name, "train")
      ).tolist()
    pending = getattr(self, "_prev_buffered_train_metrics", None)
    if pending is not None and name in pending.additional_metrics:
      values, op = pending.additional_metrics[name]
      history.append(float(op([np.asarray(v, np.float32) for v in values])))
    return [float(v) for v in history]

  def _post_process_train_step(self, aux: Any) -> None:
    self._record_rl_metrics(self._buffered_train_metrics, aux)

  def _post_process_eval_step(self, aux: Any) -> None:
    self._record_rl_metrics(self._buffered_eval_metrics, aux)


def _max(values) -> float:
  return float(np.max(np.asarray(values)))
