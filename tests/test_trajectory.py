"""Tests for the trajectory renderers."""

import numpy as np
import pytest

from tunix_blockdiff import trajectory


def _decode(i):
  return "abcdefghij"[i % 10]


def test_terminal_marks_blocks_and_steps():
  tokens = np.array([[1, 2, 3, 4, 5, 6]])
  steps = np.array([[5, 5, 6, 7, 7, -1]])
  text = trajectory.render_terminal(tokens, steps, _decode, 4, first_position=[2])
  first = text.splitlines()[0]
  # Logical positions 2..7: the boundary falls before the third slot.
  assert first.count("|") == 1
  assert first.index("|") > first.index("b") and first.index("|") < first.index("d")
  # Steps are renumbered per row: step 5 -> colour 0, 7 -> colour 2.
  assert "38;5;196mb" in first and "38;5;220me" in first
  # The never-committed slot is dimmed.
  assert "\x1b[2m.\x1b[0m" in first


def test_png_is_written(tmp_path):
  tokens = np.arange(16).reshape(2, 8)
  steps = np.tile(np.arange(8) // 2, (2, 1))
  path = trajectory.render_png(str(tmp_path / "t.png"), tokens, steps, _decode, 4)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_shape_errors():
  with pytest.raises(ValueError, match="commit_step"):
    trajectory.render_terminal(np.zeros((1, 3)), np.zeros((1, 4)), _decode, 2)
  with pytest.raises(ValueError, match="block_size"):
    trajectory.render_terminal(np.zeros((1, 3)), np.zeros((1, 3)), _decode, 0)
  with pytest.raises(ValueError, match="first_position"):
    trajectory.render_terminal(
        np.zeros((1, 3)), np.zeros((1, 3)), _decode, 2, first_position=[0, 1]
    )
