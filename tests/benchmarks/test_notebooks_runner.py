"""`benchmarks/notebooks.py`: a notebook's code as one plain Python program.

The real notebooks run under a Jupyter kernel in `tests/notebooks`; here a
small notebook checks what the runner adds (magics made inert, the FAST
flip, `display` without IPython, the row it reports), without a kernel.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

PATH = (pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
        / "notebooks.py")


def _module():
  spec = importlib.util.spec_from_file_location("notebooks_bench", PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _notebook(path: pathlib.Path, cells: list[str]) -> pathlib.Path:
  path.write_text(json.dumps({"cells": [
      {"cell_type": "markdown", "source": ["# title\n"]},
      *[{"cell_type": "code", "source": c.splitlines(keepends=True)}
        for c in cells],
  ]}))
  return path


def test_a_notebook_runs_in_one_process_with_magics_made_inert(tmp_path):
  bench = _module()
  path = _notebook(tmp_path / "nb.ipynb", [
      "import sys\nif 'google.colab' in sys.modules:\n  %pip install -q x\n",
      "FAST = False\n",
      "!echo shell\nfrom IPython.display import Image\n"
      "display(Image('a.png'))\nprint('FAST is', FAST)\n",
  ])
  source = bench.notebook_source(path, fast=True)
  assert "%pip" not in source and "!echo" not in source
  assert "  pass" in source and "FAST = True" in source
  row = bench.run_notebook(path, tmp_path / "work", fast=True, timeout=60)
  assert row["exit"] == 0, row
  assert row["tail"][-1] == "FAST is True" and row["seconds"] > 0
  # Where IPython cannot be imported (shadowed here), `display` and
  # `IPython.display.Image` are the runner's stand-ins.
  hidden = tmp_path / "no_ipython"
  hidden.mkdir()
  (hidden / "IPython.py").write_text("raise ImportError('no IPython here')\n")
  row = bench.run_notebook(path, hidden, fast=True, timeout=60)
  assert row["exit"] == 0, row
  assert row["tail"][-2:] == ["<Image 'a.png'>", "FAST is True"]


def test_a_failing_notebook_reports_its_error_and_fast_needs_the_flag(
    tmp_path):
  bench = _module()
  path = _notebook(tmp_path / "bad.ipynb", ["raise RuntimeError('broken')\n"])
  row = bench.run_notebook(path, tmp_path / "work", fast=False, timeout=60)
  assert row["exit"] == 1 and "RuntimeError: broken" in row["tail"][-1]
  with pytest.raises(ValueError, match="FAST = False"):
    bench.notebook_source(path, fast=True)
  with pytest.raises(SystemExit):
    bench.main(["--only", "99_nothing"])
