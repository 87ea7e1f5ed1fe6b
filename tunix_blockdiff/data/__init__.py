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

Modules:
  examples: `DataConfig`, `Example`, validation (`as_examples`).
  packing: one document encoded and corrupted; rows; CP order; two streams.
  batches: grain datasets, `SFTBatches`, `eval_batches`, generation prompts.
  sources: rows of jsonl, parquet and `save_to_disk` files by random access
    (`open_source`, `read_rows`).
  rows: row forms (prompt/completion, chat messages, text) -> token ids;
    `FileExamples`, the validated examples of a file source.
"""

from tunix_blockdiff.data.batches import SFTBatches
from tunix_blockdiff.data.batches import document_dataset
from tunix_blockdiff.data.batches import eval_batches
from tunix_blockdiff.data.batches import left_padded_prompts
from tunix_blockdiff.data.batches import num_target_tokens
from tunix_blockdiff.data.examples import DataConfig
from tunix_blockdiff.data.examples import Example
from tunix_blockdiff.data.examples import PACKINGS
from tunix_blockdiff.data.examples import as_examples
from tunix_blockdiff.data.examples import validate_example
from tunix_blockdiff.data.packing import BATCH_FIELDS
from tunix_blockdiff.data.packing import assemble_rows
from tunix_blockdiff.data.packing import encode_document
from tunix_blockdiff.data.packing import reorder_batch
from tunix_blockdiff.data.packing import two_stream_batch
from tunix_blockdiff.data.rows import FileExamples
from tunix_blockdiff.data.rows import RowFields
from tunix_blockdiff.data.rows import encode_row
from tunix_blockdiff.data.sources import RowError
from tunix_blockdiff.data.sources import open_source
from tunix_blockdiff.data.sources import read_rows

__all__ = [
    "BATCH_FIELDS",
    "DataConfig",
    "Example",
    "FileExamples",
    "PACKINGS",
    "RowError",
    "RowFields",
    "SFTBatches",
    "as_examples",
    "assemble_rows",
    "document_dataset",
    "encode_document",
    "encode_row",
    "eval_batches",
    "left_padded_prompts",
    "num_target_tokens",
    "open_source",
    "read_rows",
    "reorder_batch",
    "two_stream_batch",
    "validate_example",
]
