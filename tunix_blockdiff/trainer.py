"""BlockDiffusionTrainer: Tunix's PeftTrainer on the block-diffusion objective.

The trainer keeps everything a Tunix user knows (`TrainingConfig`, the train
loop, progress bar, metrics logger, Orbax checkpoints through Tunix's
checkpoint manager, LoRA through qwix, `with_*` setters) and changes what is
optimised: the block-diffusion loss of `objective.loss.diffusion_loss`, a
`LossOutput` whose primary metric is a (weighted sum, target count) pair.
Gradient accumulation and metrics are exact token-weighted means
(`accumulation.TokenWeightedTrainer`, whose names are re-exported here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from flax import nnx
import jax
import optax
from tunix.sft import peft_trainer

from tunix_blockdiff import accumulation
from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import flash
from tunix_blockdiff.models import head as head_lib
from tunix_blockdiff.models import remat as remat_lib
from tunix_blockdiff.objective import loss as loss_lib

TrainingConfig = peft_trainer.TrainingConfig
ExactAccumulation = accumulation.ExactAccumulation
GradientSums = accumulation.GradientSums
TokenWeightedMetricsBuffer = accumulation.TokenWeightedMetricsBuffer
weighted_mean = accumulation.weighted_mean

# Batch fields the block-diffusion loss reads (see `data.BATCH_FIELDS`).
MODEL_INPUT_FIELDS = (
    "inputs",
    "tokens",
    "targets",
    "positions",
    "segment_ids",
    "validity",
    "loss_weights",
)


def diffusion_model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
  """The default `gen_model_input_fn`: the loss's fields of a data batch.

  Args:
    batch: A batch from `tunix_blockdiff.data` (all fields [B, L]).

  Returns:
    Dict with the keys of `MODEL_INPUT_FIELDS`.
  """
  missing = [name for name in MODEL_INPUT_FIELDS if name not in batch]
  if missing:
    raise ValueError(
        f"batch is missing fields {missing}; build batches with"
        " tunix_blockdiff.data"
    )
  return {name: batch[name] for name in MODEL_INPUT_FIELDS}


def diffusion_logits(
    model,
    config: config_lib.BlockDiffusionConfig,
    *,
    inputs: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    validity: jax.Array,
    attention: config_lib.AttentionConfig | None = None,
) -> jax.Array:
  """Target-aligned training logits for the configured stream.

  `single` and `clean_prefix` run the corrupted canvas under the
  block-causal mask (`clean_prefix` differs only in its corruption); the
  two-stream objective runs `[tokens | inputs]` (length 2L). With Splash
  (`attention.uses_splash`), the same logits through the model's flash
  branch: the lazy block-causal mask where the batch allows it, else masks
  from positions; two-stream through a position-aware kernel. Splash needs
  the legacy `with mesh:` context.

  Args:
    model: A Tunix causal LM.
    config: The objective.
    inputs: int [B, L] corrupted canvas.
    tokens: int [B, L] clean tokens (read by `two_stream` only).
    positions: int [B, L] logical positions.
    segment_ids: int [B, L] document ids.
    validity: bool [B, L] real slots.
    attention: Dense (None) or `AttentionConfig`.

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of slot i.
  """
  return flash.chosen_logits(
      model,
      inputs,
      positions,
      attention=attention,
      clean_tokens=tokens if config.stream == "two_stream" else None,
      block_size=config.block_size,
      alignment=config.alignment,
      validity=validity,
      segment_ids=segment_ids,
  )


def make_diffusion_loss_fn(
    config: config_lib.BlockDiffusionConfig,
    attention: config_lib.AttentionConfig | None = None,
    remat: str = "none",
    head_chunk: int | None = None,
) -> Callable[..., compat.LossOutput]:
  """`loss_fn(model, **diffusion_model_inputs(batch)) -> LossOutput`.

  The primary loss is `WeightedMetric(sum_i w_i CE_i, #targets)` over the
  batch (`objective.loss.diffusion_loss`), plus the certainty term when
  `config.certainty_weight > 0`; aux metrics are the target accuracy and
  the target count (and `certainty` when that term is on). `attention`
  picks the logits' attention (`diffusion_logits`; None: dense); `remat`
  (`none`, `block`, `decoder`) rematerialises the model's layers in the
  backward pass (`models.remat`); `head_chunk` (tokens, None: off) runs
  the output head and the loss that many tokens at a time, so the batch's
  logits never exist at once (`objective.loss.chunked_diffusion_loss`).
  """
  if not isinstance(config, config_lib.BlockDiffusionConfig):
    raise TypeError(
        f"config must be a BlockDiffusionConfig, got {type(config).__name__}"
    )
  if attention is not None and not isinstance(
      attention, config_lib.AttentionConfig):
    raise TypeError(
        "attention must be an AttentionConfig or None, got"
        f" {type(attention).__name__}")
  remat_lib.check_policy(remat)
  head_chunk = loss_lib.check_head_chunk(head_chunk)

  def diffusion_loss_fn(
      model,
      inputs,
      tokens,
      targets,
      positions,
      segment_ids,
      validity,
      loss_weights,
  ) -> compat.LossOutput:
    certainty = dict(certainty_weight=config.certainty_weight,
                     certainty_temperature=config.certainty_temperature)
    with remat_lib.remat_scope(model, remat):
      # With `head_chunk` the model runs headless: hidden states, not logits.
      view = None if head_chunk is None else head_lib.headless(model)
      out = diffusion_logits(
          model if view is None else view.model,
          config,
          inputs=inputs,
          tokens=tokens,
          positions=positions,
          segment_ids=segment_ids,
          validity=validity,
          attention=attention,
      )
    if view is None:
      return loss_lib.diffusion_loss(out, targets, loss_weights, **certainty)
    return loss_lib.chunked_diffusion_loss(
        out, head_lib.output_head(model), targets, loss_weights,
        chunk=head_chunk, hidden_dtype=view.dtype, **certainty)

  return diffusion_loss_fn


class BlockDiffusionTrainer(accumulation.TokenWeightedTrainer):
  """A Tunix `PeftTrainer` that trains the block-diffusion objective.

  Feed it batches from `tunix_blockdiff.data` (`SFTBatches`,
  `eval_batches`). With a qwix-LoRA model only the LoRA parameters are
  trained, as in `PeftTrainer`. Checkpoints hold the model (or LoRA)
  parameters and the optimizer state; a restarted trainer resumes from the
  latest one and skips the batches already consumed, and because the data
  pipeline is a pure function of its seed (order and corruption), the resumed
  run reproduces the uninterrupted one.

  Attributes:
    diffusion_config: The objective.
    grad_sums: The exact accumulator (None on Tunix main, which has its own,
      or when there is no accumulation).
  """

  def __init__(
      self,
      model: nnx.Module,
      optimizer: optax.GradientTransformation,
      training_config: TrainingConfig,
      diffusion_config: config_lib.BlockDiffusionConfig,
      metrics_logger: peft_trainer.MetricsLogger | None = None,
      attention: config_lib.AttentionConfig | None = None,
      remat: str = "none",
      head_chunk: int | None = None,
      **kwargs,
  ):
    """Builds the trainer and restores the latest checkpoint, if any.

    Args:
      model: A Tunix causal LM (`model(tokens, positions, cache, mask)`),
        optionally with qwix LoRA applied.
      optimizer: An optax transformation (not `MultiSteps`: accumulation is
        configured by `training_config.gradient_accumulation_steps`).
      training_config: Tunix's `TrainingConfig`.
      diffusion_config: The objective's `BlockDiffusionConfig`.
      metrics_logger: Optional Tunix `MetricsLogger`.
      attention: The training logits' attention (None: dense masks);
        Splash needs a Tunix Qwen2/Qwen3 model and the `with mesh:` context
        when the step is traced.
      remat: `none`, `block` or `decoder`: the layers' rematerialisation
        while the loss is traced (`models.remat`).
      head_chunk: None, or the output head and loss run this many tokens
        at a time (the logits of a whole batch never held at once; Tunix
        Qwen2, Qwen3, Llama3 and Gemma3 models).
      **kwargs: Passed to `PeftTrainer` (e.g. perf tracers).
    """
    if not isinstance(diffusion_config, config_lib.BlockDiffusionConfig):
      raise TypeError(
          "diffusion_config must be a BlockDiffusionConfig, got"
          f" {type(diffusion_config).__name__}"
      )
    remat_lib.check_policy(remat)
    head_chunk = loss_lib.check_head_chunk(head_chunk)
    if head_chunk is not None:
      head_lib.check_splittable(model)
    super().__init__(
        model, optimizer, training_config, metrics_logger=metrics_logger,
        **kwargs
    )
    self.diffusion_config = diffusion_config
    self.attention = attention
    self.remat = remat
    self.head_chunk = head_chunk
    self.loss_fn = make_diffusion_loss_fn(diffusion_config, attention, remat,
                                          head_chunk)
    self.eval_loss_fn = self.loss_fn
    self.gen_model_input_fn = diffusion_model_inputs

  # Setters, in the style of PeftTrainer's `with_loss_fn`.

  def with_diffusion_config(
      self, diffusion_config: config_lib.BlockDiffusionConfig
  ) -> "BlockDiffusionTrainer":
    """Trains a different objective (stream, alignment, weighting...)."""
    self.clear_jit_cache()
    self.diffusion_config = diffusion_config
    self.loss_fn = make_diffusion_loss_fn(diffusion_config, self.attention,
                                          self.remat, self.head_chunk)
    self.eval_loss_fn = self.loss_fn
    self._has_aux = False
    return self

  def with_eval_loss_fn(self, eval_loss_fn: Callable[..., Any]):
    """Evaluates with a different loss (same inputs as the train loss)."""
    self.clear_jit_cache()
    self.eval_loss_fn = eval_loss_fn
    return self

  def custom_checkpoint_metadata(self) -> dict[str, Any]:
    return {"diffusion_config": dataclasses.asdict(self.diffusion_config)}


__all__ = [
    "BlockDiffusionTrainer",
    "GradientSums",
    "MODEL_INPUT_FIELDS",
    "TokenWeightedMetricsBuffer",
    "TrainingConfig",
    "diffusion_logits",
    "diffusion_model_inputs",
    "make_diffusion_loss_fn",
    "weighted_mean",
]
