"""tunix_blockdiff: block-diffusion post-training for Tunix models.

The public API (DESIGN.md section 4). Every name is imported on first use
(PEP 562), so `import tunix_blockdiff` and the `tunix-blockdiff` command's
`--help` and `launch` load neither JAX nor Tunix.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# module -> the public names it defines; each is resolved on first access.
_EXPORTS = {
    "attention.context_parallel": (
        "load_balance_order",
        "reorder_batch_for_context_parallel",
        "reorder_for_context_parallel",
        "restore_from_context_parallel",
    ),
    "attention.masks": ("block_causal_mask", "two_stream_mask"),
    "compat": (
        "compute_diffusion_logits",
        "DiffusionBatchAdapter",
        "DiffusionLogitsFn",
        "DiffusionTokenBatch",
        "LossOutput",
        "WeightedMetric",
    ),
    "config": ("AttentionConfig", "BlockDiffusionConfig", "DenoiseConfig"),
    "models.logits": (
        "block_diffusion_logits",
        "make_logits_fn",
        "two_stream_logits",
    ),
    "objective.alignment": ("align_logits",),
    "objective.corruption": (
        "build_two_stream_inputs",
        "corrupt",
        "CorruptionResult",
    ),
    "objective.loss": ("diffusion_loss",),
    "rollout.denoise": ("denoise", "DenoiseResult"),
    "rollout.cached": ("generate",),
    "trainer": ("BlockDiffusionTrainer",),
    "rl.engine": ("BlockDiffusionRollout",),
    "registration": ("register",),
    "upstream": (
        "BlockDiffusionBatchAdapter",
        "BlockDiffusionLogitsFn",
        "configure_diffusion_sft",
        "diffusion_loss_fn",
    ),
    "rl.likelihood": ("trajectory_logprob",),
    "models.diffusion_gemma": ("DiffusionGemma", "DiffusionGemmaConfig"),
    "kinds.diffusion_gemma.sampler": ("DiffusionGemmaSampler",),
    "kinds.diffusion_gemma.trainer": ("DiffusionGemmaTrainer",),
}
# Public names that differ from their attribute: name -> (module, attribute).
_RENAMED = {
    "load_diffusion_gemma": ("models.diffusion_gemma", "load"),
}
_LAZY = {
    name: (module, name)
    for module, names in _EXPORTS.items()
    for name in names
} | _RENAMED


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    module, attribute = _LAZY[name]
    value = getattr(
        importlib.import_module(f"tunix_blockdiff.{module}"), attribute)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'tunix_blockdiff' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


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
