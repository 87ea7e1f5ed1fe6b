"""A Tunix model's call on a window of slots against a read-only KV cache.

The cached driver (`cached_loop`) calls the model on one window per row
(the active block, with the just-finished block before it when that block's
keys are due). Routed through Tunix's own attention, such a call writes its
keys into the cache it reads; inside the driver's loop XLA then copies the
whole cache at every step (the old cache stays live, or its layout differs
from the write's). Here each layer's `attn` is swapped, for the traced call
only, for `_WindowAttention`: the family's own projections, norms and
rotary embeddings (called as the family's attention calls them), then
attention of the window's queries over the cached keys (read only) and the
window's own keys, and the window's keys and values handed back instead of
written. The driver writes a finished block's slots itself, in place.

Cache layout: `k, v: [L, B, K, C, TILE, H]` (`Cache`), every layer in one
array (so that a block write is one update of all layers), key heads before
slots (a step's reads and the driver's block writes agree on one layout),
slots in chunks of a memory tile (a block write updates whole tiles);
`valid [B, C * TILE]` says which slots hold keys (the driver decides which
slot holds which position: attention does not depend on the order of the
keys).

Families: Qwen3, Qwen2, Llama3, Gemma3 (Tunix 0.1.7's attention code,
mirrored up to its cache write; `window_families`). Gemma3's sliding
window is not applied: `kv_cache.check_model_for_cache` admits only calls
that the window does not cut. Shapes: B batch, T window slots, S cache
slots, N query heads, K key heads, H head dim, L layers, V vocabulary.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff.models import head as head_lib
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.rollout import cache_kernel
from tunix_blockdiff.rollout import window_families as families

# Tunix's attention mask value (the same in every family).
K_MASK = -2.3819763e38


def attend(p: families.Projected, parts, window_mask) -> jax.Array:
  """The window's attention over [cached parts ; window keys]: [B, T, N, H].

  As Tunix's attention computes it over one concatenated key axis (scores in
  the input dtype, scaled, masked with `K_MASK`, softmax, weighted values),
  without concatenating keys: the scores of the parts are joined (they are
  small), the parts' weighted values are summed in float32, and the
  softmax's division comes after the weighted sum (the same values up to
  rounding: the weights are rounded to the values' dtype before the
  division, not after).

  Args:
    p: The window's projections.
    parts: (keys [B, K, S_i, H], values likewise, valid bool [B, S_i]) per
      cached part (read only): the cache, a block not yet written to it.
    window_mask: bool [B, T, T] window slot q attends window slot k.
  """
  b, t, n, h = p.q.shape
  kh = p.k.shape[2]
  q = p.q.reshape((b, t, kh, n // kh, h))
  scores = []
  for keys, _, valid in parts:
    s_part = jnp.einsum("BTKGH,BKSH->BKGTS", q, keys)
    if p.score_scale != 1.0:
      s_part = s_part * p.score_scale
    scores.append(jnp.where(valid[:, None, None, None, :], s_part, K_MASK))
  s_window = jnp.einsum("BTKGH,BSKH->BKGTS", q, p.k)
  if p.score_scale != 1.0:
    s_window = s_window * p.score_scale
  scores.append(jnp.where(window_mask[:, None, None], s_window, K_MASK))
  scores = jnp.concatenate(scores, axis=-1)
  if p.softmax_dtype is not None:
    scores = scores.astype(p.softmax_dtype)
  # The softmax normalised last: unnormalised weights in the values' dtype
  # weight the values, and the sum over every part is divided by their
  # total. Normalised probabilities were one more pass over every slot's
  # scores on a TPU v5e (0.53 ms of a 17.4 ms call at Qwen3-0.6B, batch
  # 128, 8 slots a row); here the exponentials fuse into the weighted
  # values' products.
  weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
  total = weights.astype(jnp.float32).sum(axis=-1)  # [B, K, G, T]
  weights = weights.astype(p.k.dtype)
  # Each part's weighted values in the values' dtype (as Tunix's one
  # einsum gives them), summed in float32.
  out, start = 0.0, 0
  for _, values, valid in parts:
    size = valid.shape[1]
    out += jnp.einsum("BKGTS,BKSH->BTKGH", weights[..., start:start + size],
                      values).astype(jnp.float32)
    start += size
  out += jnp.einsum("BKGTS,BSKH->BTKGH", weights[..., start:],
                    p.v).astype(jnp.float32)
  out = out / jnp.transpose(total, (0, 3, 1, 2))[..., None]
  return out.astype(p.v.dtype).reshape((b, t, n, h))


class _WindowAttention(nnx.Module):
  """Stands in for one layer's `attn` during a `window_call`."""

  def __init__(self, inner, family: families.Family):
    self.inner = inner
    self.family = family
    self.signature = inspect.signature(type(inner).block)
    if hasattr(inner, "qwix_path"):
      # qwix (LoRA) finds its rules by the calling module's path: keep the
      # attention's, so its operations are intercepted as they were.
      self.qwix_path = inner.qwix_path

  def __call__(self, *args, **kwargs):
    bound = self.signature.bind(self.inner, *args, **kwargs).arguments
    projected = self.family.project(self.inner, bound)
    cache = bound["cache"]
    if cache["spans"]:
      encoded = cache_kernel.attend(
          projected.q, projected.k, projected.v, bound["attn_mask"],
          cache["spans"], cache["parts"], projected.score_scale)
    else:
      encoded = attend(projected, cache["parts"], bound["attn_mask"])
    return ({"k": projected.k, "v": projected.v},
            self.family.output(self.inner, encoded))


