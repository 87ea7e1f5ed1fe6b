"""The Gemma 4 layer DiffusionGemma runs twice: norms, attention, MLP, MoE.

One `Layer` holds one parameter set for both passes. Its attention takes the
keys and values it must attend to besides its own (the encoder's cache, or
the clean stream in training) and a boolean mask over `[context ; own]`,
so the causal encoder pass and the bidirectional decoder pass are the same
code under different masks. RoPE is Tunix Gemma 4's `apply_rope` (plain on
sliding layers, "proportional" on full layers).
"""

from __future__ import annotations

import contextlib
import contextvars

from flax import nnx
import jax
import jax.numpy as jnp
from tunix.models.gemma4 import model as gemma4_lib

from tunix_blockdiff.attention import splash as splash_lib
from tunix_blockdiff.models.diffusion_gemma import config as config_lib

# Masked scores: finite, so a query with no visible key gives a uniform
# (ignored) row instead of NaN.
_NEG = -2.3819763e38

# (tile, interpret) of the attention calls traced inside `splash_scope`;
# None: dense.
_SPLASH: contextvars.ContextVar = contextvars.ContextVar(
    "diffusion_gemma_splash", default=None)


@contextlib.contextmanager
def splash_scope(tile: int, interpret: bool | None = None):
  """Within it, every attention call runs the Splash kernel (a traced mask).

  Used while the training logits are traced (`kinds.diffusion_gemma`'s
  loss): the encoder's [L, L] and the decoder's [L, 2L] masks go to Splash
  per example, as `attention.splash.dynamic_splash_attention`. `tile` must
  divide both lengths (the callers check it first).
  """
  token = _SPLASH.set((tile, interpret))
  try:
    yield
  finally:
    _SPLASH.reset(token)


def attention_scope(tile: int | None, interpret: bool | None = None):
  """`splash_scope(tile, interpret)`, or a no-op scope (dense) for None."""
  if tile is None:
    return contextlib.nullcontext()
  return splash_scope(tile, interpret)


def splash_attend(q, keys, values, mask, tile: int,
                  interpret: bool | None = None) -> jax.Array:
  """`Attention.attend`'s weighted values through Splash: [B, T, N, H].

  A query row with no visible key (padding) attends to key 0 instead (the
  dense path gives it a uniform row; both are ignored by the loss, and
  neither is NaN).

  Args:
    q: [B, T, N, H].
    keys, values: [B, S, K, H].
    mask: bool [B, T, S].
    tile: Query and key tile; divides T and S.
    interpret: Pallas interpret mode; None: off TPU.
  """
  s = keys.shape[1]
  empty = ~jnp.any(mask, axis=-1, keepdims=True)
  mask = mask | (empty & (jnp.arange(s) == 0)[None, None, :])

  def one(q, k, v, m):
    return splash_lib.dynamic_splash_attention(
        q, k, v, m, q_tile=tile, kv_tile=tile, interpret=interpret)

  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  out = jax.vmap(one)(heads_first(q), heads_first(keys.astype(q.dtype)),
                      heads_first(values.astype(q.dtype)), mask)
  return heads_first(out)


def _dtype(name: str):
  return jnp.dtype(name)


# Partition specs over the ("fsdp", "sp", "tp") mesh of `distributed`:
# widening projections shard (model width, output) over (fsdp, tp), narrowing
# ones the transpose; experts shard over fsdp (expert parallel) and their
# hidden width over tp; vectors are replicated.
UP = ("fsdp", "tp")
DOWN = ("tp", "fsdp")
REPLICATED = (None,)


def _linear(n_in: int, n_out: int, cfg, rngs: nnx.Rngs,
            sharding=UP) -> nnx.Linear:
  return nnx.Linear(
      n_in,
      n_out,
      use_bias=False,
      kernel_init=nnx.with_partitioning(
          nnx.initializers.variance_scaling(1.0, "fan_in", "normal"),
          sharding),
      dtype=_dtype(cfg.dtype),
      param_dtype=_dtype(cfg.param_dtype),
      rngs=rngs,
  )


