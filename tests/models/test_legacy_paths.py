"""The pre-`models/` import paths keep working for one release."""

import importlib
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
