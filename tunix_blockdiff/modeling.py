"""Deprecated path: `tunix_blockdiff.models.logits` (kept for one release).

The old module name is the same module object as the new one, so
attributes, private helpers and monkeypatching all keep working.
"""

import importlib
import sys
import warnings

warnings.warn(
    "tunix_blockdiff.modeling moved to tunix_blockdiff.models.logits",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("tunix_blockdiff.models.logits")
