"""The rollout engine's output: Tunix's `RolloutOutput` plus the denoising trace.

`BlockDiffusionRollout.generate` returns a `BlockDiffusionRolloutOutput`;
`concat_outputs` joins micro-batch outputs. Trajectory-exact scoring
(`tunix_blockdiff.rl.scoring`, `rl.likelihood`) rebuilds each step's canvas
from the trace.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tunix.rl.rollout import base_rollout

from tunix_blockdiff import config as config_lib


@dataclasses.dataclass
class BlockDiffusionRolloutOutput(base_rollout.RolloutOutput):
  """`RolloutOutput` plus the denoising trace of every rollout.

  Attributes:
    trace_tokens: int32 [B, N] every committed token (also those committed
      after EOS in its block), the mask token where none was.
    commit_steps: int32 [B, N] the step that committed each slot, -1 where
      none did.
    trace_logprobs: float32 [B, N] the rollout's log-prob of each committed
      token (0 where none was).
    denoise_config: The `DenoiseConfig` the rollout used (for scoring).
  """

  trace_tokens: np.ndarray | None = None
  commit_steps: np.ndarray | None = None
  trace_logprobs: np.ndarray | None = None
  denoise_config: config_lib.DenoiseConfig | None = None


def concat_outputs(
    outputs: list[BlockDiffusionRolloutOutput], *, pad_id: int
) -> BlockDiffusionRolloutOutput:
  """Concatenates micro-batch outputs along the batch axis.

  Args:
    outputs: Outputs of `BlockDiffusionRollout.generate` made with the same
      `DenoiseConfig` and completion width.
    pad_id: Left-pads prompts of different widths.
  """
  if not outputs:
    raise ValueError("outputs must not be empty")
  configs = {o.denoise_config for o in outputs}
  if len(configs) != 1:
    raise ValueError(f"outputs mix denoise configs: {configs}")
  widths = {o.trace_tokens.shape[1] for o in outputs}
  if len(widths) != 1:
    raise ValueError(f"outputs mix completion widths: {sorted(widths)}")
  prompt_width = max(o.left_padded_prompt_tokens.shape[1] for o in outputs)

  def left_pad(x):
    return np.pad(
        x, ((0, 0), (prompt_width - x.shape[1], 0)), constant_values=pad_id
    )

  return BlockDiffusionRolloutOutput(
      text=[t for o in outputs for t in o.text],
      logits=[l for o in outputs for l in o.logits or []],
      tokens=[t for o in outputs for t in o.tokens],
      left_padded_prompt_tokens=np.concatenate(
          [left_pad(o.left_padded_prompt_tokens) for o in outputs], axis=0
      ),
      logprobs=[l for o in outputs for l in o.logprobs or []],
      trace_tokens=np.concatenate([o.trace_tokens for o in outputs], axis=0),
      commit_steps=np.concatenate([o.commit_steps for o in outputs], axis=0),
      trace_logprobs=np.concatenate(
          [o.trace_logprobs for o in outputs], axis=0
      ),
      denoise_config=outputs[0].denoise_config,
  )