# Slots per cache chunk: the rows of a TPU memory tile of 16-bit values.
TILE = 16


class Span(NamedTuple):
  """The slots [lo, hi) of each row that a cached part holds keys in.

  As a part's validity (`window_call`), it makes the call read that part
  with `cache_kernel` (only the chunks of slots in use), not all of it.
  """

  lo: jax.Array  # int32 [B]
  hi: jax.Array  # int32 [B]


class Cache(NamedTuple):
  """Keys and values of every layer: the driver's cache, or a block of slots.

  The driver's cache is *chunked*, `[L, B, K, C, TILE, H]` (slot s in chunk
  s // TILE, row s % TILE); `slots` views it as `[L, B, K, C * TILE, H]`,
  the layout of a block (`as_block`), at no cost (the same bytes). Chunks
  line up with the TPU's memory tiles, so a block write updates whole tiles
  at a chunk offset (`write_blocks`): a write of a 4-slot block at a slot
  offset wrote part of every tile it touched (Qwen3-0.6B, batch 128, on a
  TPU v5e: 2.06 ms a step; whole chunks: 0.69 ms). One array for all
  layers (not one per layer): a block write is one update of all layers,
  not 2L.
  """

  k: jax.Array
  v: jax.Array


def chunked_size(size: int) -> int:
  """`size` slots rounded up to whole chunks: the slots a cache of it has."""
  return -(-size // TILE) * TILE


def slots(cache: Cache) -> Cache:
  """A chunked cache viewed as slots, [L, B, K, C * TILE, H] (a block: itself)."""
  if cache.k.ndim == 5:
    return cache
  flat = lambda x: x.reshape(x.shape[:3] + (-1, x.shape[-1]))
  return Cache(flat(cache.k), flat(cache.v))


def _head_shape(model) -> tuple[int, int]:
  """(K, H): every layer's key heads and head size."""
  shapes = {(layer.attn.num_kv_heads, layer.attn.head_dim)
            for layer in model.layers}
  if len(shapes) != 1:
    raise ValueError(
        "model: the cached driver needs every layer's (num_kv_heads,"
        f" head_dim) to agree, got {sorted(shapes)}")
  return next(iter(shapes))


def init_cache(model, batch: int, size: int, dtype) -> Cache:
  """An all-zero chunked `Cache` of at least `size` slots (whole chunks).

  Raises:
    ValueError: the layers differ in KV heads or head size (no supported
      family does).
  """
  kh, h = _head_shape(model)
  chunks = chunked_size(size) // TILE
  zeros = jnp.zeros((len(model.layers), batch, kh, chunks, TILE, h), dtype)
  return Cache(zeros, zeros)


def init_block(model, batch: int, width: int, dtype) -> Cache:
  """An all-zero block of `width` slots, [L, B, K, W, H]."""
  kh, h = _head_shape(model)
  zeros = jnp.zeros((len(model.layers), batch, kh, width, h), dtype)
  return Cache(zeros, zeros)


def cache_from_block(block: Cache, size: int) -> Cache:
  """A chunked cache of at least `size` slots holding `block` at slot 0.

  The block is chunked first (padded to whole chunks), then padded with
  zero chunks: a pad of the `[L, B, K, S, H]` block to the cache's slots
  followed by the chunking was two passes over the whole cache on a TPU
  v5e (the pad, then a relayout copy of keys and of values: 14.8 ms of a
  1.1 s generation at Qwen3-0.6B, batch 128, one cache phase).
  """
  width = block.k.shape[3]
  chunks = chunked_size(max(size, width)) // TILE
  block_chunks = chunked_size(width) // TILE

  def chunked(x):
    x = jnp.pad(x, [(0, 0)] * 3 + [(0, block_chunks * TILE - width), (0, 0)])
    x = x.reshape(x.shape[:3] + (block_chunks, TILE, x.shape[-1]))
    return jnp.pad(x, [(0, 0)] * 3 + [(0, chunks - block_chunks)]
                   + [(0, 0)] * 2)

  return Cache(chunked(block.k), chunked(block.v))


def window_call(model, tokens, positions, parts, window_mask, pick=None,
                head_apply=None):
  """The model on a window against cached keys, which it does not change.

  Args:
    model: A Tunix causal LM that `window_families.supports`.
    tokens: int32 [B, T] the window's tokens.
    positions: int32 [B, T] their logical positions.
    parts: `(Cache, valid bool [B, S])` pairs the window attends to, e.g.
      the driver's chunked cache (S = its slots) and a block not yet
      written to it; or `(Cache, Span)` for a chunked cache that
      `cache_kernel` reads (only its rows' spans; float32 online softmax).
    window_mask: bool [B, T, T] window slot q attends window slot k.
    pick: None (logits of every slot), or a function from the final hidden
      states [B, T, D] to the slots whose logits are wanted [B, T', D].
    head_apply: None, or a function of (the model's `head.HeadlessView`,
      whose `logits` maps final hidden states [B, K, D] to logits [B, K, V];
      the picked final hidden states [B, T', D]) whose result replaces the
      logits (e.g. the head on some slots only,
      `slot_head.propose_eligible`).

  Returns:
    (logits [B, T', V] in the head's dtype, or what `head_apply` returns;
    keys [B, T, K, H] per layer, values likewise). The logits are not cast
    to float32: the view's head runs apart from the model
    (`head.headless`), so Qwen2's and Qwen3's own cast of their logits to
    float32 (exact, so the values are the same) is skipped too. The driver's reductions over the vocabulary read them
    in the model's dtype and compute in float32: a bf16 model's logits are
    written and read at half the bytes (Qwen3-0.6B, batch 128, block 4: a
    float32 [128, 4, 151936] buffer written and read twice a step).
  """
  views = [(slots(c), valid) for c, valid in parts]
  headless = head_lib.headless(model)
  view = headless.model
  for layer in view.layers:
    layer.attn = _WindowAttention(layer.attn, families.family_of(layer.attn))
  if pick is not None:
    view.final_norm = modeling.Picked(view.final_norm, pick)
  layer_caches = {
      f"layer_{i}": {
          "parts": [(c.k[i], c.v[i], valid) for c, valid in views
                    if not isinstance(valid, Span)],
          "spans": [(c.k, c.v, i, valid.lo, valid.hi) for c, valid in views
                    if isinstance(valid, Span)],
      } for i in range(len(view.layers))
  }
  hidden, out = view(tokens, positions, layer_caches, window_mask)
  logits = (headless.logits(hidden) if head_apply is None else
            head_apply(headless, hidden))
  names = [f"layer_{i}" for i in range(len(view.layers))]
  return (logits, [out[n]["k"] for n in names],
          [out[n]["v"] for n in names])


def as_block(keys, values, size: int) -> Cache:
  """The first `size` window slots of a call's keys as a `Cache` part.

  Args:
    keys: Per layer [B, T, K, H], as `window_call` returns them.
    values: Likewise.
    size: Slots to keep, <= T.
  """
  return Cache(jnp.stack([jnp.swapaxes(k[:, :size], 1, 2) for k in keys]),
               jnp.stack([jnp.swapaxes(v[:, :size], 1, 2) for v in values]))


def write_blocks(cache: Cache, block: Cache, start, rows, *,
                 start_step: int = 1) -> Cache:
  """Writes `block` ([L, B, K, W, H]) at slots [start, +W) of the chosen rows.

  One update of every row per distinct start among the chosen rows, the
  rows at other starts (and rows not chosen) keeping their slots: rows that
  write at one shared slot (the cached driver's rows in phase) cost one
  in-place update. The update covers whole chunks of the chunked cache (the
  fewest that hold a block at any start that is a multiple of
  `start_step`), so it writes whole memory tiles. A scatter of a block per
  row was a loop over the rows on XLA's TPU backend (3.0 ms a step at batch
  128).

  Args:
    cache: The chunked cache ([L, B, K, C, TILE, H] keys and values).
    block: The slots to write, [L, B, K, W, H].
    start: int32 [B] each row's first slot, start + W <= C * TILE.
    rows: bool [B] the rows to write.
    start_step: Every start is a multiple of it (the driver's are multiples
      of W): the update then spans fewer chunks.
  """
  if not isinstance(start_step, int) or start_step < 1:
    raise ValueError(f"start_step must be an int >= 1, got {start_step!r}")
  width, chunks = block.k.shape[3], cache.k.shape[3]
  # A block starts at most TILE - gcd(start_step, TILE) rows into a chunk.
  span = min(chunks,
             -(-(TILE - math.gcd(start_step, TILE) + width) // TILE))
  start = start.astype(jnp.int32)
  rel_slot = jnp.arange(span * TILE, dtype=jnp.int32).reshape(span, TILE)

  def body(carry):
    k, v, todo = carry
    at = jnp.min(jnp.where(todo, start, chunks * TILE))
    here = (todo & (start == at))[None, :, None, None, None, None]
    first = jnp.minimum(at // TILE, chunks - span)
    offset = rel_slot + first * TILE - at  # in-block offset of each slot

    def put(array, new):
      old = jax.lax.dynamic_slice_in_dim(array, first, span, axis=3)
      new = new.astype(array.dtype)
      for i in range(width):
        hit = here & (offset == i)[None, None, None, :, :, None]
        old = jnp.where(hit, new[:, :, :, i:i + 1, None], old)
      return jax.lax.dynamic_update_slice_in_dim(array, old, first, axis=3)

    return (put(k, block.k), put(v, block.v),
            todo & ~here[0, :, 0, 0, 0, 0])

  k, v, _ = jax.lax.while_loop(lambda c: jnp.any(c[2]), body,
                               (cache.k, cache.v, rows.astype(bool)))
  return Cache(k, v)
