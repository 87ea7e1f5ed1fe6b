"""Each notebook runs top to bottom with its tiny CPU configuration."""

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
  # The committed notebooks select the tiny CPU configuration.
  assert any("USE_TPU = False" in cell.source for cell in notebook.cells)
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