class RMSNorm(nnx.Module):
  """`x * (mean(x^2) + eps)^-1/2 [* scale]`, computed in float32."""

  def __init__(self, dim: int, cfg, *, with_scale: bool = True):
    self.eps = cfg.rms_norm_eps
    self.scale = (
        nnx.Param(jnp.ones((dim,), _dtype(cfg.param_dtype)),
                  sharding=REPLICATED)
        if with_scale else None
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    if self.scale is not None:
      y = y * self.scale[...].astype(jnp.float32)
    return y.astype(x.dtype)


class Attention(nnx.Module):
  """Query/key/value projections with q/k/v norms and RoPE; GQA attention.

  Full layers have no value projection: the values are the raw keys
  (`k = v`), normalised by the scale-free value norm. Scores are not
  divided by sqrt(head_dim) (the q/k norms set the scale).
  """

  def __init__(self, cfg: config_lib.DiffusionGemmaConfig, index: int,
               rngs: nnx.Rngs):
    self.sliding, self.num_kv, self.head_dim = cfg.layer(index)
    self.num_heads = cfg.num_heads
    d = cfg.hidden_size
    self.q_proj = _linear(d, cfg.num_heads * self.head_dim, cfg, rngs)
    self.k_proj = _linear(d, self.num_kv * self.head_dim, cfg, rngs)
    self.v_proj = (
        _linear(d, self.num_kv * self.head_dim, cfg, rngs)
        if self.sliding else None
    )
    self.o_proj = _linear(cfg.num_heads * self.head_dim, d, cfg, rngs, DOWN)
    self.q_norm = RMSNorm(self.head_dim, cfg)
    self.k_norm = RMSNorm(self.head_dim, cfg)
    self.v_norm = RMSNorm(self.head_dim, cfg, with_scale=False)
    if self.sliding:
      self.rope_theta, self.rope_fraction = cfg.local_rope_theta, 1.0
    else:
      self.rope_theta = cfg.global_rope_theta
      self.rope_fraction = cfg.global_rope_fraction

  def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    return gemma4_lib.apply_rope(
        x,
        positions,
        base_frequency=self.rope_theta,
        rope_proportion=self.rope_fraction,
    )

  def keys_values(self, x: jax.Array, positions: jax.Array):
    """k, v [B, T, K, H] of `x` [B, T, D] at `positions` [B, T]."""
    b, t, _ = x.shape
    raw = self.k_proj(x).reshape(b, t, self.num_kv, self.head_dim)
    v = raw if self.v_proj is None else self.v_proj(x).reshape(raw.shape)
    k = self._rope(self.k_norm(raw), positions)
    return k, self.v_norm(v)

  def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, T, N, H] of `x` [B, T, D]."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    return self._rope(self.q_norm(q), positions)

  def attend(self, q, keys, values, mask) -> jax.Array:
    """GQA attention output [B, T, D].

    Args:
      q: [B, T, N, H].
      keys, values: [B, S, K, H].
      mask: bool [B, T, S].
    """
    b, t, _, _ = q.shape
    splash = _SPLASH.get()
    if splash is not None:
      out = splash_attend(q, keys, values, mask, *splash)
      return self.o_proj(out.astype(q.dtype).reshape(b, t, -1))
    groups = self.num_heads // self.num_kv
    q = q.reshape(b, t, self.num_kv, groups, self.head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, values.astype(q.dtype))
    return self.o_proj(out.reshape(b, t, -1))


