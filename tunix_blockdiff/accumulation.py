"""Exact, token-weighted gradient accumulation and metrics for Tunix trainers.

`optax.MultiSteps` (what google-tunix 0.1.7's PeftTrainer uses) averages
micro-batch *means*, so a micro-batch with 3 target tokens counts as much as
one with 300. `ExactAccumulation` accumulates the gradients of the *sums*
with their denominators and divides once per optimizer step: the gradient of
the exact token mean of the whole step's batch. `TokenWeightedTrainer` is a
`PeftTrainer` on any loss that returns a `LossOutput`, with those steps and
token-weighted train/eval metrics; the block-diffusion and DiffusionGemma
trainers are its subclasses. On Tunix main (which understands `LossOutput`)
Tunix's own train step is used.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import nnx
import jax
from jax.interpreters import pxla
import jax.numpy as jnp
import numpy as np
import optax
from tunix.sft import peft_trainer

from tunix_blockdiff import compat
from tunix_blockdiff import layouts

TrainingConfig = peft_trainer.TrainingConfig


class GradientSums(nnx.Module):
  """Running sums of gradients, their denominator and the micro-step count.

  Gradients are kept in float32 whatever the parameter dtype, so many
  micro-batches add up without bfloat16 rounding.
  """

  def __init__(self, model: nnx.Module, wrt: Any):
    params = nnx.state(model, wrt)
    leaves, self._treedef = jax.tree.flatten(params)
    self._dtypes = tuple(leaf.dtype for leaf in leaves)

    shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
    meshes = [s.mesh for s in shardings
              if isinstance(s, jax.sharding.NamedSharding)]
    # The counters live on the parameters' mesh (replicated), as the train
    # step returns them: otherwise its second call compiles again.
    scalar = (jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())
              if meshes else None)

    def zeros(shape, dtype, sharding):
      if isinstance(sharding, jax.sharding.NamedSharding):
        return jnp.zeros(shape, dtype, device=sharding)
      return jnp.zeros(shape, dtype)

    self.sums = nnx.List([nnx.Variable(zeros(leaf.shape, jnp.float32, s))
                          for leaf, s in zip(leaves, shardings)])
    self.denominator = nnx.Variable(zeros((), jnp.float32, scalar))
    self.micro_steps = nnx.Variable(zeros((), jnp.int32, scalar))

  def add(self, grads: Any, denominator: jax.Array) -> None:
    """Adds the gradients of one micro-batch's summed loss."""
    leaves = jax.tree.leaves(grads)
    if len(leaves) != len(self.sums):
      raise ValueError(
          f"grads have {len(leaves)} leaves, the accumulator {len(self.sums)}"
      )
    for total, grad in zip(self.sums, leaves):
      total.set_value(total.get_value() + grad.astype(jnp.float32))
    self.denominator.set_value(
        self.denominator.get_value() + jnp.asarray(denominator, jnp.float32)
    )
    self.micro_steps.set_value(self.micro_steps.get_value() + 1)

  def mean(self) -> Any:
    """Sum of gradients / sum of denominators (zeros when it is 0)."""
    scale = _reciprocal_or_zero(self.denominator.get_value())
    leaves = [
        (total.get_value() * scale).astype(dtype)
        for total, dtype in zip(self.sums, self._dtypes)
    ]
    return jax.tree.unflatten(self._treedef, leaves)

  def reset_where(self, done: jax.Array) -> None:
    """Zeroes everything where `done` (a bool scalar) holds."""
    for total in self.sums:
      total.set_value(jnp.where(done, 0.0, total.get_value()))
    self.denominator.set_value(
        jnp.where(done, 0.0, self.denominator.get_value())
    )
    self.micro_steps.set_value(jnp.where(done, 0, self.micro_steps.get_value()))


@dataclasses.dataclass(slots=True, kw_only=True)
class TokenWeightedMetricsBuffer(peft_trainer.MetricsBuffer):
  """A `MetricsBuffer` whose loss is sum of sums / sum of denominators.

  Attributes:
    weighted_losses: The `WeightedMetric` primary loss of each micro-batch
      (train) or batch (eval); when empty, the plain mean of `losses` is used.
  """

  weighted_losses: list[Any] = dataclasses.field(default_factory=list)

  @property
  def loss(self):
    if not self.weighted_losses:
      return peft_trainer.MetricsBuffer.loss.fget(self)
    return weighted_mean(self.weighted_losses)


