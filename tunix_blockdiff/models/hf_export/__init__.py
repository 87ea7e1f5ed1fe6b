"""Tunix models -> Hugging Face model directories (the loaders' inverse).

| module     | what                                                            |
|------------|-----------------------------------------------------------------|
| `families` | per family: parameter -> HF tensors, `ModelConfig` -> config.json |
| `writer`   | `save_hf` (any family, sharded safetensors), `save_qwen3_hf`    |

What `save_hf` writes loads through `checkpoints.load_hf` (Tunix's own
safetensors loaders) as the same model, e.g. as `model.kind: <family>_hf`.
"""

from tunix_blockdiff.models.hf_export.families import FAMILIES
from tunix_blockdiff.models.hf_export.families import family_of_model
from tunix_blockdiff.models.hf_export.families import gemma3_hf_config
from tunix_blockdiff.models.hf_export.families import gemma3_param_to_hf
from tunix_blockdiff.models.hf_export.families import llama3_hf_config
from tunix_blockdiff.models.hf_export.families import qwen2_hf_config
from tunix_blockdiff.models.hf_export.families import qwen2_param_to_hf
from tunix_blockdiff.models.hf_export.families import qwen3_hf_config
from tunix_blockdiff.models.hf_export.families import qwen3_param_to_hf
from tunix_blockdiff.models.hf_export.writer import DEFAULT_MAX_SHARD_BYTES
from tunix_blockdiff.models.hf_export.writer import hf_tensors
from tunix_blockdiff.models.hf_export.writer import INDEX_FILE
from tunix_blockdiff.models.hf_export.writer import parse_size
from tunix_blockdiff.models.hf_export.writer import plan_shards
from tunix_blockdiff.models.hf_export.writer import save_hf
from tunix_blockdiff.models.hf_export.writer import save_qwen3_hf
from tunix_blockdiff.models.hf_export.writer import SINGLE_FILE
from tunix_blockdiff.models.hf_export.writer import TOKENIZER_FILES
from tunix_blockdiff.models.hf_export.writer import tokenizer_files
from tunix_blockdiff.models.hf_export.writer import write_safetensors

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FAMILIES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "TOKENIZER_FILES",
    "family_of_model",
    "gemma3_hf_config",
    "gemma3_param_to_hf",
    "hf_tensors",
    "llama3_hf_config",
    "parse_size",
    "plan_shards",
    "qwen2_hf_config",
    "qwen2_param_to_hf",
    "qwen3_hf_config",
    "qwen3_param_to_hf",
    "save_hf",
    "save_qwen3_hf",
    "tokenizer_files",
    "write_safetensors",
]
