"""Tiny Tunix models built in code, for tests, the CPU recipes and benchmarks.

Built with the model constructors (not `create_dummy_model`, which randomises
the norm weights), in float32, with the default (unsharded) configuration.
"""

from __future__ import annotations

from flax import nnx
import jax.numpy as jnp
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib


def qwen3_config(
    vocab_size: int = 64,
    *,
    num_layers: int = 2,
    embed_dim: int = 32,
    hidden_dim: int = 64,
    num_heads: int = 4,
    head_dim: int = 8,
    num_kv_heads: int = 2,
    use_flash_attention: bool = False,
    flash_attention_block_size: int = 1024,
) -> qwen3_lib.ModelConfig:
  """A small Qwen3 `ModelConfig` (float32, untied embeddings)."""
  return qwen3_lib.ModelConfig(
      num_layers=num_layers,
      vocab_size=vocab_size,
      embed_dim=embed_dim,
      hidden_dim=hidden_dim,
      num_heads=num_heads,
      head_dim=head_dim,
      num_kv_heads=num_kv_heads,
      rope_theta=10_000,
      norm_eps=1e-6,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      use_flash_attention=use_flash_attention,
      flash_attention_block_size=flash_attention_block_size,
  )


def tiny_qwen3(vocab_size: int = 64, *, seed: int = 0, **kwargs) -> qwen3_lib.Qwen3:
  """A randomly initialised tiny Tunix Qwen3."""
  return qwen3_lib.Qwen3(qwen3_config(vocab_size, **kwargs), rngs=nnx.Rngs(seed))


def tiny_qwen2(
    vocab_size: int = 64,
    *,
    seed: int = 0,
    num_layers: int = 2,
    embed_dim: int = 32,
    hidden_dim: int = 64,
    num_heads: int = 4,
    head_dim: int = 8,
    num_kv_heads: int = 2,
    use_flash_attention: bool = False,
    flash_attention_block_size: int = 1024,
) -> qwen2_lib.Qwen2:
  """A randomly initialised tiny Tunix Qwen2."""
  config = qwen2_lib.ModelConfig(
      num_layers=num_layers,
      vocab_size=vocab_size,
      embed_dim=embed_dim,
      hidden_dim=hidden_dim,
      num_heads=num_heads,
      head_dim=head_dim,
      num_kv_heads=num_kv_heads,
      rope_theta=10_000,
      norm_eps=1e-6,
      use_flash_attention=use_flash_attention,
      flash_attention_block_size=flash_attention_block_size,
  )
  return qwen2_lib.Qwen2(config, rngs=nnx.Rngs(seed))


def tiny_llama3(
    vocab_size: int = 64,
    *,
    seed: int = 0,
    num_layers: int = 2,
    embed_dim: int = 32,
    hidden_dim: int = 64,
    num_heads: int = 4,
    head_dim: int = 8,
    num_kv_heads: int = 2,
) -> llama3_lib.Llama3:
  """A randomly initialised tiny Tunix Llama3."""
  config = llama3_lib.ModelConfig(
      num_layers=num_layers,
      vocab_size=vocab_size,
      embed_dim=embed_dim,
      hidden_dim=hidden_dim,
      num_heads=num_heads,
      head_dim=head_dim,
      num_kv_heads=num_kv_heads,
      rope_theta=500_000,
      norm_eps=1e-5,
  )
  return llama3_lib.Llama3(config, rngs=nnx.Rngs(seed))
