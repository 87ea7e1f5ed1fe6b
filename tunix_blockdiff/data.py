"""Data pipeline: prompt/completion examples -> block-diffusion batches.

The flow is one way (DESIGN.md section 3):

  examples (token ids) -> validated `Example`s -> grain MapDataset
  (shuffle per epoch, repeat) -> per-document encoding and seeded corruption
  -> rows (one document per row, or packed) -> [B, L] batch dicts
  -> optional load-balanced context-parallel reordering.

Each document is corrupted on its own, with randomness that is a pure function
of (seed, epoch, example id) (`objective.corruption.corrupt`), so the noise a
document gets does not depend on which row it lands in, what it is packed
with, or whether the run was resumed. Batches are NumPy dicts whose fields are
listed in `BATCH_FIELDS`; `BlockDiffusionTrainer` consumes them directly.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import grain
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.objective import corruption

PACKINGS = ("none", "block_aligned", "unaligned")

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


def _check_int(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How examples become batches.

  Attributes:
    seq_len: Row length L.
    batch_size: Rows per batch B.
    vocab_size: Every token id must lie in [0, vocab_size).
    seed: Seeds the per-epoch shuffle and the corruption.
    packing: `none` (one document per row), `block_aligned` (several
      documents per row, each starting at a multiple of the block size, so
      physical and logical blocks coincide), or `unaligned` (documents packed
      back to back; masks follow per-document logical positions).
    cp_size: Context-parallel shards; > 1 reorders every batch into the
      load-balanced order (1 or even, `seq_len % (2 * cp_size) == 0`).
    pad_token_id: Token id written at padding slots.
    shuffle: Shuffle the examples (differently in every epoch).
    num_epochs: Passes over the data; None repeats forever.
    completion_fill_id: If set (usually the EOS id), every completion is
      extended with this token up to the end of its last block (capped at
      `seq_len`), as supervised completion slots. At inference the block
      holding EOS has masked slots after it; without the fill, training never
      shows the model such a block (the slots after EOS were padding, not
      even visible), so it keeps writing content instead of ending.
  """

  seq_len: int
  batch_size: int
  vocab_size: int
  seed: int = 0
  packing: str = "none"
  cp_size: int = 1
  pad_token_id: int = 0
  shuffle: bool = True
  num_epochs: int | None = None
  completion_fill_id: int | None = None

  def __post_init__(self):
    _check_int("seq_len", self.seq_len, 1)
    _check_int("batch_size", self.batch_size, 1)
    _check_int("vocab_size", self.vocab_size, 1)
    _check_int("seed", self.seed, 0)
    if self.packing not in PACKINGS:
      raise ValueError(
          f"packing must be one of {PACKINGS}, got {self.packing!r}"
      )
    _check_int("cp_size", self.cp_size, 1)
    # Raises a clear error for an odd cp_size or an indivisible seq_len.
    context_parallel.load_balance_order(self.seq_len, self.cp_size)
    _check_int("pad_token_id", self.pad_token_id, 0)
    if self.pad_token_id >= self.vocab_size:
      raise ValueError(
          f"pad_token_id must be < vocab_size={self.vocab_size}, got"
          f" {self.pad_token_id}"
      )
    if self.num_epochs is not None:
      _check_int("num_epochs", self.num_epochs, 1)
    if self.completion_fill_id is not None:
      _check_int("completion_fill_id", self.completion_fill_id, 0)
      if self.completion_fill_id >= self.vocab_size:
        raise ValueError(
            f"completion_fill_id must be < vocab_size={self.vocab_size}, got"
            f" {self.completion_fill_id}"
        )


class Example(NamedTuple):
  """One validated prompt/completion pair.

  Attributes:
    prompt: int32 [P] prompt ids (may be empty).
    completion: int32 [C] completion ids, C >= 1.
    example_id: Stable identity; with (seed, epoch) it fixes the corruption.
  """

  prompt: np.ndarray
  completion: np.ndarray
  example_id: int


