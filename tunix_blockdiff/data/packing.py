"""Documents and rows: one example encoded and corrupted, rows laid out.

`encode_document` corrupts one example with randomness that is a pure function
of (seed, epoch, example id); `assemble_rows` lays documents out in [B, L]
rows (one per row or packed); `reorder_batch` applies the load-balanced
context-parallel order; `two_stream_batch` gives the BD3-LM `[x0 | xt]` view.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.data.examples import Example
from tunix_blockdiff.objective import corruption

# Every field of a training batch, all [B, L]:
#   tokens          int32  clean tokens (pad id at padding)
#   inputs          int32  the corrupted canvas the model sees
#   targets         int32  clean token each slot must predict (== tokens)
#   positions       int32  logical positions (restart at 0 per document)
#   segment_ids     int32  document id within the row (1, 2, ...; 0 = padding)
#   validity        bool   real (non-padding) slots
#   completion      bool   slots the model must generate (prompt protected)
#   corruption_mask bool   slots replaced by the mask token
#   loss_mask       bool   slots whose clean token is a training target
#   loss_weights    float32 per-target weight (0 off-target)
BATCH_FIELDS = (
    "tokens",
    "inputs",
    "targets",
    "positions",
    "segment_ids",
    "validity",
    "completion",
    "corruption_mask",
    "loss_mask",
    "loss_weights",
)

_DOC_FIELDS = (
    "tokens",
    "inputs",
    "completion",
    "corruption_mask",
    "loss_mask",
    "loss_weights",
)
_DTYPES = {
    "tokens": np.int32,
    "inputs": np.int32,
    "targets": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "validity": np.bool_,
    "completion": np.bool_,
    "corruption_mask": np.bool_,
    "loss_mask": np.bool_,
    "loss_weights": np.float32,
}


def encode_document(
    example: Example,
    diffusion_config: config_lib.BlockDiffusionConfig,
    *,
    seed: int,
    epoch: int,
    fill_id: int | None = None,
    max_len: int | None = None,
) -> dict[str, np.ndarray]:
  """One example as an unpadded document, corrupted with its own seed.

  Args:
    example: The example.
    diffusion_config: The objective (block size, canvas, stream, weights).
    seed: Run seed.
    epoch: Epoch index of this pass over the data.
    fill_id: Optional id appended to the completion up to the end of its
      last block (see `DataConfig.completion_fill_id`).
    max_len: Cap on the filled length (the row length).

  Returns:
    Dict of [n] arrays (n = prompt + completion (+ fill) length): `tokens`,
    `inputs`, `completion`, `corruption_mask`, `loss_mask`, `loss_weights`.
  """
  tokens = np.concatenate([example.prompt, example.completion])
  if fill_id is not None:
    block = diffusion_config.block_size
    target = -(-tokens.size // block) * block
    if max_len is not None:
      target = max(min(target, max_len), tokens.size)
    tokens = np.concatenate(
        [tokens, np.full(target - tokens.size, fill_id, tokens.dtype)]
    )
  completion = np.zeros(tokens.shape, bool)
  completion[example.prompt.size :] = True
  result = corruption.corrupt(
      tokens[None],
      np.ones((1, tokens.size), bool),
      completion[None],
      diffusion_config,
      seed=seed,
      epoch=epoch,
      example_ids=np.asarray([example.example_id]),
  )
  return {
      "tokens": tokens,
      "inputs": result.inputs[0],
      "completion": completion,
      "corruption_mask": result.corruption_mask[0],
      "loss_mask": result.loss_mask[0],
      "loss_weights": result.loss_weights[0],
  }


def document_start(end: int, block_size: int, packing: str) -> int:
  if packing == "block_aligned":
    return -(-end // block_size) * block_size
  return end


def assemble_rows(
    rows: Sequence[Sequence[Mapping[str, np.ndarray]]],
    *,
    seq_len: int,
    block_size: int,
    packing: str = "none",
    pad_token_id: int = 0,
) -> dict[str, np.ndarray]:
  """Lays documents out in rows of length L.

  Row b holds `rows[b]` in order; document j of a row gets segment id j + 1
  and logical positions 0..n-1. Under `block_aligned` each document starts at
  a multiple of `block_size`. Padding has validity False, segment id 0, the
  pad token, and (harmlessly, it is never attended) its physical index as
  position, so an unpacked row has positions `arange(L)`.

  Args:
    rows: B lists of documents from `encode_document` (a list may be empty).
    seq_len: L.
    block_size: Block size (used by `block_aligned`).
    packing: One of `PACKINGS` (`none` allows one document per row).
    pad_token_id: Id at padding slots.

  Returns:
    Batch dict with the fields of `BATCH_FIELDS`, each [B, L].
  """
  batch_size = len(rows)
  shape = (batch_size, seq_len)
  out = {name: np.zeros(shape, dtype) for name, dtype in _DTYPES.items()}
  out["tokens"][:] = pad_token_id
  out["inputs"][:] = pad_token_id
  out["positions"][:] = np.arange(seq_len, dtype=np.int32)
  for b, docs in enumerate(rows):
    if packing == "none" and len(docs) > 1:
      raise ValueError(
          f"packing='none' allows one document per row, got {len(docs)}"
      )
    end = 0
    for j, doc in enumerate(docs):
      n = doc["tokens"].size
      start = document_start(end, block_size, packing)
      if start + n > seq_len:
        raise ValueError(
            f"row {b}: documents need {start + n} slots, more than"
            f" seq_len={seq_len}"
        )
      span = slice(start, start + n)
      for name in _DOC_FIELDS:
        out[name][b, span] = doc[name]
      out["positions"][b, span] = np.arange(n)
      out["segment_ids"][b, span] = j + 1
      out["validity"][b, span] = True
      end = start + n
  out["targets"] = out["tokens"].copy()
  return out


def reorder_batch(batch: Mapping[str, np.ndarray], cp_size: int) -> dict:
  """Load-balanced context-parallel order for every [B, L] field."""
  if cp_size == 1:
    return dict(batch)
  return context_parallel.reorder_batch_for_context_parallel(batch, cp_size)


def two_stream_batch(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The two-stream (BD3-LM) view of a batch: `[x0 | xt]`, all [B, 2L].

  For losses written against the concatenated sequence; use with
  `attention.masks.two_stream_mask(batch["positions"], ...)` on the first
  half's positions. `BlockDiffusionTrainer` builds the same arrays on device
  from the [B, L] batch, so it does not need this.

  Args:
    batch: A batch from this module ([B, L] fields).

  Returns:
    Dict with `tokens`, `positions`, `segment_ids`, `validity`, `is_noised`,
    `targets`, `loss_weights`, each [B, 2L].
  """
  result = corruption.CorruptionResult(
      inputs=np.asarray(batch["inputs"]),
      corruption_mask=np.asarray(batch["corruption_mask"]),
      loss_mask=np.asarray(batch["loss_mask"]),
      loss_weights=np.asarray(batch["loss_weights"]),
      noise_rate=np.zeros(np.shape(batch["inputs"]), np.float32),
  )
  inputs = corruption.build_two_stream_inputs(
      batch["tokens"],
      result,
      batch["validity"],
      positions=batch["positions"],
      segment_ids=batch["segment_ids"],
  )
  return inputs._asdict()
