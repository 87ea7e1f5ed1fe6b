"""Tiny Tunix models built in code, for tests, the CPU recipes and benchmarks.

One `<family>_config` and one `tiny_<family>` per Tunix causal LM family
(Qwen3, Qwen2, Llama3, Gemma3), and `tiny_diffusion_gemma`. Built with the model constructors (not
`create_dummy_model`, which randomises the norm weights), in float32, with the
default (unsharded) configuration.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import diffusion_gemma as dg


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


def qwen2_config(
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
) -> qwen2_lib.ModelConfig:
  """A small Qwen2 `ModelConfig` (float32, untied embeddings, q/k/v biases)."""
  return qwen2_lib.ModelConfig(
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


def llama3_config(
    vocab_size: int = 64,
    *,
    num_layers: int = 2,
    embed_dim: int = 32,
    hidden_dim: int = 64,
    num_heads: int = 4,
    head_dim: int = 8,
    num_kv_heads: int = 2,
) -> llama3_lib.ModelConfig:
  """A small Llama3 `ModelConfig` (float32 parameters, untied embeddings)."""
  return llama3_lib.ModelConfig(
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


def gemma3_config(
    vocab_size: int = 64,
    *,
    num_layers: int = 6,
    embed_dim: int = 32,
    hidden_dim: int = 64,
    num_heads: int = 4,
    head_dim: int = 8,
    num_kv_heads: int = 2,
    sliding_window_size: int = 512,
) -> gemma3_lib.ModelConfig:
  """A small text-only Gemma3 `ModelConfig` (float32, tied embeddings).

  Tunix's Gemma3 repeats five sliding-window layers and one global layer, so
  the default 6 layers hold both kinds.
  """
  return gemma3_lib.ModelConfig(
      num_layers=num_layers,
      num_embed=vocab_size,
      embed_dim=embed_dim,
      hidden_dim=hidden_dim,
      num_heads=num_heads,
      head_dim=head_dim,
      num_kv_heads=num_kv_heads,
      sliding_window_size=sliding_window_size,
      local_base_frequency=10_000,
      global_base_frequency=1_000_000,
      param_dtype=jnp.float32,
  )


def random_mlps(model, seed: int = 0, *, out_scale: float = 1.0):
  """Draws every feed-forward kernel from a LeCun normal, in place.

  Tunix (0.1.7) initialises the gate, up and down kernels of all four
  families to zero: a saddle point where none of them receives a gradient,
  so a model trained from scratch keeps its feed-forward layers at zero
  forever. Pretrained checkpoints are unaffected.

  `out_scale` multiplies the down (output) projection's draw. At 0 the
  gate and up kernels are drawn and the down kernel starts at zero: every
  feed-forward block starts as the identity of the residual stream (the
  common zero-init of a residual branch's output), which is no saddle (the
  down kernel's gradient is the drawn hidden activation) and, on the
  tuning tasks of `benchmarks/default_recipe.py`, learns small tasks far
  faster than a full LeCun draw (docs/sft_data.md).

  Args:
    model: A Tunix model whose layers have `mlp.{gate,up,down}_proj`.
    seed: Seed of the draw.
    out_scale: Scale of the down projection's draw (>= 0).

  Returns:
    The model.
  """
  if out_scale < 0:
    raise ValueError(f"out_scale must be >= 0, got {out_scale}")
  init = jax.nn.initializers.lecun_normal()
  key = jax.random.key(seed)
  scales = (1.0, 1.0, float(out_scale))
  for i, layer in enumerate(model.layers):
    for j, name in enumerate(("gate_proj", "up_proj", "down_proj")):
      kernel = getattr(layer.mlp, name).kernel
      kernel.value = scales[j] * init(
          jax.random.fold_in(key, 3 * i + j),
          kernel.value.shape,
          kernel.value.dtype,
      )
  return model


def _build(model_type, config, seed: int, random_mlp: bool,
           mlp_out_scale: float = 1.0):
  model = model_type(config, rngs=nnx.Rngs(seed))
  if not random_mlp:
    return model
  return random_mlps(model, seed, out_scale=mlp_out_scale)


def tiny_qwen3(
    vocab_size: int = 64, *, seed: int = 0, random_mlp: bool = False,
    mlp_out_scale: float = 1.0, **kwargs
) -> qwen3_lib.Qwen3:
  """A randomly initialised tiny Tunix Qwen3 (`qwen3_config` kwargs).

  With `random_mlp` its feed-forward kernels are drawn by `random_mlps`
  (the down projection's draw scaled by `mlp_out_scale`) instead of
  Tunix's zeros (the same holds for every `tiny_*`).
  """
  return _build(
      qwen3_lib.Qwen3, qwen3_config(vocab_size, **kwargs), seed, random_mlp,
      mlp_out_scale
  )


def tiny_qwen2(
    vocab_size: int = 64, *, seed: int = 0, random_mlp: bool = False,
    mlp_out_scale: float = 1.0, **kwargs
) -> qwen2_lib.Qwen2:
  """A randomly initialised tiny Tunix Qwen2 (`qwen2_config` kwargs)."""
  return _build(
      qwen2_lib.Qwen2, qwen2_config(vocab_size, **kwargs), seed, random_mlp,
      mlp_out_scale
  )


def tiny_llama3(
    vocab_size: int = 64, *, seed: int = 0, random_mlp: bool = False,
    mlp_out_scale: float = 1.0, **kwargs
) -> llama3_lib.Llama3:
  """A randomly initialised tiny Tunix Llama3 (`llama3_config` kwargs)."""
  return _build(
      llama3_lib.Llama3, llama3_config(vocab_size, **kwargs), seed, random_mlp,
      mlp_out_scale
  )


def tiny_gemma3(
    vocab_size: int = 64, *, seed: int = 0, random_mlp: bool = False,
    mlp_out_scale: float = 1.0, **kwargs
) -> gemma3_lib.Gemma3:
  """A randomly initialised tiny Tunix Gemma3 (`gemma3_config` kwargs).

  Norm scales start at zero (Gemma's norms scale by `1 + scale`).
  """
  return _build(
      gemma3_lib.Gemma3, gemma3_config(vocab_size, **kwargs), seed, random_mlp,
      mlp_out_scale
  )


def tiny_diffusion_gemma(vocab_size: int, *, seed: int = 0,
                         embedding_scale: float = 1.0, **overrides):
  """A randomly initialised tiny `DiffusionGemma` (tests and benchmarks).

  Two layers (one sliding, one full), width 16, canvas 4, dense MLPs and
  the character tokenizer's ids (pad 0, BOS 1, EOS 2); `overrides` are
  `DiffusionGemmaConfig` fields (e.g. `num_experts=2, top_k_experts=1,
  moe_intermediate_size=8` for MoE layers).

  Args:
    vocab_size: V.
    seed: Parameter seed.
    embedding_scale: Multiplies the (tied) embedding: > 1 sharpens the
      random model's distributions, so that its samples are not uniform.
    **overrides: `DiffusionGemmaConfig` fields.
  """
  fields = dict(
      vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
      layer_types=("sliding_attention", "full_attention"), num_heads=2,
      num_kv_heads=1, head_dim=8, global_num_kv_heads=1, global_head_dim=8,
      sliding_window=6, canvas_length=4, pad_token_id=0, eos_token_id=2,
      bos_token_id=1)
  fields.update(overrides)
  model = dg.DiffusionGemma(dg.DiffusionGemmaConfig(**fields),
                            rngs=nnx.Rngs(seed))
  model.embedding[...] = model.embedding[...] * embedding_scale
  return model
