"""Registration of the block-diffusion RL losses with Tunix.

`register()` adds to Tunix's `function_registry`:

* policy loss `bd_grpo`: `tunix_blockdiff.rl.grpo.bd_grpo_loss_fn`;
* policy loss `bd_opd`: `tunix_blockdiff.rl.opd.bd_opd_loss_fn`;
* policy loss `dg_grpo`: `tunix_blockdiff.kinds.diffusion_gemma.grpo
  .dg_grpo_loss_fn` (sequence-level GRPO on DiffusionGemma rollouts).

It is idempotent (registering twice changes nothing and logs nothing) and
runs when this module is imported, so a Tunix YAML config or script that
imports `tunix_blockdiff.registration` (or calls `tunix_blockdiff.register()`)
can name these losses. The learners call it themselves.
"""

from __future__ import annotations

import threading

from tunix.rl import function_registry

POLICY_LOSSES = {
    "bd_grpo": ("tunix_blockdiff.rl.grpo", "bd_grpo_loss_fn"),
    "bd_opd": ("tunix_blockdiff.rl.opd", "bd_opd_loss_fn"),
    "dg_grpo": ("tunix_blockdiff.kinds.diffusion_gemma.grpo", "dg_grpo_loss_fn"),
}
_LOCK = threading.Lock()


def _policy_loss(name: str):
  import importlib  # pylint: disable=g-import-not-at-top

  module, attribute = POLICY_LOSSES[name]
  return getattr(importlib.import_module(module), attribute)


def register() -> dict[str, list[str]]:
  """Registers the plugin's functions with Tunix; safe to call repeatedly.

  Returns:
    {category: names} of what the plugin provides (all now registered).
  """
  category = "policy_loss_fn"
  with _LOCK:
    for name in POLICY_LOSSES:
      function = _policy_loss(name)
      try:
        current = function_registry.default_registry.get(category, name)
      except LookupError:
        current = None
      if current is not function:
        function_registry.register_policy_loss_fn(name)(function)
  return {category: sorted(POLICY_LOSSES)}


register()
