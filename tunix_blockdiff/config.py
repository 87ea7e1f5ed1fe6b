"""Frozen, validated configuration for block-diffusion training and decoding.

Every field is checked when the object is built, so a bad value fails at
configuration time with an error that names the field and the rule, never
later inside a jitted program.
"""

from __future__ import annotations

import dataclasses
import numbers

ALIGNMENTS = ("same_position", "shifted")
CANVASES = ("all_masked", "seed_and_mask")
STREAMS = ("single", "two_stream", "clean_prefix")
LOSS_WEIGHTINGS = ("uniform", "elbo")
# The only supported alignment/canvas pairings (DESIGN.md section 2).
CANVAS_FOR_ALIGNMENT = {"same_position": "all_masked", "shifted": "seed_and_mask"}


def _check_int(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_optional_int(name: str, value, minimum: int) -> None:
  if value is not None:
    _check_int(name, value, minimum)


def _check_float(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  return float(value)


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_alignment_canvas(
    alignment: str, canvas: str, block_size: int
) -> None:
  """Raises unless (alignment, canvas) is a supported pairing."""
  _check_choice("alignment", alignment, ALIGNMENTS)
  _check_choice("canvas", canvas, CANVASES)
  if CANVAS_FOR_ALIGNMENT[alignment] != canvas:
    raise ValueError(
        f"canvas={canvas!r} does not pair with alignment={alignment!r}:"
        " supported pairs are same_position+all_masked and"
        " shifted+seed_and_mask"
    )
  if canvas == "seed_and_mask" and block_size < 2:
    raise ValueError(
        "block_size must be >= 2 with canvas='seed_and_mask' (each block keeps"
        f" one clean seed slot), got {block_size}"
    )


@dataclasses.dataclass(frozen=True)
class BlockDiffusionConfig:
  """Configuration of the block-diffusion training objective.

  Attributes:
    block_size: Slots per block (>= 1). 1 is causal attention.
    mask_token_id: Vocabulary id of the mask token (>= 0).
    alignment: `same_position` (logit at slot i predicts slot i) or `shifted`
      (logit at logical position pos-1 predicts the slot at pos).
    canvas: `all_masked` (pairs with `same_position`) or `seed_and_mask`
      (pairs with `shifted`; the first slot of each block stays clean).
    stream: `single` (one noised sequence, block-causal; MaxText),
      `two_stream` (clean and noised sequences concatenated, BD3-LM), or
      `clean_prefix` (single stream whose blocks before a random cut block are
      kept clean, so training sees clean context like inference does).
    min_noise: Lower bound of the per-block noise rate t ~ U[min_noise, 1].
    loss_weighting: `uniform` or `elbo` (each target weighted by 1/t).
    certainty_weight: Weight c >= 0 of the optional certainty term
      (dParallel's certainty forcing): the loss adds `c * w_i * H_i` at each
      target slot i whose argmax already equals its target, `H_i` the
      entropy of `softmax(logits_i / certainty_temperature)`, so parallel
      decoding commits more slots per step. 0 (the default) turns it off and
      leaves the loss exactly the cross-entropy.
    certainty_temperature: Temperature > 0 of the certainty term's softmax.
  """

  block_size: int
  mask_token_id: int
  alignment: str = "same_position"
  canvas: str = "all_masked"
  stream: str = "single"
  min_noise: float = 1e-3
  loss_weighting: str = "uniform"
  certainty_weight: float = 0.0
  certainty_temperature: float = 1.0

  def __post_init__(self):
    _check_int("block_size", self.block_size, 1)
    _check_int("mask_token_id", self.mask_token_id, 0)
    check_alignment_canvas(self.alignment, self.canvas, self.block_size)
    _check_choice("stream", self.stream, STREAMS)
    min_noise = _check_float("min_noise", self.min_noise)
    if not 0.0 < min_noise <= 1.0:
      raise ValueError(f"min_noise must satisfy 0 < min_noise <= 1, got {min_noise}")
    _check_choice("loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
    weight = _check_float("certainty_weight", self.certainty_weight)
    if not 0.0 <= weight < float("inf"):
      raise ValueError(f"certainty_weight must be finite and >= 0, got {weight}")
    temperature = _check_float(
        "certainty_temperature", self.certainty_temperature
    )
    if not 0.0 < temperature < float("inf"):
      raise ValueError(
          f"certainty_temperature must be finite and > 0, got {temperature}"
      )


@dataclasses.dataclass(frozen=True)
class DenoiseConfig:
  """Configuration of the low-confidence block denoiser (DESIGN.md 5.3).

  Attributes:
    block_size: Slots per block (>= 1).
    mask_token_id: Vocabulary id of the mask token (>= 0); never proposed.
    threshold: Commit every eligible slot whose confidence is strictly above
      it (0 < threshold <= 1). Ignored when `steps_per_block` is set.
    alignment: `same_position` or `shifted` (what the logits function
      returns is already target-aligned; `shifted` adds the rule that logical
      position 0 must be prompt).
    steps_per_block: Optional static schedule: each block takes at most this
      many steps, committing ceil(left / steps left) slots per step.
    sub_block_size: Optional sub-blocks (Fast-dLLM v2's small blocks): only
      the masked slots of the first sub-block of the active block that
      still has any are eligible at a step (threshold mode; a divisor of
      `block_size`); the model still sees the whole block.
    temperature: 0 for greedy proposals, > 0 to sample.
    top_k: Optional top-k filter for sampling (>= 1).
    top_p: Optional nucleus filter for sampling (0 < top_p <= 1).
    eos_token_id: Optional EOS id: a row stops once everything before its
      first committed EOS is committed; later slots become `pad_token_id`.
    pad_token_id: Id written after EOS (>= 0).
  """

  block_size: int
  mask_token_id: int
  threshold: float = 0.9
  alignment: str = "same_position"
  steps_per_block: int | None = None
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  eos_token_id: int | None = None
  pad_token_id: int = 0
  sub_block_size: int | None = None

  def __post_init__(self):
    _check_int("block_size", self.block_size, 1)
    _check_int("mask_token_id", self.mask_token_id, 0)
    threshold = _check_float("threshold", self.threshold)
    if not 0.0 < threshold <= 1.0:
      raise ValueError(f"threshold must satisfy 0 < threshold <= 1, got {threshold}")
    _check_choice("alignment", self.alignment, ALIGNMENTS)
    _check_optional_int("steps_per_block", self.steps_per_block, 1)
    _check_optional_int("sub_block_size", self.sub_block_size, 1)
    if self.sub_block_size is not None:
      if self.block_size % self.sub_block_size:
        raise ValueError(
            f"sub_block_size ({self.sub_block_size}) must divide block_size"
            f" ({self.block_size})")
      if self.steps_per_block is not None:
        raise ValueError(
            "sub_block_size takes the threshold rule: set steps_per_block to"
            " None")
    temperature = _check_float("temperature", self.temperature)
    if temperature < 0.0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    _check_optional_int("top_k", self.top_k, 1)
    if self.top_p is not None:
      top_p = _check_float("top_p", self.top_p)
      if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must satisfy 0 < top_p <= 1, got {top_p}")
    _check_optional_int("eos_token_id", self.eos_token_id, 0)
    _check_int("pad_token_id", self.pad_token_id, 0)
    if self.eos_token_id is not None and self.eos_token_id == self.mask_token_id:
      raise ValueError("eos_token_id must differ from mask_token_id")


ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "splash")
SPLASH_TILES = (512, 256, 128)
SPLASH_MASK_MODES = ("auto", "static", "dynamic")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """The attention of the training logits (recipe keys `model.attention*`).

  Attributes:
    implementation: `dense` (a mask; any Tunix causal LM), `splash` (the
      Splash kernels: Tunix Qwen2/Qwen3, under a mesh; sequence lengths a
      multiple of 128) or `auto` (Splash on a TPU where it can run, dense
      otherwise).
    tile: Splash query and key tile (a multiple of 128 that divides the
      sequence); None: the largest of 512, 256, 128 that divides it on a
      TPU, 128 elsewhere (Pallas interpret mode).
    interpret: Pallas interpret mode; None: off TPU only.
    mask_mode: The Splash mask (`attention.splash`; the two-stream call's
      too, where `auto` means `dynamic`): `static` (the lazy block-causal or
      two-stream mask with segment ids: documents
      start at block multiples of the row, as `packing: none` and
      `block_aligned` lay them out; a batch that breaks it gives NaN, never
      wrong numbers), `dynamic` (a per-example mask from the positions, any
      layout, materialised per head and layer) or `auto` (static where the
      batch allows it, else dynamic: under `jit` a `lax.cond` over the
      whole model, and under a gradient both variants' activations are
      kept, 1.5-1.7x the memory on CPU (`benchmarks/mask_memory.py`) and
      out of a v5e's HBM at Qwen3-0.6B, 4 x 2048; right for inference, not
      for training).
  """

  implementation: str = "dense"
  tile: int | None = None
  interpret: bool | None = None
  mask_mode: str = "auto"

  def __post_init__(self):
    _check_choice("implementation", self.implementation,
                  ATTENTION_IMPLEMENTATIONS)
    _check_optional_int("tile", self.tile, 128)
    if self.tile is not None and self.tile % 128:
      raise ValueError(f"tile must be a multiple of 128, got {self.tile}")
    _check_choice("mask_mode", self.mask_mode, SPLASH_MASK_MODES)
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise TypeError(
          f"interpret must be a bool or None, got {type(self.interpret).__name__}")

  def tile_for(self, length: int, backend: str) -> int | None:
    """The tile for rows of `length` slots, or None where none divides it."""
    if self.tile is not None:
      return self.tile if length % self.tile == 0 else None
    sizes = SPLASH_TILES if backend == "tpu" else (128,)
    return next((t for t in sizes if length % t == 0), None)

  def uses_splash(self, length: int, backend: str, model_supports: bool) -> bool:
    """Whether rows of `length` slots train with Splash.

    Raises:
      ValueError: `splash` where it cannot run (the model, or the length).
    """
    if self.implementation == "dense":
      return False
    runnable = model_supports and self.tile_for(length, backend) is not None
    if self.implementation == "auto":
      return backend == "tpu" and runnable
    if not model_supports:
      raise ValueError(
          "attention 'splash' runs Tunix's Qwen2 and Qwen3 attention only;"
          " use 'dense' (or 'auto') for this model")
    if not runnable:
      raise ValueError(
          f"attention 'splash' needs the attended length ({length}; twice"
          " seq_len for two_stream) to be a multiple of the tile"
          f" ({self.tile or 128}); change seq_len or the tile, or use 'dense'")
    return True
