"""`DiffusionGemmaTrainer`: a Tunix `PeftTrainer` on DiffusionGemma's objective."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import optax
from tunix.sft import peft_trainer

from tunix_blockdiff import accumulation
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.kinds.diffusion_gemma import objective as dg_objective


class DiffusionGemmaTrainer(accumulation.TokenWeightedTrainer):
  """A Tunix `PeftTrainer` on DiffusionGemma's objective.

  Feed it `kinds.diffusion_gemma.data.DiffusionGemmaBatches` (or
  `eval_batches`). Everything else is `BlockDiffusionTrainer`'s: exact
  token-weighted accumulation and metrics, Orbax checkpoints and resume,
  qwix LoRA (only LoRA parameters train).

  Attributes:
    objective: The `DiffusionGemmaObjective`.
  """

  def __init__(
      self,
      model: nnx.Module,
      optimizer: optax.GradientTransformation,
      training_config: trainer_lib.TrainingConfig,
      objective: dg_objective.DiffusionGemmaObjective,
      metrics_logger: peft_trainer.MetricsLogger | None = None,
      *,
      splash_tile: int | None = None,
      splash_interpret: bool | None = None,
      **kwargs,
  ):
    """Builds the trainer and restores the latest checkpoint, if any.

    Args:
      model: A `models.diffusion_gemma.DiffusionGemma` (optionally LoRA).
      optimizer: An optax transformation.
      training_config: Tunix's `TrainingConfig`.
      objective: The corruption and self-conditioning settings.
      metrics_logger: Optional Tunix `MetricsLogger`.
      splash_tile: Train with the Splash kernel at this tile (it divides
        the rows' length; one device); None: dense attention.
      splash_interpret: Pallas interpret mode; None: off TPU.
      **kwargs: Passed to `PeftTrainer`.
    """
    if not isinstance(objective, dg_objective.DiffusionGemmaObjective):
      raise TypeError(
          "objective must be a DiffusionGemmaObjective, got"
          f" {type(objective).__name__}"
      )
    super().__init__(
        model, optimizer, training_config, metrics_logger=metrics_logger,
        **kwargs
    )
    self.objective = objective
    self.splash_tile = splash_tile
    self.loss_fn = dg_objective.make_loss_fn(objective, splash_tile,
                                             splash_interpret)
    self.eval_loss_fn = self.loss_fn
    self.gen_model_input_fn = dg_objective.model_inputs

  def custom_checkpoint_metadata(self) -> dict[str, Any]:
    return {"diffusion_gemma_objective": dataclasses.asdict(self.objective)}
