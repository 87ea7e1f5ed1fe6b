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
import functools
from typing import Any

from flax import nnx
import jax
from jax.interpreters import pxla
import jax.numpy as jnp
import numpy as np
import optax
from tunix.rl import trainer as rl_trainer

from tunix_blockdiff import compat
from tunix_blockdiff import trainer as sft_trainer


def _metric_value(value) -> Any:
  if isinstance(value, compat.WeightedMetric):
    return value.compute()
  return value


def _inverse(denominator: jax.Array) -> jax.Array:
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, 1.0 / safe, 0.0)


class BlockDiffusionRLTrainer(rl_trainer.Trainer):
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
    accumulation = training_config.get_with_default(
        "gradient_accumulation_steps", 1
    )
    if accumulation < 1:
      raise ValueError(
          f"gradient_accumulation_steps must be >= 1, got {accumulation}"
      )
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
    self.config = training_config
    self._accumulation = accumulation
    # The parent counted restored micro-steps without accumulation.
    self._iter_steps = self._train_steps * accumulation
    self.grad_sums = None
    if not self._tunix_accumulates and accumulation > 1:
      wrt = nnx.LoRAParam if self._lora_enabled else nnx.Param
      self.grad_sums = sft_trainer.GradientSums(self.model, wrt)

  def _objective(self, model, inputs):
    out = self.loss_fn(model, **inputs)
    if isinstance(out, compat.LossOutput):
      return out.primary_loss.unreduced_sum, out
    if self._has_aux:
      return out[0], out[1]
    return out, None

  def _exact_train_step(self, model, optimizer, grad_sums, inputs):
    """One micro-step: add the summed-loss gradient; update on the last.

    Returns:
      (micro-batch mean loss, aux or LossOutput, float32 norm of the applied
      gradient, 0 on micro-steps that only accumulate).
    """
    inputs = self.gen_model_input_fn(inputs)
    grad_fn = nnx.value_and_grad(
        self._objective,
        argnums=nnx.DiffState(0, nnx.LoRAParam) if self._lora_enabled else 0,
        has_aux=True,
    )
    (value, aux), grads = grad_fn(model, inputs)
    if isinstance(aux, compat.LossOutput):
      denominator = jnp.asarray(aux.primary_loss.denominator, jnp.float32)
      loss = aux.primary_loss.compute()
    else:
      denominator = jnp.ones((), jnp.float32)
      loss = value

    if grad_sums is None:
      scale = _inverse(denominator)
      grads_to_apply = jax.tree.map(
          lambda g: (g * scale).astype(g.dtype), grads
      )
      total = denominator
      is_update = jnp.ones((), jnp.bool_)
    else:
      grad_sums.add(grads, denominator)
      grads_to_apply = grad_sums.mean()
      total = grad_sums.denominator.value
      is_update = grad_sums.micro_steps.value >= self._accumulation

    def apply(model, optimizer, grads):
      optimizer.update(model, grads)
      return optax.global_norm(
          jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      )

    def skip(model, optimizer, grads):
      del model, optimizer, grads
      return jnp.zeros((), jnp.float32)

    # An optimizer step whose micro-batches hold nothing to learn from leaves
    # parameters and optimizer state untouched.
    grad_norm = nnx.cond(
        is_update & (total > 0), apply, skip, model, optimizer, grads_to_apply
    )
    if grad_sums is not None:
      grad_sums.reset_where(is_update)
    return loss, aux, grad_norm

  def _exact_eval_step(self, model, inputs):
    inputs = self.gen_model_input_fn(inputs)
    out = self.eval_loss_fn(model, **inputs)
    if isinstance(out, compat.LossOutput):
      return out.primary_loss.compute(), out
    if self._has_aux:
      return out[0], out[1]
    return out, None

  def create_train_step_fn(self):
    if self._tunix_accumulates:
      return super().create_train_step_fn()
    return self._exact_train_step

  def create_eval_step_fn(self):
    if self._tunix_accumulates:
      return super().create_eval_step_fn()
    return self._exact_eval_step

  def jit_train_and_eval_step(
      self, skip_jit: bool = False, cache_nnx_graph: bool = False
  ):
    """Jitted (train_step(batch), eval_step(batch)), built once and cached."""
    if self._tunix_accumulates:
      return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
    train_step = self.create_train_step_fn()
    eval_step = self.create_eval_step_fn()
    if skip_jit:
      return (
          functools.partial(
              train_step, self.model, self.optimizer, self.grad_sums
          ),
          functools.partial(eval_step, self.model),
      )
    if self._jitted_train_step_fn is None:
      self._shard_optimizer(pxla.thread_resources.env.physical_mesh)
      jitted_train = nnx.jit(
          train_step, donate_argnames=("optimizer", "grad_sums")
      )
      jitted_eval = nnx.jit(eval_step)

      def bind(f, *args):
        if cache_nnx_graph:
          return functools.partial(nnx.cached_partial(f, *args))
        return functools.partial(f, *args)

      self._jitted_train_step_fn = bind(
          jitted_train, self.model, self.optimizer, self.grad_sums
      )
      self._jitted_eval_step_fn = bind(jitted_eval, self.model)
    return self._jitted_train_step_fn, self._jitted_eval_step_fn

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

  def _post_process_train_step(self, aux: Any) -> None:
    self._record_rl_metrics(self._buffered_train_metrics, aux)

  def _post_process_eval_step(self, aux: Any) -> None:
    self._record_rl_metrics(self._buffered_eval_metrics, aux)


def _max(values) -> float:
  return float(np.max(np.asarray(values)))
