"""Training and evaluation batches from examples, through grain.

`document_dataset` is the grain MapDataset of encoded, corrupted documents in
training order (shuffled per epoch, repeated); `SFTBatches` groups it into
[B, L] batches (one document per row or packed); `eval_batches` gives fixed
evaluation batches; `left_padded_prompts` gives generation prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.data.examples import DataConfig
from tunix_blockdiff.data.examples import Example
from tunix_blockdiff.data.packing import document_start
from tunix_blockdiff.data.packing import assemble_rows
from tunix_blockdiff.data.packing import encode_document
from tunix_blockdiff.data.packing import reorder_batch


def document_dataset(
    examples: Sequence[Example],
    diffusion_config: config_lib.BlockDiffusionConfig,
    data_config: DataConfig,
) -> grain.MapDataset:
  """Grain MapDataset of encoded, corrupted documents in training order.

  Element i is example `order(i)` of epoch `i // len(examples)`; the shuffle
  differs per epoch and everything is a pure function of `data_config.seed`.
  """
  if not examples:
    raise ValueError("examples must not be empty")
  num = len(examples)
  seed = data_config.seed
  # A random-access sequence (a list, or `rows.FileExamples`, which reads
  # rows from files on access) is used as is, never copied into memory.
  ds = grain.MapDataset.source(
      examples if hasattr(examples, "__getitem__") else list(examples)
  )
  if data_config.shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(data_config.num_epochs)

  def encode(index, example):
    return encode_document(
        example,
        diffusion_config,
        seed=seed,
        epoch=index // num,
        fill_id=data_config.completion_fill_id,
        max_len=data_config.seq_len,
    )

  return ds.map_with_index(encode)


class SFTBatches:
  """Re-iterable training batches; each `iter()` starts from the beginning.

  Deterministic given `data_config.seed`, so a trainer that resumes by
  skipping the batches it already consumed sees exactly the data (order and
  corruption) an uninterrupted run sees.

  With several processes, `rows=(lo, hi)` makes each batch only the rows
  [lo, hi) of the global batch (`distributed.process_rows`): unpacked, a
  process then reads and corrupts only its own documents; packed, every
  process packs the global batch (first fit needs all its documents) and
  keeps its rows.
  """

  def __init__(
      self,
      examples: Sequence[Example],
      diffusion_config: config_lib.BlockDiffusionConfig,
      data_config: DataConfig,
      *,
      rows: tuple[int, int] | None = None,
  ):
    if rows is not None and not (
        0 <= rows[0] < rows[1] <= data_config.batch_size
    ):
      raise ValueError(
          "rows must be (lo, hi) with 0 <= lo < hi <= batch_size="
          f"{data_config.batch_size}, got {rows}"
      )
    self.rows = (0, data_config.batch_size) if rows is None else tuple(rows)
    if not isinstance(diffusion_config, config_lib.BlockDiffusionConfig):
      raise TypeError(
          "diffusion_config must be a BlockDiffusionConfig, got"
          f" {type(diffusion_config).__name__}"
      )
    if not isinstance(data_config, DataConfig):
      raise TypeError(
          f"data_config must be a DataConfig, got {type(data_config).__name__}"
      )
    if data_config.packing == "block_aligned" and (
        data_config.seq_len % diffusion_config.block_size
    ):
      raise ValueError(
          "packing='block_aligned' needs seq_len to be a multiple of"
          f" block_size={diffusion_config.block_size}, got"
          f" seq_len={data_config.seq_len}"
      )
    self.diffusion_config = diffusion_config
    self.data_config = data_config
    self.documents = document_dataset(examples, diffusion_config, data_config)

  def _finish(self, rows) -> dict[str, np.ndarray]:
    batch = assemble_rows(
        rows,
        seq_len=self.data_config.seq_len,
        block_size=self.diffusion_config.block_size,
        packing=self.data_config.packing,
        pad_token_id=self.data_config.pad_token_id,
    )
    return reorder_batch(batch, self.data_config.cp_size)

  def _unpacked(self) -> Iterator[dict[str, np.ndarray]]:
    batch_size = self.data_config.batch_size
    # Indexing the MapDataset (rather than its threaded iterator) keeps the
    # pipeline free of background work the trainer may never consume.
    for start in range(0, len(self.documents) - batch_size + 1, batch_size):
      lo, hi = self.rows
      yield self._finish(
          [[self.documents[i]] for i in range(start + lo, start + hi)]
      )

  def _packed(self) -> Iterator[dict[str, np.ndarray]]:
    cfg = self.data_config
    block_size = self.diffusion_config.block_size
    rows: list[list] = [[] for _ in range(cfg.batch_size)]
    ends = [0] * cfg.batch_size
    for i in range(len(self.documents)):
      doc = self.documents[i]
      n = doc["tokens"].size
      # First fit: the first row with room; a document that fits nowhere
      # closes the batch and opens the next one.
      row = next(
          (
              r
              for r in range(cfg.batch_size)
              if document_start(ends[r], block_size, cfg.packing) + n
              <= cfg.seq_len
          ),
          None,
      )
      if row is None:
        yield self._finish(rows[self.rows[0] : self.rows[1]])
        rows = [[] for _ in range(cfg.batch_size)]
        ends = [0] * cfg.batch_size
        row = 0
      rows[row].append(doc)
      ends[row] = document_start(ends[row], block_size, cfg.packing) + n
    # A final partial batch is dropped, as drop_remainder does unpacked.

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    if self.data_config.packing == "none":
      return self._unpacked()
    return self._packed()


def eval_batches(
    examples: Sequence[Example],
    diffusion_config: config_lib.BlockDiffusionConfig,
    data_config: DataConfig,
) -> list[dict[str, np.ndarray]]:
  """Fixed evaluation batches: every example exactly once, in order.

  Corruption uses (data_config.seed, epoch 0). The last batch is filled with
  empty rows (no valid slot, no target), so all batches share one shape and,
  because the loss is a token-weighted sum, the filler changes nothing.

  Returns:
    A list of batch dicts ([B, L] fields).
  """
  if not examples:
    raise ValueError("examples must not be empty")
  cfg = dataclasses.replace(data_config, packing="none")
  docs = [
      encode_document(
          ex,
          diffusion_config,
          seed=cfg.seed,
          epoch=0,
          fill_id=cfg.completion_fill_id,
          max_len=cfg.seq_len,
      )
      for ex in examples
  ]
  batches = []
  for start in range(0, len(docs), cfg.batch_size):
    chunk = [[d] for d in docs[start : start + cfg.batch_size]]
    chunk += [[] for _ in range(cfg.batch_size - len(chunk))]
    batch = assemble_rows(
        chunk,
        seq_len=cfg.seq_len,
        block_size=diffusion_config.block_size,
        pad_token_id=cfg.pad_token_id,
    )
    batches.append(reorder_batch(batch, cfg.cp_size))
  return batches


def left_padded_prompts(
    examples: Sequence[Example], pad_token_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Prompts for generation: int32 [B, P] left-padded, int32 [B] lengths."""
  lengths = np.asarray([ex.prompt.size for ex in examples], np.int32)
  width = max(1, int(lengths.max(initial=0)))
  prompts = np.full((len(examples), width), pad_token_id, np.int32)
  for b, ex in enumerate(examples):
    if ex.prompt.size:
      prompts[b, width - ex.prompt.size :] = ex.prompt
  return prompts, lengths


def num_target_tokens(batches: Iterable[Mapping[str, np.ndarray]]) -> int:
  """Total training targets (slots with a positive loss weight)."""
  return int(sum(np.sum(np.asarray(b["loss_weights"]) > 0) for b in batches))
