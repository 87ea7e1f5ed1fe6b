"""DiffusionGemma: one Gemma 4 text stack, a causal encoder and a canvas decoder.

- `encode(tokens, positions, valid, cache)`: the causal pass over clean
  tokens (the prompt, then each finished canvas); it appends their keys and
  values to the cache at `cache.length` and returns the final-normed hidden
  states.
- `decode(canvas, positions, cache, sc_logits, sc_mask)`: the bidirectional
  pass over a canvas of C tokens, attending to the cache (read only) and to
  itself; optional self-conditioning from the previous step's logits.
  Returns soft-capped float32 logits [B, C, V].
- `train_logits(...)`: both passes at once over whole training rows (clean
  stream causal; each noisy canvas sees the clean tokens before it and
  itself), equal to encode-then-decode canvas by canvas.

Masks (index = physical slot; positions are separate inputs):
- encoder query i sees cached/own key j iff valid[j], j <= i and, on sliding
  layers, i - j < W;
- decoder query sees every canvas slot, and cached key j iff valid[j] and,
  on sliding layers, j >= length - (W - 1) (the reference's sliding cache
  keeps the last W - 1 entries).
"""

from __future__ import annotations

import flax
from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff.models.diffusion_gemma import config as config_lib
from tunix_blockdiff.models.diffusion_gemma import layers as layers_lib


