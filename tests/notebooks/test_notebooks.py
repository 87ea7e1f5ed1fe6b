"""Each notebook runs top to bottom with its short (FAST) configuration."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted(
    (pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb")
)


def test_there_are_notebooks():
  assert [p.name for p in NOTEBOOKS] == [
      "01_sft.ipynb", "02_generation.ipynb", "03_rl_opd.ipynb"
  ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu(path, tmp_path):
  # The kernel inherits the run's compilation cache through the environment
  # (conftest): 01 and 02 train the same tiny model.
  notebook = nbformat.read(path, as_version=4)
  # The committed notebooks run their full default (a working model in a
  # few minutes); the test flips the parameters cell to the short variant.
  params = [cell for cell in notebook.cells if "FAST = False" in cell.source]
  assert len(params) == 1
  assert "MODEL_DIR" not in params[0].source or (
      "MODEL_DIR = None" in params[0].source)
  params[0].source = params[0].source.replace("FAST = False", "FAST = True")
  client = nbclient.NotebookClient(
      notebook,
      timeout=300,
      kernel_name="python3",
      resources={"metadata": {"path": str(tmp_path)}},
  )
  client.execute()
  errors = [
      output
      for cell in notebook.cells
      if cell.cell_type == "code"
      for output in cell.get("outputs", [])
      if output.get("output_type") == "error"
  ]
  assert not errors
