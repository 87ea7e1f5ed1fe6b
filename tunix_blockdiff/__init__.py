"""tunix_blockdiff: block-diffusion post-training for Tunix models.

The public API (DESIGN.md section 4). Heavy submodules (trainer, rollout
engine, RL) are imported lazily so `import tunix_blockdiff` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from tunix_blockdiff.attention.context_parallel import load_balance_order
from tunix_blockdiff.attention.context_parallel import reorder_batch_for_context_parallel
from tunix_blockdiff.attention.context_parallel import reorder_for_context_parallel
from tunix_blockdiff.attention.context_parallel import restore_from_context_parallel
from tunix_blockdiff.attention.masks import block_causal_mask
from tunix_blockdiff.attention.masks import two_stream_mask
from tunix_blockdiff.compat import compute_diffusion_logits
from tunix_blockdiff.compat import DiffusionBatchAdapter
from tunix_blockdiff.compat import DiffusionLogitsFn
from tunix_blockdiff.compat import DiffusionTokenBatch
from tunix_blockdiff.compat import LossOutput
from tunix_blockdiff.compat import WeightedMetric
from tunix_blockdiff.config import AttentionConfig
from tunix_blockdiff.config import BlockDiffusionConfig
from tunix_blockdiff.config import DenoiseConfig
from tunix_blockdiff.models.logits import block_diffusion_logits
from tunix_blockdiff.models.logits import make_logits_fn
from tunix_blockdiff.models.logits import two_stream_logits
from tunix_blockdiff.objective.alignment import align_logits
from tunix_blockdiff.objective.corruption import build_two_stream_inputs
from tunix_blockdiff.objective.corruption import corrupt
from tunix_blockdiff.objective.corruption import CorruptionResult
from tunix_blockdiff.objective.loss import diffusion_loss

__version__ = "0.1.0"

# name -> (module, attribute); resolved on first access.
_LAZY = {
    "denoise": ("tunix_blockdiff.rollout.denoise", "denoise"),
    "DenoiseResult": ("tunix_blockdiff.rollout.denoise", "DenoiseResult"),
    "generate": ("tunix_blockdiff.rollout.cached", "generate"),
    "BlockDiffusionTrainer": ("tunix_blockdiff.trainer", "BlockDiffusionTrainer"),
    "BlockDiffusionRollout": ("tunix_blockdiff.rl.engine", "BlockDiffusionRollout"),
    "register": ("tunix_blockdiff.registration", "register"),
    "BlockDiffusionBatchAdapter": ("tunix_blockdiff.upstream", "BlockDiffusionBatchAdapter"),
    "BlockDiffusionLogitsFn": ("tunix_blockdiff.upstream", "BlockDiffusionLogitsFn"),
    "configure_diffusion_sft": ("tunix_blockdiff.upstream", "configure_diffusion_sft"),
    "diffusion_loss_fn": ("tunix_blockdiff.upstream", "diffusion_loss_fn"),
    "trajectory_logprob": ("tunix_blockdiff.rl.likelihood", "trajectory_logprob"),
    # DiffusionGemma (docs/diffusion_gemma.md).
    "DiffusionGemma": ("tunix_blockdiff.models.diffusion_gemma", "DiffusionGemma"),
    "DiffusionGemmaConfig": ("tunix_blockdiff.models.diffusion_gemma", "DiffusionGemmaConfig"),
    "DiffusionGemmaSampler": ("tunix_blockdiff.kinds.diffusion_gemma.sampler", "DiffusionGemmaSampler"),
    "DiffusionGemmaTrainer": ("tunix_blockdiff.kinds.diffusion_gemma.trainer", "DiffusionGemmaTrainer"),
    "load_diffusion_gemma": ("tunix_blockdiff.models.diffusion_gemma", "load"),
}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'tunix_blockdiff' has no attribute {name!r}")


__all__ = [
    "BlockDiffusionBatchAdapter",
    "AttentionConfig",
    "BlockDiffusionConfig",
    "BlockDiffusionLogitsFn",
    "BlockDiffusionRollout",
    "BlockDiffusionTrainer",
    "CorruptionResult",
    "DenoiseConfig",
    "DenoiseResult",
    "DiffusionBatchAdapter",
    "DiffusionGemma",
    "DiffusionGemmaConfig",
    "DiffusionGemmaSampler",
    "DiffusionGemmaTrainer",
    "DiffusionLogitsFn",
    "DiffusionTokenBatch",
    "LossOutput",
    "WeightedMetric",
    "align_logits",
    "block_causal_mask",
    "block_diffusion_logits",
    "build_two_stream_inputs",
    "compute_diffusion_logits",
    "configure_diffusion_sft",
    "corrupt",
    "denoise",
    "diffusion_loss",
    "diffusion_loss_fn",
    "generate",
    "load_balance_order",
    "load_diffusion_gemma",
    "make_logits_fn",
    "register",
    "reorder_batch_for_context_parallel",
    "reorder_for_context_parallel",
    "restore_from_context_parallel",
    "trajectory_logprob",
    "two_stream_logits",
    "two_stream_mask",
]
