"""Deprecated path: `tunix_blockdiff.models.tiny` (kept for one release).

The old module name is the same module object as the new one, so
attributes, private helpers and monkeypatching all keep working.
"""

import importlib
import sys
import warnings

warnings.warn(
    "tunix_blockdiff.tiny_models moved to tunix_blockdiff.models.tiny",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("tunix_blockdiff.models.tiny")
