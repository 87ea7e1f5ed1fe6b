"""The pre-`models/` import paths keep working for one release."""

import importlib
import sys
import warnings

import pytest

from tunix_blockdiff import models


@pytest.mark.parametrize(
    "old, new",
    [
        ("tunix_blockdiff.hf_configs", "tunix_blockdiff.models.hf_configs"),
        ("tunix_blockdiff.checkpoints", "tunix_blockdiff.models.checkpoints"),
        ("tunix_blockdiff.hf_export", "tunix_blockdiff.models.hf_export"),
        ("tunix_blockdiff.tiny_models", "tunix_blockdiff.models.tiny"),
        ("tunix_blockdiff.modeling", "tunix_blockdiff.models.logits"),
        ("tunix_blockdiff.attention.shim", "tunix_blockdiff.models.flash"),
    ],
)
def test_old_path_is_the_new_module(old, new):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    assert importlib.import_module(old) is importlib.import_module(new)


def test_registry_names_on_the_package():
  from tunix_blockdiff.models import registry  # pylint: disable=g-import-not-at-top

  for name in ("build_model", "model_vocab_size", "sliding_window",
               "check_window", "KINDS", "FAMILIES"):
    assert getattr(models, name) is getattr(registry, name)


def test_moved_shim_from_import_and_warning(monkeypatch):
  from tunix_blockdiff import attention  # pylint: disable=g-import-not-at-top

  monkeypatch.delitem(sys.modules, "tunix_blockdiff.attention.shim",
                      raising=False)
  monkeypatch.delattr(attention, "shim", raising=False)
  with pytest.warns(DeprecationWarning, match="models.flash"):
    from tunix_blockdiff.attention import shim  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.models import flash  # pylint: disable=g-import-not-at-top

  assert shim is flash
  assert shim.make_logits_fn is flash.make_logits_fn
