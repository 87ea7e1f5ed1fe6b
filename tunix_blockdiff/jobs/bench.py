"""`tunix-blockdiff bench NAME [args]`: run `benchmarks/NAME.py` from the checkout.

Benchmarks are scripts in the repository (not shipped in the wheel), so this
works from an editable install (`pip install -e .`), the README's install.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

from tunix_blockdiff import errors

BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def available() -> list[str]:
  if not BENCHMARKS_DIR.is_dir():
    return []
  return sorted(
      p.stem for p in BENCHMARKS_DIR.glob("*.py") if not p.stem.startswith("_")
  )


def main(argv: list[str]) -> int:
  names = available()
  if not argv or argv[0] in ("-h", "--help"):
    print("usage: tunix-blockdiff bench NAME [args]\n\nbenchmarks: " + (", ".join(names) or "(none found: needs a source checkout)"))
    return 0
  name, rest = argv[0], argv[1:]
  if name not in names:
    raise errors.UsageError(
        f"unknown benchmark {name!r}{errors.nearest(name, names)};"
        f" available: {', '.join(names) or 'none'} (looked in"
        f" {BENCHMARKS_DIR})")
  saved = sys.argv
  sys.argv = [str(BENCHMARKS_DIR / f"{name}.py")] + rest
  try:
    runpy.run_path(sys.argv[0], run_name="__main__")
  except SystemExit as e:
    return int(e.code or 0)
  finally:
    sys.argv = saved
  return 0
