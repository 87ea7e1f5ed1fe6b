"""What a DiffusionGemma rollout records: its trace and its Tunix output.

`DiffusionGemmaTrace` holds, per row, everything the trajectory-exact
scorer (`kinds.diffusion_gemma.scoring`) replays: the canvases the row's
cache was built from, and for every canvas and denoising step the input
canvas, the canvas it produced, the sampled denoiser canvas, the accepted
mask, the temperature, whether the row was still denoising, and the
self-conditioning switch (the chain itself, the previous step's scaled
logits, is recomputed by the scorer from these). Every array leads with the
batch axis, so Tunix's batch slicing and `concat_outputs` apply.

`DiffusionGemmaRolloutOutput` is Tunix's `RolloutOutput` plus that trace and
the sampler's own sequence log-probs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import flax
import jax
import numpy as np
from tunix.rl.rollout import base_rollout

from tunix_blockdiff.models.diffusion_gemma import config as dg_config
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout

_STEP_FIELDS = ("canvas", "next_canvas", "denoiser", "accepted", "live",
                "sc_on", "logprob")


@flax.struct.dataclass(frozen=True)
class DiffusionGemmaTrace:
  """The per-row record of a DiffusionGemma rollout (B rows, K canvases).

  Attributes:
    tokens: int32 [B, K * C] each canvas's finished tokens as encoded into
      the cache (pad after the row's first EOS and for later canvases).
    active: bool [B, K] the row was still generating when canvas k began
      (a finished row's later canvases are discarded, so they are not
      scored).
    canvas: int32 [B, K, N, C] each step's input canvas.
    next_canvas: int32 [B, K, N, C] the canvas each step produced.
    denoiser: int32 [B, K, N, C] each step's sampled denoiser canvas.
    accepted: bool [B, K, N, C] each step's accepted slots.
    temperature: float32 [B, K, N] each step's temperature.
    live: bool [B, K, N] the row was still denoising at that step.
    sc_on: bool [B, K, N] the step was self-conditioned (all but the first).
    logprob: float32 [B, K, N] the sampler's log-prob of each step's
      transition (0 where not live).
  """

  tokens: jax.Array
  active: jax.Array
  canvas: jax.Array
  next_canvas: jax.Array
  denoiser: jax.Array
  accepted: jax.Array
  temperature: jax.Array
  live: jax.Array
  sc_on: jax.Array
  logprob: jax.Array

  @property
  def num_canvases(self) -> int:
    return int(self.canvas.shape[1])


def trace_from_result(result: dg_rollout.GenerateResult,
                      canvas_length: int) -> DiffusionGemmaTrace:
  """The NumPy trace of a `generate(..., record_trace=True)` result.

  Canvases `generate` skipped (every row had finished) are filled with
  inactive, not-live steps.

  Args:
    result: A `GenerateResult` whose `trace` is set.
    canvas_length: C.
  """
  if result.trace is None:
    raise ValueError("result has no trace: sample with record_trace=True")
  tokens = np.asarray(result.tokens, np.int32)
  width = tokens.shape[1]
  k = width // canvas_length
  if k * canvas_length != width or not result.trace:
    raise ValueError(
        f"result.tokens width {width} is not a positive multiple of"
        f" canvas_length={canvas_length}")
  fields = {}
  for name in _STEP_FIELDS + ("temperature",):
    per_canvas = [np.asarray(t[name]) for t in result.trace]   # [B, N, ...]
    # Skipped canvases: not live; the schedule is the same for every canvas.
    filler = (per_canvas[0] if name == "temperature"
              else np.zeros_like(per_canvas[0]))
    per_canvas += [filler] * (k - len(per_canvas))
    fields[name] = np.stack(per_canvas, axis=1)
  fields["temperature"] = fields["temperature"].astype(np.float32)
  return DiffusionGemmaTrace(
      tokens=tokens,
      active=np.asarray(result.canvas_steps) > 0,
      **fields)


def sampler_logprobs(trace: DiffusionGemmaTrace,
                     vocab_size: int) -> np.ndarray:
  """float32 [B]: the sampler's log P of each row's trajectories.

  Per active canvas, C log(1/V) for its uniform initial canvas plus its
  live steps' recorded terms; `kinds.diffusion_gemma.scoring` computes the
  same quantity under any parameters.
  """
  c = trace.canvas.shape[-1]
  per_canvas = c * -math.log(vocab_size) + np.sum(
      np.asarray(trace.logprob, np.float64), axis=-1)
  return np.sum(np.where(np.asarray(trace.active), per_canvas, 0.0),
                axis=-1).astype(np.float32)


def concat_traces(traces: Sequence[DiffusionGemmaTrace]) -> DiffusionGemmaTrace:
  """Traces joined along the batch axis (same K, N and C)."""
  shapes = {t.canvas.shape[1:] for t in traces}
  if len(shapes) != 1:
    raise ValueError(f"traces mix canvas/step shapes: {sorted(shapes)}")
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *traces)


@dataclasses.dataclass
class DiffusionGemmaRolloutOutput(base_rollout.RolloutOutput):
  """`RolloutOutput` plus every rollout's DiffusionGemma trace.

  `tokens` are each row's completion cut at its first EOS (EOS excluded);
  `logprobs` is None (a DiffusionGemma rollout has no per-token
  log-probability: tokens are revised); the trajectory log-probs are
  `sequence_logprobs`.

  Attributes:
    trace: The `DiffusionGemmaTrace` of the B rows.
    sequence_logprobs: float32 [B] the sampler's log P of each row's
      trajectories (`sampler_logprobs`).
    prompt_lengths: int32 [B] real prompt tokens per row.
    sampler_config: The `SamplerConfig` the rollout used.
  """

  trace: DiffusionGemmaTrace | None = None
  sequence_logprobs: np.ndarray | None = None
  prompt_lengths: np.ndarray | None = None
  sampler_config: dg_config.SamplerConfig | None = None


def concat_outputs(outputs: Sequence[DiffusionGemmaRolloutOutput]
                   ) -> DiffusionGemmaRolloutOutput:
  """Micro-batch outputs joined along the batch axis.

  Args:
    outputs: Outputs of one `SamplerConfig`, prompt width and trace shape
      (DiffusionGemma positions are physical slots, so prompts cannot be
      re-padded).
  """
  if not outputs:
    raise ValueError("outputs must not be empty")
  configs = {o.sampler_config for o in outputs}
  if len(configs) != 1:
    raise ValueError(f"outputs mix sampler configs: {configs}")
  widths = {o.left_padded_prompt_tokens.shape[1] for o in outputs}
  if len(widths) != 1:
    # Positions are physical slots: re-padding would move every position.
    raise ValueError(f"outputs mix prompt widths: {sorted(widths)}")
  return DiffusionGemmaRolloutOutput(
      text=[t for o in outputs for t in o.text],
      logits=[],
      tokens=[t for o in outputs for t in o.tokens],
      left_padded_prompt_tokens=np.concatenate(
          [o.left_padded_prompt_tokens for o in outputs], axis=0),
      logprobs=None,
      trace=concat_traces([o.trace for o in outputs]),
      sequence_logprobs=np.concatenate(
          [o.sequence_logprobs for o in outputs]),
      prompt_lengths=np.concatenate([o.prompt_lengths for o in outputs]),
      sampler_config=outputs[0].sampler_config,
  )


__all__ = [
    "DiffusionGemmaRolloutOutput",
    "DiffusionGemmaTrace",
    "concat_outputs",
    "concat_traces",
    "sampler_logprobs",
    "trace_from_result",
]
