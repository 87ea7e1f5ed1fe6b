"""Tests for tunix_blockdiff.register()."""

import logging

from tunix.rl import function_registry
from tunix.rl.grpo import grpo_learner

import tunix_blockdiff
from tunix_blockdiff import registration


def test_register_makes_the_losses_available_and_is_idempotent(caplog):
  provided = tunix_blockdiff.register()
  assert provided == {"policy_loss_fn": ["bd_grpo", "bd_opd", "dg_grpo"]}
  grpo_loss = function_registry.get_policy_loss_fn("bd_grpo")
  opd_loss = function_registry.get_policy_loss_fn("bd_opd")
  from tunix_blockdiff.rl import grpo, opd  # pylint: disable=g-import-not-at-top

  assert grpo_loss is grpo.bd_grpo_loss_fn
  assert opd_loss is opd.bd_opd_loss_fn
  from tunix_blockdiff.kinds.diffusion_gemma import grpo as diffusion_gemma_grpo  # pylint: disable=g-import-not-at-top

  assert (function_registry.get_policy_loss_fn("dg_grpo")
          is diffusion_gemma_grpo.dg_grpo_loss_fn)
  # Registering again changes nothing and warns about nothing (Tunix's
  # registry logs a warning when a name is overwritten).
  with caplog.at_level(logging.WARNING):
    assert tunix_blockdiff.register() == provided
  assert not [
      r for r in caplog.records if "already registered" in r.getMessage()
  ]
  assert function_registry.get_policy_loss_fn("bd_grpo") is grpo_loss
  assert "bd_grpo" in function_registry.default_registry.list_functions(
      "policy_loss_fn"
  )
  # Tunix's own built-ins are untouched.
  assert function_registry.get_policy_loss_fn("grpo") is not grpo_loss


def test_lazy_public_names_resolve():
  assert tunix_blockdiff.register is registration.register
  from tunix_blockdiff.rl import engine  # pylint: disable=g-import-not-at-top

  assert tunix_blockdiff.BlockDiffusionRollout is engine.BlockDiffusionRollout


def test_a_tunix_grpo_config_can_name_the_registered_loss():
  tunix_blockdiff.register()
  config = grpo_learner.GRPOConfig(num_generations=2, policy_loss_fn="bd_grpo")
  assert callable(function_registry.get_policy_loss_fn(config.policy_loss_fn))