class MLP(nnx.Module):
  """Gated tanh-GELU MLP: `down(gelu(gate(x)) * up(x))`."""

  def __init__(self, d: int, hidden: int, cfg, rngs: nnx.Rngs):
    self.gate_proj = _linear(d, hidden, cfg, rngs)
    self.up_proj = _linear(d, hidden, cfg, rngs)
    self.down_proj = _linear(hidden, d, cfg, rngs, DOWN)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(
        jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class MoE(nnx.Module):
  """Top-k routed experts (grouped matmuls with `jax.lax.ragged_dot`).

  The router reads the layer's un-normalised residual stream: RMS-normed
  without a scale, times `scale / sqrt(D)`, projected to E logits; the top-k
  softmax probabilities are renormalised to sum to 1 and multiplied by the
  chosen experts' `per_expert_scale`. The experts read the residual through
  their own pre-norm (outside this module).
  """

  def __init__(self, cfg: config_lib.DiffusionGemmaConfig, rngs: nnx.Rngs):
    d, e, h = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.top_k = cfg.top_k_experts
    self.router_norm = RMSNorm(d, cfg, with_scale=False)
    self.router_proj = _linear(d, e, cfg, rngs, ("fsdp", None))
    pd = _dtype(cfg.param_dtype)
    self.router_scale = nnx.Param(jnp.ones((d,), pd), sharding=REPLICATED)
    self.per_expert_scale = nnx.Param(jnp.ones((e,), pd),
                                      sharding=REPLICATED)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal",
                                             in_axis=1, out_axis=2)
    # [E, D, 2H]: gate columns then up columns; [E, H, D].
    self.gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * h), pd),
                             sharding=("fsdp", None, "tp"))
    self.down = nnx.Param(init(rngs.params(), (e, h, d), pd),
                          sharding=("fsdp", "tp", None))
    self.dtype = _dtype(cfg.dtype)

  def route(self, residual: jax.Array):
    """Top-k weights [N, k] and expert ids int [N, k] of `residual` [N, D]."""
    d = residual.shape[-1]
    h = self.router_norm(residual) * self.router_scale[...] * (d ** -0.5)
    probs = jax.nn.softmax(self.router_proj(h).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, self.top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * self.per_expert_scale[...][experts]
    return weights, experts

  def __call__(self, residual: jax.Array, x: jax.Array) -> jax.Array:
    """Experts of `x` [..., D] routed by `residual` [..., D]."""
    shape = x.shape
    residual = residual.reshape(-1, shape[-1])
    x = x.reshape(-1, shape[-1])
    weights, experts = self.route(residual)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // self.top_k
    sizes = jnp.bincount(flat, length=self.gate_up.shape[0]).astype(jnp.int32)
    xs = x[token].astype(self.dtype)
    gate_up = jax.lax.ragged_dot(xs, self.gate_up[...].astype(self.dtype),
                                 sizes)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    hidden = jax.nn.gelu(gate, approximate=True) * up
    out = jax.lax.ragged_dot(hidden, self.down[...].astype(self.dtype), sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    y = jnp.zeros_like(x).at[token].add(out.astype(x.dtype))
    return y.reshape(shape)


class Layer(nnx.Module):
  """One Gemma 4 layer (attention, dense MLP, optional MoE, layer scalar).

  The encoder and the decoder share every weight but the layer scalar,
  which the reference keeps per pass (`encoder_scalar`, `decoder_scalar`).
  """

  def __init__(self, cfg: config_lib.DiffusionGemmaConfig, index: int,
               rngs: nnx.Rngs):
    d = cfg.hidden_size
    self.sliding = cfg.layer(index)[0]
    self.input_layernorm = RMSNorm(d, cfg)
    self.self_attn = Attention(cfg, index, rngs)
    self.post_attention_layernorm = RMSNorm(d, cfg)
    self.pre_feedforward_layernorm = RMSNorm(d, cfg)
    self.mlp = MLP(d, cfg.intermediate_size, cfg, rngs)
    self.post_feedforward_layernorm = RMSNorm(d, cfg)
    if cfg.is_moe:
      self.moe = MoE(cfg, rngs)
      self.post_feedforward_layernorm_1 = RMSNorm(d, cfg)
      self.pre_feedforward_layernorm_2 = RMSNorm(d, cfg)
      self.post_feedforward_layernorm_2 = RMSNorm(d, cfg)
    else:
      self.moe = None
    pd = _dtype(cfg.param_dtype)
    self.encoder_scalar = nnx.Param(jnp.ones((1,), pd), sharding=REPLICATED)
    self.decoder_scalar = nnx.Param(jnp.ones((1,), pd), sharding=REPLICATED)

  def __call__(self, x, positions, mask, context_k=None, context_v=None, *,
               decoder: bool, write_at=None):
    """One layer over `x` [B, T, D] attending to `[context ; x]`.

    Args:
      x: [B, T, D].
      positions: int [B, T].
      mask: bool [B, T, S + T], or [B, T, S] with `write_at`.
      context_k, context_v: [B, S, K, H] keys/values besides x's own, or
        None.
      decoder: Which pass's layer scalar to use.
      write_at: With a cache buffer as context: write x's keys and values
        into it at this slot instead of appending (the encoder step).

    Returns:
      (y [B, T, D], k, v): x's own keys and values [B, T, K, H], or the
      updated buffers [B, S, K, H] with `write_at`.
    """
    attn = self.self_attn
    h = self.input_layernorm(x)
    q = attn.queries(h, positions)
    k, v = attn.keys_values(h, positions)
    if write_at is not None:
      k = jax.lax.dynamic_update_slice(context_k, k.astype(context_k.dtype),
                                       (0, write_at, 0, 0))
      v = jax.lax.dynamic_update_slice(context_v, v.astype(context_v.dtype),
                                       (0, write_at, 0, 0))
      keys, values = k, v
    elif context_k is not None:
      keys = jnp.concatenate([context_k.astype(k.dtype), k], axis=1)
      values = jnp.concatenate([context_v.astype(v.dtype), v], axis=1)
    else:
      keys, values = k, v
    x = x + self.post_attention_layernorm(attn.attend(q, keys, values, mask))
    ff = self.mlp(self.pre_feedforward_layernorm(x))
    if self.moe is not None:
      ff = self.post_feedforward_layernorm_1(ff)
      experts = self.moe(x, self.pre_feedforward_layernorm_2(x))
      ff = ff + self.post_feedforward_layernorm_2(experts)
    x = x + self.post_feedforward_layernorm(ff)
    scalar = self.decoder_scalar if decoder else self.encoder_scalar
    return x * scalar[...].astype(x.dtype), k, v


class SelfConditioning(nnx.Module):
  """`post_norm(embeddings + MLP(pre_norm(soft_embeddings)))`.

  `post_norm` has no scale. With zero soft embeddings the MLP adds zero, so
  the decoder input is the RMS-normed token embedding.
  """

  def __init__(self, cfg: config_lib.DiffusionGemmaConfig, rngs: nnx.Rngs):
    d = cfg.hidden_size
    self.pre_norm = RMSNorm(d, cfg)
    self.mlp = MLP(d, cfg.intermediate_size, cfg, rngs)
    self.post_norm = RMSNorm(d, cfg, with_scale=False)

  def __call__(self, embeddings: jax.Array, soft: jax.Array) -> jax.Array:
    return self.post_norm(embeddings + self.mlp(self.pre_norm(soft)))