def _ids(name: str, value, index: int) -> np.ndarray:
  array = np.asarray(value)
  if array.size == 0:
    return np.zeros((0,), np.int32)
  if array.ndim != 1:
    raise ValueError(
        f"example {index}: {name} must be a 1-D sequence of token ids, got"
        f" shape {array.shape}"
    )
  if not np.issubdtype(array.dtype, np.integer):
    raise TypeError(
        f"example {index}: {name} must hold integer token ids, got dtype"
        f" {array.dtype}"
    )
  return array.astype(np.int64)


def as_examples(
    raw: Iterable[Any],
    *,
    seq_len: int,
    vocab_size: int,
    mask_token_id: int | None = None,
) -> list[Example]:
  """Validates prompt/completion pairs and gives each a stable id.

  Args:
    raw: Pairs `(prompt_ids, completion_ids)` or mappings with keys `prompt`
      and `completion`; ids are int sequences. The i-th item gets id i.
    seq_len: Row length; prompt + completion must fit.
    vocab_size: Ids must lie in [0, vocab_size).
    mask_token_id: If given, the mask token may not appear in the data (a
      clean slot holding it would read as a masked one).

  Returns:
    A list of `Example`.

  Raises:
    ValueError: An example is longer than `seq_len`, has an empty completion,
      or holds an id outside the vocabulary (or the mask token).
  """
  examples = []
  for index, item in enumerate(raw):
    if isinstance(item, Mapping):
      if "prompt" not in item or "completion" not in item:
        raise ValueError(
            f"example {index}: a mapping needs keys 'prompt' and 'completion'"
        )
      prompt, completion = item["prompt"], item["completion"]
    else:
      try:
        prompt, completion = item
      except (TypeError, ValueError):
        raise ValueError(
            f"example {index}: expected (prompt_ids, completion_ids), got"
            f" {type(item).__name__}"
        ) from None
    prompt = _ids("prompt", prompt, index)
    completion = _ids("completion", completion, index)
    if completion.size == 0:
      raise ValueError(
          f"example {index}: completion is empty; every example needs at"
          " least one completion token to train on"
      )
    length = prompt.size + completion.size
    if length > seq_len:
      raise ValueError(
          f"example {index} has {length} tokens (prompt {prompt.size} +"
          f" completion {completion.size}), longer than seq_len={seq_len}"
      )
    for name, ids in (("prompt", prompt), ("completion", completion)):
      bad = ids[(ids < 0) | (ids >= vocab_size)]
      if bad.size:
        raise ValueError(
            f"example {index}: {name} token id {int(bad[0])} is outside the"
            f" vocabulary [0, {vocab_size})"
        )
      if mask_token_id is not None and np.any(ids == mask_token_id):
        raise ValueError(
            f"example {index}: {name} contains the mask token id"
            f" {mask_token_id}, which clean data must not use"
        )
    examples.append(
        Example(prompt.astype(np.int32), completion.astype(np.int32), index)
    )
  return examples


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


def _doc_start(end: int, block_size: int, packing: str) -> int:
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
      start = _doc_start(end, block_size, packing)
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
  ds = grain.MapDataset.source(list(examples))
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
  """

  def __init__(
      self,
      examples: Sequence[Example],
      diffusion_config: config_lib.BlockDiffusionConfig,
      data_config: DataConfig,
  ):
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
      yield self._finish(
          [[self.documents[i]] for i in range(start, start + batch_size)]
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
              if _doc_start(ends[r], block_size, cfg.packing) + n <= cfg.seq_len
          ),
          None,
      )
      if row is None:
        yield self._finish(rows)
        rows = [[] for _ in range(cfg.batch_size)]
        ends = [0] * cfg.batch_size
        row = 0
      rows[row].append(doc)
      ends[row] = _doc_start(ends[row], block_size, cfg.packing) + n
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


__all__ = [
    "BATCH_FIELDS",
    "DataConfig",
    "Example",
    "PACKINGS",
    "SFTBatches",
    "as_examples",
    "assemble_rows",
    "document_dataset",
    "encode_document",
    "eval_batches",
    "left_padded_prompts",
    "num_target_tokens",
    "reorder_batch",
    "two_stream_batch",
]
