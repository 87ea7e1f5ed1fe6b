"""KV caches of the Tunix families and the per-row operations of the driver.

Every supported family (Qwen3, Qwen2, Llama3, Gemma3) keeps one cache entry
per layer, `{'k', 'v': [B, S, num_kv_heads, head_dim], 'end_index': int32
[B]}`, and writes a call's keys and values at the shared index
`end_index[0]`. `init_cache` builds it (with `model.init_cache` where the
model has one); the cached driver keeps its own layout
(`window_attention.Cache`). `row_slice`/`row_merge` act on each row's own
slots, `check_model_for_cache` refuses what the cached driver cannot run
exactly (a model whose attention it does not know, a sliding window shorter
than what its calls span).
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff import models
from tunix_blockdiff.rollout import window_families


def activation_dtype(model):
  """The dtype of the model's activations (its config's, else its first float parameter's)."""
  dtype = getattr(getattr(model, "config", None), "dtype", None)
  if dtype is not None:
    return dtype
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf.dtype
  return jnp.float32


def init_cache(model, batch: int, cache_len: int) -> dict[str, Any]:
  """An empty KV cache in Tunix's layout for `model`.

  Uses `model.init_cache` when the model has it (Qwen3); otherwise (Qwen2,
  Llama3, Gemma3 in Tunix 0.1.7) builds `{'layer_i': {'k', 'v': [B,
  cache_len, num_kv_heads, head_dim], 'end_index': int32 [B]}}` from the
  model's config, as those models read it.
  """
  dtype = activation_dtype(model)
  if hasattr(model, "init_cache"):
    return model.init_cache(batch, cache_len, dtype)
  config = model.config
  num_layers = getattr(config, "num_layers", None) or len(model.layers)
  shape = (batch, cache_len, config.num_kv_heads, config.head_dim)
  return {
      f"layer_{i}": {
          "k": jnp.zeros(shape, dtype),
          "v": jnp.zeros(shape, dtype),
          "end_index": jnp.zeros((batch,), jnp.int32),
      }
      for i in range(num_layers)
  }


def row_slice(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
  """x[b, start[b] : start[b] + size] for every row b."""
  return jax.vmap(
      lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, size, axis=0)
  )(x, start)


def row_merge(x: jax.Array, update: jax.Array, keep: jax.Array,
              start: jax.Array) -> jax.Array:
  """x with x[b, start[b] + i] = update[b, i] where keep[b, i].

  Written as selects over [B, S] (one per window slot) rather than one
  `dynamic_update_slice` per row: XLA's TPU backend runs a vmapped update as
  a loop over the rows, which costs more than the selects at any batch.

  Args:
    x: [B, S].
    update: [B, W], W <= S.
    keep: bool [B, W].
    start: int32 [B], start + W <= S.
  """
  offset = (jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
            - start.astype(jnp.int32)[:, None])
  for i in range(update.shape[1]):
    hit = (offset == i) & keep[:, i:i + 1]
    x = jnp.where(hit, update[:, i:i + 1], x)
  return x


def check_model_for_cache(
    model, config, prompt_width: int, num_new: int
) -> None:
  """Raises for a model the cached driver cannot run exactly.

  Its attention must be one `window_families` knows (the Tunix Qwen3,
  Qwen2, Llama3 and Gemma3 layers; their flash setting does not matter, the
  driver runs its own attention), and a sliding window must not cut what
  the calls span.
  """
  if not window_families.supports(model):
    raise ValueError(
        "generate(use_cache=True) runs the attention of Tunix's Qwen3, Qwen2,"
        " Llama3 and Gemma3 layers against its own cache; this model's"
        f" ({type(model).__name__}) layers are not among them: pass"
        " use_cache=False"
    )
  # Tunix's Gemma3 masks its local layers by physical distance |i - j| <
  # window between a call's query row i and cache slot j. The calls here span
  # at most T + W - 1 of that distance (T = the logical rows, rounded up to
  # the block; the scratch sits after them), so the window cuts nothing, and
  # neither does the cacheless reference's logical window, iff T + W fits.
  width = config.block_size
  total = -(-(prompt_width + num_new) // width) * width
  models.check_window(
      model,
      total + width,
      what=(
          "generate(use_cache=True) with prompt width + max_new_tokens"
          f" rounded up to the block ({total}) plus one block ({width})"
      ),
      fix=(
          "Shorten the prompts or max_new_tokens, or pass use_cache=False"
          " (the cacheless path applies the window exactly)."
      ),
  )