def weighted_mean(metrics) -> float:
  """sum(unreduced_sum) / sum(denominator) over `WeightedMetric`s (0 if 0)."""
  total = sum(float(np.asarray(m.unreduced_sum)) for m in metrics)
  count = sum(float(np.asarray(m.denominator)) for m in metrics)
  return total / count if count else 0.0


def _grad_norm_of_update(values) -> float:
  # Micro-steps that only accumulate report 0; the update step reports the
  # norm of the applied gradient, which is therefore the maximum.
  return float(np.max(np.asarray(values)))


class ExactAccumulation:
  """Exact, denominator-aware train and eval steps for a `PeftTrainer`.

  Mixed in before a `PeftTrainer` (SFT) or Tunix's RL actor `Trainer`. The
  host class sets `_tunix_accumulates` (Tunix main handles `LossOutput`
  itself), `_accumulation` (micro-steps per optimizer step) and `grad_sums`
  (a `GradientSums`, or None without accumulation). Each micro-step adds the
  gradient of the summed loss and its denominator; the optimizer step applies
  sum of gradients / sum of denominators, skipping steps with no target.
  """

  @staticmethod
  def _accumulation_steps(training_config) -> int:
    """`gradient_accumulation_steps` of a Tunix training config (>= 1)."""
    accumulation = training_config.get_with_default(
        "gradient_accumulation_steps", 1
    )
    if accumulation < 1:
      raise ValueError(
          f"gradient_accumulation_steps must be >= 1, got {accumulation}"
      )
    return accumulation

  def _setup_accumulation(self, training_config, accumulation: int) -> None:
    """After the host trainer's `__init__`: the real config and accumulator."""
    self.config = training_config
    self._accumulation = accumulation
    # The parent counted restored micro-steps without accumulation.
    self._iter_steps = self._train_steps * accumulation
    self.grad_sums = None
    if not self._tunix_accumulates and accumulation > 1:
      wrt = nnx.LoRAParam if self._lora_enabled else nnx.Param
      self.grad_sums = GradientSums(self.model, wrt)

  def _objective(self, loss_fn, model, inputs):
    out = loss_fn(model, **inputs)
    if isinstance(out, compat.LossOutput):
      return out.primary_loss.unreduced_sum, out
    if self._has_aux:
      return out[0], out[1]
    return out, None

  def _exact_train_step(self, model, optimizer, grad_sums, inputs):
    """One micro-step: add the summed-loss gradient; update on the last.

    Returns:
      (micro-batch mean loss, aux or LossOutput, float32 gradient norm of the
      applied update, 0 on micro-steps that only accumulate).
    """
    inputs = self.gen_model_input_fn(inputs)
    grad_fn = nnx.value_and_grad(
        functools.partial(self._objective, self.loss_fn),
        argnums=nnx.DiffState(0, nnx.LoRAParam) if self._lora_enabled else 0,
        has_aux=True,
    )
    (value, aux), grads = grad_fn(model, inputs)
    if isinstance(aux, compat.LossOutput):
      denominator = jnp.asarray(aux.primary_loss.denominator, jnp.float32)
      loss = aux.primary_loss.compute()
    else:
      # A plain scalar loss is already a mean: weight each micro-batch 1.
      denominator = jnp.ones((), jnp.float32)
      loss = value

    if grad_sums is None:
      grads_to_apply = _scale(grads, denominator)
      total = denominator
      is_update = jnp.ones((), bool)
    else:
      grad_sums.add(grads, denominator)
      grads_to_apply = grad_sums.mean()
      total = grad_sums.denominator.get_value()
      is_update = grad_sums.micro_steps.get_value() >= self._accumulation

    def apply(model, optimizer, grads):
      optimizer.update(model, grads)
      return optax.global_norm(
          jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      )

    def skip(model, optimizer, grads):
      del model, optimizer, grads
      return jnp.zeros((), jnp.float32)

    # A step whose micro-batches hold no target at all leaves parameters and
    # optimizer state untouched (an Adam step on a zero gradient would still
    # move the parameters through its momentum).
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
          layouts.keeping_shardings(
              train_step, self.model, self.optimizer, self.grad_sums
          ),
          donate_argnames=("optimizer", "grad_sums"),
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

  # Token-weighted metrics (google-tunix <= 0.1.7).


