"""Loads a script of `tools/` as `python tools/NAME.py` runs it."""

import importlib
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def load_tool(monkeypatch):
  """`load_tool(name)`: the module tools/NAME.py, its folder on the path."""
  monkeypatch.syspath_prepend(str(TOOLS))

  def load(name: str):
    return importlib.import_module(name)

  return load
