"""The families whose attention the cached driver's window call mirrors.

For each Tunix attention module it knows (Qwen3, Qwen2, Llama3, Gemma3, as
in Tunix 0.1.7), how the family computes a window's queries, keys and
values (its own projections, norms and rotary embeddings) and its output
projection; `window_attention` puts its own attention between the two.
Shapes: B batch, T window slots, N query heads, K key heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib


class Projected(NamedTuple):
  """A window's attention inputs, as the family computes them.

  Attributes:
    q: [B, T, N, H] queries (rotated; Gemma3's already scaled).
    k, v: [B, T, K, H] keys (rotated) and values.
    score_scale: Multiplies the query-key products (1.0: none).
    softmax_dtype: The softmax's dtype (float32, or the scores' own).
  """

  q: jax.Array
  k: jax.Array
  v: jax.Array
  score_scale: float
  softmax_dtype: Any


@dataclasses.dataclass(frozen=True)
class Family:
  """How one family's attention module computes its inputs and output."""

  attention_type: type
  project: Callable[[Any, dict[str, Any]], Projected]
  output: Callable[[Any, jax.Array], jax.Array]


def _qwen3_project(attn, args) -> Projected:
  shard = lambda x: qwen3_lib.shard(x, attn.shd_config.act_btnh)
  x, pos = args["x"], args["segment_pos"]
  q = shard(attn.q_norm(attn.q_proj(x)))
  k = shard(attn.k_norm(attn.k_proj(x)))
  v = shard(attn.v_proj(x))
  q = qwen3_lib.apply_rope(q, pos, head_dim=attn.head_dim)
  k = qwen3_lib.apply_rope(k, pos, head_dim=attn.head_dim)
  return Projected(q, k, v, attn.scale, jnp.float32)


def _qwen2_project(attn, args) -> Projected:
  x, sin, cos = args["x"], args["sin"], args["cos"]
  dtype = attn.config.dtype

  def biased(proj, bias):
    out = proj(x)
    b, t, n, h = out.shape
    out = out.reshape((b, t, n * h)) + bias.astype(dtype)
    return qwen2_lib.shard(out.reshape((b, t, n, h)),
                           attn.shd_config.act_btnh)

  q = biased(attn.q_proj, attn.q_bias)
  k = biased(attn.k_proj, attn.k_bias)
  v = biased(attn.v_proj, attn.v_bias)
  q = qwen2_lib.apply_rotary_embedding(q, sin, cos)
  k = qwen2_lib.apply_rotary_embedding(k, sin, cos)
  return Projected(q, k, v, attn.scale, jnp.float32)


def _llama3_project(attn, args) -> Projected:
  shard = lambda x: llama3_lib.shard(x, attn.shd_config.act_btnh)
  x, pos = args["x"], args["segment_pos"]
  q, k, v = (shard(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
  q = llama3_lib.apply_rope(q, pos, head_dim=attn.head_dim)
  k = llama3_lib.apply_rope(k, pos, head_dim=attn.head_dim)
  return Projected(q, k, v, attn.scale, jnp.float32)


def _gemma3_project(attn, args) -> Projected:
  x, pos = args["x"], args["segment_pos"]
  if attn.use_qkv_einsum:
    q, k, v = attn.qkv_einsum(x)
  else:
    q = attn.q_einsum(x)
    k, v = attn.kv_einsum(x)
  shard = lambda t: gemma3_lib.sharding_utils.shard(t, attn.shd_config.act_btnh)
  q, k, v = shard(q), shard(k), shard(v)
  q, k = attn._query_norm(q), attn._key_norm(k)  # pylint: disable=protected-access
  rope = dict(head_dim=attn.head_dim, base_frequency=attn.rope_base_frequency,
              scale_factor=attn.rope_scale_factor)
  q = gemma3_lib.apply_rope(q, pos, **rope) * attn.query_pre_attn_scalar
  k = gemma3_lib.apply_rope(k, pos, **rope)
  # Gemma3's softmax runs in the scores' dtype.
  return Projected(q, k, v, 1.0, None)


def _o_proj(shard_fn):
  def output(attn, encoded):
    return shard_fn(attn.o_proj(encoded), attn.shd_config.act_btd)

  return output


def _gemma3_output(attn, encoded):
  return gemma3_lib.sharding_utils.shard(attn.attn_vec_einsum(encoded),
                                         attn.shd_config.act_btd)


_FAMILIES = (
    Family(qwen3_lib.Attention, _qwen3_project, _o_proj(qwen3_lib.shard)),
    Family(qwen2_lib.Attention, _qwen2_project, _o_proj(qwen2_lib.shard)),
    Family(llama3_lib.Attention, _llama3_project, _o_proj(llama3_lib.shard)),
    Family(gemma3_lib.Attention, _gemma3_project, _gemma3_output),
)


def family_of(attn) -> Family | None:
  for family in _FAMILIES:
    if type(attn) is family.attention_type:  # pylint: disable=unidiomatic-typecheck
      return family
  return None


def supports(model) -> bool:
  """Whether every layer's attention is one `window_call` knows."""
  layers = getattr(model, "layers", None)
  if not layers:
    return False
  return all(family_of(getattr(layer, "attn", None)) for layer in layers)