@flax.struct.dataclass
class Cache:
  """The encoder's KV cache, fixed size S.

  Attributes:
    k, v: Per layer [B, S, K_l, H_l].
    valid: bool [B, S]: filled, non-padding slots.
    length: int32 []: slots filled so far (the same for every row).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  valid: jax.Array
  length: jax.Array

  @property
  def size(self) -> int:
    return self.valid.shape[1]


class DiffusionGemma(nnx.Module):
  """The DiffusionGemma text model (see the module docstring)."""

  def __init__(self, config: config_lib.DiffusionGemmaConfig, *,
               rngs: nnx.Rngs):
    self.config = config
    d = config.hidden_size
    self.embedding = nnx.Param(
        nnx.initializers.normal(d ** -0.5)(
            rngs.params(), (config.vocab_size, d),
            jnp.dtype(config.param_dtype)), sharding=("tp", "fsdp"))
    self.layers = nnx.List(
        [layers_lib.Layer(config, i, rngs) for i in range(config.num_layers)])
    self.norm = layers_lib.RMSNorm(d, config)
    self.self_conditioning = layers_lib.SelfConditioning(config, rngs)

  # -- pieces ---------------------------------------------------------------

  def embed(self, tokens: jax.Array) -> jax.Array:
    """[B, T] ids -> [B, T, D] embeddings times sqrt(D)."""
    table = self.embedding[...]
    scale = jnp.asarray(self.config.hidden_size ** 0.5, table.dtype)
    return (table[tokens] * scale).astype(self.config.dtype)

  def soft_embed(self, logits: jax.Array) -> jax.Array:
    """[B, C, V] logits -> softmax-weighted embeddings [B, C, D] * sqrt(D)."""
    table = self.embedding[...]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    scale = jnp.asarray(self.config.hidden_size ** 0.5, table.dtype)
    return (probs.astype(table.dtype) @ table * scale).astype(
        self.config.dtype)

  def lm_head(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> soft-capped float32 logits [..., V]."""
    logits = jnp.einsum("...d,vd->...v", hidden, self.embedding[...],
                        preferred_element_type=jnp.float32)
    cap = self.config.final_logit_softcap
    return cap * jnp.tanh(logits.astype(jnp.float32) / cap)

  def decoder_inputs(self, canvas, sc_logits=None, sc_mask=None):
    """Canvas embeddings with the self-conditioning signal [B, C, D].

    Args:
      canvas: int [B, C].
      sc_logits: [B, C, V] previous-step logits, or None (zero signal).
      sc_mask: bool [B] or None; False rows get a zero signal.
    """
    x = self.embed(canvas)
    if sc_logits is None:
      soft = jnp.zeros_like(x)
    else:
      soft = self.soft_embed(sc_logits)
      if sc_mask is not None:
        soft = soft * sc_mask.astype(soft.dtype)[:, None, None]
    return self.self_conditioning(x, soft)

  # -- inference ------------------------------------------------------------

  def init_cache(self, batch: int, size: int) -> Cache:
    """An empty cache of `size` slots for `batch` rows."""
    dtype = jnp.dtype(self.config.dtype)
    ks, vs = [], []
    for i in range(self.config.num_layers):
      _, kv, hd = self.config.layer(i)
      ks.append(jnp.zeros((batch, size, kv, hd), dtype))
      vs.append(jnp.zeros((batch, size, kv, hd), dtype))
    return Cache(tuple(ks), tuple(vs), jnp.zeros((batch, size), bool),
                 jnp.zeros((), jnp.int32))

  def encode(self, tokens, positions, valid, cache: Cache):
    """The causal pass; appends to the cache.

    Args:
      tokens: int [B, T] clean tokens.
      positions: int [B, T] RoPE positions.
      valid: bool [B, T] (False: padding, never attended to).
      cache: Holds the earlier tokens; `cache.length + T <= cache.size`.

    Returns:
      (hidden [B, T, D] after the final norm, the updated cache).
    """
    t = tokens.shape[1]
    start = cache.length
    all_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, start))
    q_idx = start + jnp.arange(t)
    k_idx = jnp.arange(cache.size)
    causal = all_valid[:, None, :] & (k_idx[None, None, :]
                                      <= q_idx[None, :, None])
    window = (q_idx[:, None] - k_idx[None, :]) < self.config.sliding_window
    x = self.embed(tokens)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      mask = causal & window[None] if layer.sliding else causal
      x, k, v = layer(x, positions, mask, cache.k[i], cache.v[i],
                      decoder=False, write_at=start)
      new_k.append(k)
      new_v.append(v)
    return self.norm(x), Cache(tuple(new_k), tuple(new_v), all_valid,
                               start + t)

  def decode(self, canvas, positions, cache: Cache, sc_logits=None,
             sc_mask=None):
    """The bidirectional canvas pass over the cache (read only).

    Args:
      canvas: int [B, C].
      positions: int [B, C] (the reference continues after the cache).
      cache: The encoded context.
      sc_logits: [B, C, V] self-conditioning logits, or None.
      sc_mask: bool [B] per-example self-conditioning switch, or None.

    Returns:
      float32 logits [B, C, V].
    """
    c = canvas.shape[1]
    k_idx = jnp.arange(cache.size)
    recent = k_idx >= cache.length - (self.config.sliding_window - 1)
    own = jnp.ones(canvas.shape + (c,), bool)
    full = jnp.concatenate(
        [jnp.broadcast_to(cache.valid[:, None, :],
                          (canvas.shape[0], c, cache.size)), own], axis=-1)
    sliding = jnp.concatenate(
        [jnp.broadcast_to((cache.valid & recent[None])[:, None, :],
                          (canvas.shape[0], c, cache.size)), own], axis=-1)
    x = self.decoder_inputs(canvas, sc_logits, sc_mask)
    for i, layer in enumerate(self.layers):
      x, _, _ = layer(x, positions, sliding if layer.sliding else full,
                      cache.k[i], cache.v[i], decoder=True)
    return self.lm_head(self.norm(x))

  # -- training -------------------------------------------------------------

  def __call__(self, *args, method: str = "train_logits", **kwargs):
    """The one entry point: `train_logits`, `encode` or `decode`.

    qwix intercepts a single method of an nnx model, so LoRA applies to
    every pass only when callers go through `__call__` (the objective and
    the sampler do: `model(..., method="decode")`).
    """
    if method not in ("train_logits", "encode", "decode"):
      raise ValueError(
          f"method must be train_logits, encode or decode, got {method!r}")
    return getattr(self, method)(*args, **kwargs)

  def get_model_input(self) -> dict[str, jax.Array]:
    """Dummy `__call__` inputs (Tunix's convention, used by qwix)."""
    c = self.config.canvas_length
    length = 2 * c
    ids = jnp.zeros((1, length), jnp.int32)
    canvas_id = jnp.where(jnp.arange(length) >= c, 0, -1)[None]
    return dict(clean=ids, noisy=ids, positions=jnp.arange(length)[None],
                valid=jnp.ones((1, length), bool), canvas_id=canvas_id,
                canvas_start=jnp.full((1, length), c, jnp.int32))

  def train_logits(self, clean, noisy, positions, valid, canvas_id,
                   canvas_start, sc_logits=None, sc_mask=None):
    """Decoder logits of every noisy canvas of whole rows, in one pass.

    Args:
      clean: int [B, L] the clean rows (prompt then response).
      noisy: int [B, L] the rows with each response canvas corrupted.
      positions: int [B, L].
      valid: bool [B, L] real tokens.
      canvas_id: int [B, L] canvas index of each response slot, -1 for
        prompt and padding.
      canvas_start: int [B, L] physical index of the first slot of each
        slot's canvas (any value where canvas_id is -1).
      sc_logits: [B, L, V] self-conditioning logits or None.
      sc_mask: bool [B] or None.

    Returns:
      float32 logits [B, L, V]; rows at canvas_id -1 are meaningless.
    """
    length = clean.shape[1]
    idx = jnp.arange(length)
    w = self.config.sliding_window
    causal = valid[:, None, :] & (idx[None, None, :] <= idx[None, :, None])
    enc_window = (idx[:, None] - idx[None, :]) < w
    before = idx[None, None, :] < canvas_start[:, :, None]
    dec_recent = idx[None, None, :] >= canvas_start[:, :, None] - (w - 1)
    same = (canvas_id[:, :, None] == canvas_id[:, None, :]) & (
        canvas_id[:, None, :] >= 0)
    dec_full = jnp.concatenate([valid[:, None, :] & before, same], -1)
    dec_sliding = jnp.concatenate(
        [valid[:, None, :] & before & dec_recent, same], -1)
    x = self.embed(clean)
    y = self.decoder_inputs(noisy, sc_logits, sc_mask)
    for layer in self.layers:
      enc_mask = causal & enc_window[None] if layer.sliding else causal
      x_next, k, v = layer(x, positions, enc_mask, decoder=False)
      y, _, _ = layer(y, positions,
                      dec_sliding if layer.sliding else dec_full, k, v,
                      decoder=True)
      x = x_next
    return self.lm_head(self.norm(y))