class TokenWeightedTrainer(ExactAccumulation, peft_trainer.PeftTrainer):
  """A `PeftTrainer` on a `LossOutput` loss: exact accumulation and metrics.

  Subclasses set `loss_fn`, `eval_loss_fn` and `gen_model_input_fn`.

  Attributes:
    grad_sums: The exact accumulator (None on Tunix main, which has its own,
      or when there is no accumulation).
  """

  def __init__(
      self,
      model: nnx.Module,
      optimizer: optax.GradientTransformation,
      training_config: TrainingConfig,
      metrics_logger: peft_trainer.MetricsLogger | None = None,
      **kwargs,
  ):
    if not isinstance(training_config, TrainingConfig):
      raise TypeError(
          "training_config must be a tunix TrainingConfig, got"
          f" {type(training_config).__name__}"
      )
    accumulation = self._accumulation_steps(training_config)
    self._tunix_accumulates = compat.TUNIX_HAS_LOSS_OUTPUT
    base_config = training_config
    if not self._tunix_accumulates:
      # PeftTrainer 0.1.7 would wrap the optimizer in optax.MultiSteps (a
      # mean of micro-batch means); it gets no accumulation and we do it.
      base_config = dataclasses.replace(
          training_config, gradient_accumulation_steps=None
      )
    super().__init__(
        model, optimizer, base_config, metrics_logger=metrics_logger, **kwargs
    )
    self._setup_accumulation(training_config, accumulation)
    # The restored or fresh state, placed alike (one compile of each step),
    # on the mesh the trainer runs under when there is one.
    layouts.place_unsharded(self.model, self.optimizer, self.grad_sums)

  # The exact-accumulation train step (google-tunix <= 0.1.7).

  def _buffer_metrics(
      self, metrics_buffer, loss, step, additional_metrics=None
  ):
    if self._tunix_accumulates:
      return super()._buffer_metrics(
          metrics_buffer, loss, step, additional_metrics
      )
    if metrics_buffer is None:
      metrics_buffer = TokenWeightedMetricsBuffer(step=step, losses=[])
    additional = dict(additional_metrics or {})
    if "grad_norm" in additional:
      additional["grad_norm"] = (
          additional["grad_norm"][0],
          _grad_norm_of_update,
      )
    return super()._buffer_metrics(metrics_buffer, loss, step, additional)

  def _record(self, buffer, aux) -> None:
    if buffer is None or not isinstance(aux, compat.LossOutput):
      return
    buffer.weighted_losses.append(aux.primary_loss)
    for name, metric in aux.aux_metrics.items():
      op = (
          weighted_mean
          if isinstance(metric, compat.WeightedMetric)
          else np.mean
      )
      values, _ = buffer.additional_metrics.setdefault(name, ([], op))
      values.append(metric)

  def _post_process_train_step(self, aux: Any) -> None:
    if not self._tunix_accumulates:
      self._record(self._buffered_train_metrics, aux)

  def _post_process_eval_step(self, aux: Any) -> None:
    if not self._tunix_accumulates:
      self._record(self._buffered_eval_metrics, aux)

  @property
  def _tqdm_train_metrics(self) -> list[str]:
    return ["loss", "accuracy", "learning_rate"]




def _reciprocal_or_zero(denominator: jax.Array) -> jax.Array:
  """1 / denominator, and 0 (not inf, and no NaN gradient) where it is 0."""
  positive = denominator > 0
  return jnp.where(positive, 1.0 / jnp.where(positive, denominator, 1.0), 0.0)


def _scale(grads, denominator):
  scale = _reciprocal_or_zero(denominator)
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


__all__ = [
    "ExactAccumulation",
    "GradientSums",
    "TokenWeightedMetricsBuffer",
    "TokenWeightedTrainer",
    "TrainingConfig",
    "weighted_mean",
]
