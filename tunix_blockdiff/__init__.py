"""tunix_blockdiff: block-diffusion post-training for Tunix models.

The public API (DESIGN.md section 4). Heavy submodules (trainer, rollout
engine, RL) are imported lazily so `import tunix_blockdiff` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any
import warnings

# Deprecated module paths that live in a lower package than their old
# parent (kept for one release). They are served from here, the top of the
# package, so no file under `attention/` imports a layer above it.
_MOVED_MODULES = {
    "tunix_blockdiff.attention.shim": "tunix_blockdiff.models.flash",
}


class _MovedModuleLoader(importlib.abc.Loader):
  """Makes an old module name the same module object as its new home."""

  def __init__(self, new_name: str):
    self._new_name = new_name

  def create_module(self, spec):
    warnings.warn(
        f"{spec.name} moved to {self._new_name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module(self._new_name)

  def exec_module(self, module):
    del module  # Already executed under its new name.


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Finds the deprecated names in `_MOVED_MODULES`."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname not in _MOVED_MODULES:
      return None
    return importlib.util.spec_from_loader(
        fullname, _MovedModuleLoader(_MOVED_MODULES[fullname])
    )


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _MovedModuleFinder())

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
    "BlockDiffusionRollout": ("tunix_blockdiff.rollout.engine", "BlockDiffusionRollout"),
    "register": ("tunix_blockdiff.registration", "register"),
    "BlockDiffusionBatchAdapter": ("tunix_blockdiff.upstream", "BlockDiffusionBatchAdapter"),
    "BlockDiffusionLogitsFn": ("tunix_blockdiff.upstream", "BlockDiffusionLogitsFn"),
    "configure_diffusion_sft": ("tunix_blockdiff.upstream", "configure_diffusion_sft"),
    "diffusion_loss_fn": ("tunix_blockdiff.upstream", "diffusion_loss_fn"),
    "trajectory_logprob": ("tunix_blockdiff.rl.likelihood", "trajectory_logprob"),
    # DiffusionGemma (docs/diffusion_gemma.md).
    "DiffusionGemma": ("tunix_blockdiff.models.diffusion_gemma", "DiffusionGemma"),
    "DiffusionGemmaConfig": ("tunix_blockdiff.models.diffusion_gemma", "DiffusionGemmaConfig"),
    "DiffusionGemmaSampler": ("tunix_blockdiff.rollout.diffusion_gemma", "DiffusionGemmaSampler"),
    "DiffusionGemmaTrainer": ("tunix_blockdiff.trainer", "DiffusionGemmaTrainer"),
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
