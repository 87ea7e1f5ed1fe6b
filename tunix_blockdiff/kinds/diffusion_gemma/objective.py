"""DiffusionGemma's training objective: uniform-token corruption of canvases.

A training row is `[prompt ; completion ; fill]`, the completion filled with
`fill_id` to whole canvases of C slots (at inference every canvas is whole,
and slots after EOS are pad), cut to the canvases that fit in `seq_len`.
Each canvas draws a noise level `t ~ U[min_noise, 1]` and replaces each of
its slots, independently with probability t, by a token drawn uniformly
from the vocabulary (there is no mask token). The decoder sees, per canvas,
the clean tokens before it (through the encoder) and the noisy canvas, and
predicts every canvas slot's clean token: the model cannot tell which slots
were replaced, so all of them are targets.

Self-conditioning (probability p per row): a first pass without it, then a
second pass fed the first's logits (stop-gradient) for the rows whose coin
came up, and no signal for the others (those rows' second pass equals their
first exactly). The loss is the second pass's.

Loss = sum over targets of CE / number of targets (`objective.loss`), so
accumulation over micro-batches is an exact token mean; a row or batch with
no target contributes 0 to both.

Rows and batches are built by `kinds.diffusion_gemma.data`; their randomness is
a pure function of (seed, epoch, example id), so resumed runs see the same
corruption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tunix_blockdiff import compat
from tunix_blockdiff.models.diffusion_gemma import layers as dg_layers
from tunix_blockdiff.objective import loss as loss_lib

FIELDS = ("clean", "noisy", "positions", "valid", "canvas_id",
          "canvas_start", "targets", "loss_weights", "sc_on")


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaObjective:
  """The DiffusionGemma SFT objective.

  Attributes:
    canvas_length: C (the model's).
    vocab_size: Replacement tokens are drawn from [0, vocab_size).
    min_noise: Lower end of the per-canvas noise level t ~ U[min_noise, 1].
    self_conditioning_prob: p, the per-row probability of the second,
      self-conditioned pass (0 disables it and halves the cost).
    fill_id: Fills the last canvas after the completion (the sampler writes
      pad after EOS, so the pad id by default).
  """

  canvas_length: int
  vocab_size: int
  min_noise: float = 1e-3
  self_conditioning_prob: float = 0.5
  fill_id: int = 0

  def __post_init__(self):
    for name in ("canvas_length", "vocab_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= self.min_noise < 1.0:
      raise ValueError(f"min_noise must be in [0, 1), got {self.min_noise}")
    if not 0.0 <= self.self_conditioning_prob <= 1.0:
      raise ValueError("self_conditioning_prob must be in [0, 1], got"
                       f" {self.self_conditioning_prob}")
    if not 0 <= self.fill_id < self.vocab_size:
      raise ValueError(
          f"fill_id must be in [0, {self.vocab_size}), got {self.fill_id}")


def make_loss_fn(objective: DiffusionGemmaObjective,
                 splash_tile: int | None = None,
                 splash_interpret: bool | None = None):
  """`loss_fn(model, **batch fields) -> LossOutput` (see the module doc).

  `splash_tile`: the model's attention runs the Splash kernel with that
  tile while the loss is traced (`layers.splash_scope`; it must divide
  `seq_len`); None: dense.
  """
  if not isinstance(objective, DiffusionGemmaObjective):
    raise TypeError("objective must be a DiffusionGemmaObjective, got"
                    f" {type(objective).__name__}")
  self_conditioning = objective.self_conditioning_prob > 0

  def loss_fn(model, clean, noisy, positions, valid, canvas_id, canvas_start,
              targets, loss_weights, sc_on) -> compat.LossOutput:
    args = (clean, noisy, positions, valid, canvas_id, canvas_start)
    with dg_layers.attention_scope(splash_tile, splash_interpret):
      logits = model(*args)
      if self_conditioning:
        logits = model(*args, jax.lax.stop_gradient(logits),
                       sc_on.astype(bool))
    return loss_lib.diffusion_loss(logits, targets,
                                   jnp.asarray(loss_weights, jnp.float32))

  return loss_fn


def model_inputs(batch) -> dict[str, jax.Array]:
  """The loss's fields of a batch (the trainer's `gen_model_input_fn`)."""
  missing = [k for k in FIELDS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing fields {missing}; build it with"
                     " kinds.diffusion_gemma.data")
  return {k: batch[k] for k in FIELDS}
