"""Deprecated path: `tunix_blockdiff.models.hf_export` (kept for one release).

The old module name is the same module object as the new one, so
attributes, private helpers and monkeypatching all keep working.
"""

import importlib
import sys
import warnings

warnings.warn(
    "tunix_blockdiff.hf_export moved to tunix_blockdiff.models.hf_export",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("tunix_blockdiff.models.hf_export")
