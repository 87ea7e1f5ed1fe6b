"""Pictures of a denoising trajectory: which step committed each token.

`render_png` draws one row per sequence with one cell per completion slot,
coloured by the step that committed it and labelled with the token, with
block boundaries marked. `render_terminal` prints the same as ANSI-coloured
text. Both take the arrays `generate`/`denoise` return.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

_ANSI_COLOURS = (196, 208, 220, 46, 51, 33, 129, 201)


def _check(tokens, commit_step, block_size: int, first_position):
  tokens = np.asarray(tokens)
  commit_step = np.asarray(commit_step)
  if tokens.ndim != 2 or commit_step.shape != tokens.shape:
    raise ValueError(
        "tokens and commit_step must both have shape [batch, length], got"
        f" {tokens.shape} and {commit_step.shape}"
    )
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  if first_position is None:
    first_position = np.zeros(tokens.shape[0], np.int64)
  first_position = np.asarray(first_position)
  if first_position.shape != (tokens.shape[0],):
    raise ValueError(
        f"first_position must have shape [batch] = ({tokens.shape[0]},), got"
        f" {first_position.shape}"
    )
  return tokens, commit_step, first_position


def _local_steps(commit_step: np.ndarray) -> np.ndarray:
  """Steps renumbered from 0 per row (-1 stays -1)."""
  out = commit_step.copy()
  for row in range(commit_step.shape[0]):
    done = commit_step[row] >= 0
    if done.any():
      out[row, done] -= commit_step[row, done].min()
  return out


def render_terminal(
    tokens,
    commit_step,
    decode_token: Callable[[int], str],
    block_size: int,
    *,
    first_position=None,
    prompts: Sequence[str] | None = None,
) -> str:
  """ANSI-coloured text: each token's colour is its commit step (mod 8).

  Args:
    tokens: int [B, N] generated tokens.
    commit_step: int [B, N] step that committed each token (-1: never).
    decode_token: id -> text of one token.
    block_size: Block size, to draw `|` at block boundaries.
    first_position: Optional int [B] logical position of each row's first
      generated slot (default 0), so the bars follow the absolute block grid.
    prompts: Optional prompt text per row, printed first.

  Returns:
    The text, with a legend line.
  """
  tokens, commit_step, first_position = _check(
      tokens, commit_step, block_size, first_position
  )
  steps = _local_steps(commit_step)
  lines = []
  for row in range(tokens.shape[0]):
    parts = [prompts[row] if prompts is not None else ""]
    for i in range(tokens.shape[1]):
      if i and (first_position[row] + i) % block_size == 0:
        parts.append("\x1b[0m|")
      if steps[row, i] < 0:
        parts.append("\x1b[2m.\x1b[0m")
        continue
      colour = _ANSI_COLOURS[steps[row, i] % len(_ANSI_COLOURS)]
      parts.append(f"\x1b[38;5;{colour}m{decode_token(int(tokens[row, i]))}\x1b[0m")
    lines.append("".join(parts))
  lines.append("(colour = denoising step that committed the token; | = block boundary)")
  return "\n".join(lines)


def render_png(
    path: str,
    tokens,
    commit_step,
    decode_token: Callable[[int], str],
    block_size: int,
    *,
    first_position=None,
    row_labels: Sequence[str] | None = None,
    title: str | None = None,
) -> str:
  """Draws the trajectory as a PNG grid; returns `path`.

  Args:
    path: Output file.
    tokens: int [B, N] generated tokens.
    commit_step: int [B, N] commit steps (-1: never committed).
    decode_token: id -> text of one token.
    block_size: Block size; block boundaries are drawn as thick lines.
    first_position: Optional int [B] logical position of the first slot.
    row_labels: Optional label per row (e.g. the prompt).
    title: Optional figure title.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tokens, commit_step, first_position = _check(
      tokens, commit_step, block_size, first_position
  )
  steps = _local_steps(commit_step).astype(float)
  shown = np.where(steps < 0, np.nan, steps)
  rows, cols = tokens.shape
  fig, ax = plt.subplots(figsize=(max(6, 0.32 * cols + 2), 0.5 * rows + 1.5))
  cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
  image = ax.imshow(shown, aspect="auto", cmap=cmap, interpolation="nearest")
  for r in range(rows):
    for c in range(cols):
      if steps[r, c] >= 0:
        ax.text(c, r, decode_token(int(tokens[r, c])), ha="center", va="center",
                fontsize=7, color="white" if steps[r, c] < np.nanmax(shown) / 2 else "black")
    for c in range(1, cols):
      if (first_position[r] + c) % block_size == 0:
        ax.plot([c - 0.5, c - 0.5], [r - 0.5, r + 0.5], color="red", linewidth=2)
  ax.set_yticks(range(rows))
  ax.set_yticklabels(row_labels if row_labels is not None else [f"row {r}" for r in range(rows)], fontsize=7)
  ax.set_xlabel("generated slot (red lines: block boundaries)")
  fig.colorbar(image, ax=ax, label="denoising step of commit")
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
