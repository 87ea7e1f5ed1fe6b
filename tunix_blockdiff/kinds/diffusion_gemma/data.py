"""DiffusionGemma training rows and batches (`kinds.diffusion_gemma.objective`).

A row is `[prompt ; completion ; fill]` in whole canvases, each canvas
corrupted with uniform tokens at its own noise level (the objective's module
docstring has the semantics). Everything is a pure function of (seed, epoch,
example id).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import grain
import numpy as np

from tunix_blockdiff.data.examples import DataConfig
from tunix_blockdiff.data.examples import Example
from tunix_blockdiff.objective import corruption
from tunix_blockdiff.kinds.diffusion_gemma.objective import DiffusionGemmaObjective
from tunix_blockdiff.kinds.diffusion_gemma.objective import FIELDS


def encode_row(example: Example, objective: DiffusionGemmaObjective, *,
               seed: int, epoch: int, seq_len: int,
               pad_token_id: int) -> dict[str, np.ndarray]:
  """One training row (all fields [seq_len]; `sc_on` a bool scalar).

  Raises:
    ValueError: if not one whole canvas fits after the prompt.
  """
  c = objective.canvas_length
  p = example.prompt.size
  room = (seq_len - p) // c
  if room < 1:
    raise ValueError(
        f"example {example.example_id}: a {p}-token prompt leaves no room"
        f" for one canvas of {c} in seq_len={seq_len}"
    )
  canvases = min(room, -(-example.completion.size // c))
  body = np.full((canvases * c,), objective.fill_id, np.int32)
  kept = example.completion[:canvases * c]
  body[:kept.size] = kept
  n = p + body.size
  clean = np.full((seq_len,), pad_token_id, np.int32)
  clean[:p] = example.prompt
  clean[p:n] = body
  rng = corruption.row_rng(seed, epoch, example.example_id)
  level = rng.uniform(objective.min_noise, 1.0, size=canvases)
  replace = rng.random(body.size) < np.repeat(level, c)
  noise = rng.integers(0, objective.vocab_size, body.size)
  noisy = clean.copy()
  noisy[p:n] = np.where(replace, noise, body)
  idx = np.arange(seq_len)
  canvas_id = np.where((idx >= p) & (idx < n), (idx - p) // c, -1)
  return dict(
      clean=clean,
      noisy=noisy.astype(np.int32),
      positions=idx.astype(np.int32),
      valid=idx < n,
      canvas_id=canvas_id.astype(np.int32),
      canvas_start=np.where(canvas_id >= 0, p + canvas_id * c,
                            0).astype(np.int32),
      targets=clean,
      loss_weights=(canvas_id >= 0).astype(np.float32),
      sc_on=np.asarray(rng.random() < objective.self_conditioning_prob),
  )


def empty_row(seq_len: int, pad_token_id: int) -> dict[str, np.ndarray]:
  """A filler row: nothing valid, no target."""
  zeros = np.zeros((seq_len,), np.int32)
  return dict(
      clean=zeros + pad_token_id, noisy=zeros + pad_token_id,
      positions=np.arange(seq_len, dtype=np.int32),
      valid=np.zeros((seq_len,), bool), canvas_id=zeros - 1,
      canvas_start=zeros, targets=zeros + pad_token_id,
      loss_weights=np.zeros((seq_len,), np.float32), sc_on=np.asarray(False))


def stack(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in FIELDS}


def _check_data_config(data_config: DataConfig, objective) -> None:
  if data_config.packing != "none" or data_config.cp_size != 1:
    raise ValueError(
        "DiffusionGemma training takes one example per row: packing must be"
        " 'none' and cp_size 1"
    )
  if data_config.vocab_size != objective.vocab_size:
    raise ValueError(
        f"data vocab_size {data_config.vocab_size} != objective vocab_size"
        f" {objective.vocab_size}"
    )


class DiffusionGemmaBatches:
  """Re-iterable training batches, deterministic given `data_config.seed`.

  Each `iter()` starts from the beginning, so a resumed trainer that skips
  the batches it consumed sees what an uninterrupted run sees.
  """

  def __init__(self, examples: Sequence[Example],
               objective: DiffusionGemmaObjective, data_config: DataConfig):
    if not examples:
      raise ValueError("examples must not be empty")
    _check_data_config(data_config, objective)
    self.objective = objective
    self.data_config = data_config
    num = len(examples)
    ds = grain.MapDataset.source(
        examples if hasattr(examples, "__getitem__") else list(examples))
    if data_config.shuffle:
      ds = ds.shuffle(seed=data_config.seed)
    ds = ds.repeat(data_config.num_epochs)
    self.rows = ds.map_with_index(lambda i, ex: encode_row(
        ex, objective, seed=data_config.seed, epoch=i // num,
        seq_len=data_config.seq_len, pad_token_id=data_config.pad_token_id))

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    b = self.data_config.batch_size
    for start in range(0, len(self.rows) - b + 1, b):
      yield stack([self.rows[i] for i in range(start, start + b)])


def eval_batches(examples: Sequence[Example],
                 objective: DiffusionGemmaObjective,
                 data_config: DataConfig) -> list[dict[str, np.ndarray]]:
  """Every example once (epoch 0), the last batch filled with empty rows."""
  if not examples:
    raise ValueError("examples must not be empty")
  _check_data_config(data_config, objective)
  cfg = data_config
  rows = [encode_row(ex, objective, seed=cfg.seed, epoch=0,
                     seq_len=cfg.seq_len, pad_token_id=cfg.pad_token_id)
          for ex in examples]
  batches = []
  for start in range(0, len(rows), cfg.batch_size):
    chunk = rows[start:start + cfg.batch_size]
    chunk += [empty_row(cfg.seq_len, cfg.pad_token_id)] * (
        cfg.batch_size - len(chunk))
    batches.append(stack(chunk))
  return batches
