"""`tunix_blockdiff.models` re-exports its registry's names; the old
top-level paths (`tunix_blockdiff.modeling`, `tiny_models`, ...) are gone."""

import importlib

import pytest

from tunix_blockdiff import models


@pytest.mark.parametrize(
    "old",
    ["tunix_blockdiff.hf_configs", "tunix_blockdiff.checkpoints",
     "tunix_blockdiff.hf_export", "tunix_blockdiff.tiny_models",
     "tunix_blockdiff.modeling", "tunix_blockdiff.attention.shim"],
)
def test_removed_old_paths_do_not_import(old):
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(old)


def test_registry_names_on_the_package():
  from tunix_blockdiff.models import registry  # pylint: disable=g-import-not-at-top

  for name in ("build_model", "model_vocab_size", "sliding_window",
               "check_window", "KINDS", "FAMILIES"):
    assert getattr(models, name) is getattr(registry, name)
