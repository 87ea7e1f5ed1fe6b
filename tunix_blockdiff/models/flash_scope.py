"""The scope that routes a flash Tunix model's attention through our kernels.

`enable_block_diffusion_attention(model, block_size, ...)` swaps, for the
current context only, the mask and Splash modules a flash Tunix model reads
for proxies that build block-causal (optionally load-balanced or
position-aware) masks and kernels; `models.flash` computes logits inside it
(its docstring has the whole picture). Split from `models/flash.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
from typing import Iterator

import jax
import jax.numpy as jnp

from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash
from tunix_blockdiff.attention import tokamax_path

KERNELS = ("splash", "tokamax")
# Tunix model modules whose flash path this shim knows (same code in both).
SUPPORTED_FLASH_MODULES = (
    "tunix.models.qwen2.model",
    "tunix.models.qwen3.model",
)


@dataclasses.dataclass(frozen=True)
class FlashBlockDiffusion:
  """How a Tunix flash-attention model runs block-diffusion attention.

  Attributes:
    block_size: Slots per block.
    cp_size: Load-balanced order of the rows (`reorder_batch_for_context_
      parallel` with the same cp); 1 for logical order.
    kernel: `splash` (TPU; interpret mode elsewhere) or `tokamax`.
    mask_mode: `auto` (static when the batch allows it, else dynamic; only
      in `block_diffusion_logits`), `static` or `dynamic`.
    q_tile: Splash query tile; default the model's flash block size.
    kv_tile: Splash key tile (multiple of 128); default likewise.
    interpret: Pallas interpret mode; default True off TPU.
    tokamax_implementation: Tokamax implementation; default by backend.
    two_stream: The rows are `[x0 | xt]` (length 2L, both halves at the
      same positions) under the two-stream mask (`masks.two_stream_mask`):
      the lazy `TwoStreamBlockMask` with segment ids (`static`) or the
      position-aware one (`dynamic`); logical order only.
  """

  block_size: int
  cp_size: int = 1
  kernel: str = "splash"
  mask_mode: str = "auto"
  q_tile: int | None = None
  kv_tile: int | None = None
  interpret: bool | None = None
  tokamax_implementation: str | None = None
  two_stream: bool = False

  def __post_init__(self):
    masks.check_block_size(self.block_size)
    if isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int):
      raise TypeError(
          f"cp_size must be an int, got {type(self.cp_size).__name__}"
      )
    if self.cp_size < 1:
      raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
    splash.logical_index(0, 2 * self.cp_size, self.cp_size)  # odd cp raises.
    if self.kernel not in KERNELS:
      raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
    if self.mask_mode not in splash.MASK_MODES:
      raise ValueError(
          f"mask_mode must be one of {splash.MASK_MODES}, got"
          f" {self.mask_mode!r}"
      )
    if self.q_tile is not None or self.kv_tile is not None:
      splash.block_sizes(self.q_tile or 128, self.kv_tile or 128)
    if self.kernel == "tokamax":
      tokamax_path.resolve_implementation(self.tokamax_implementation)
    if self.two_stream and (self.cp_size != 1 or self.mask_mode == "auto"):
      raise ValueError(
          "two_stream attention needs cp_size=1 and mask_mode 'static' or"
          f" 'dynamic' (chosen per batch by its caller), got cp_size="
          f"{self.cp_size}, mask_mode={self.mask_mode!r}")

  @property
  def position_aware(self) -> bool:
    """Whether the kernel reads positions from the segment-id carrier."""
    return self.kernel == "tokamax" or self.mask_mode == "dynamic"

  def tile_sizes(self, model_sizes) -> tuple[int, int]:
    q_tile = self.q_tile or (model_sizes.block_q if model_sizes else 128)
    kv_tile = self.kv_tile or (model_sizes.block_kv if model_sizes else 128)
    return q_tile, kv_tile

  def resolved_interpret(self) -> bool:
    return (
        splash.default_interpret() if self.interpret is None else self.interpret
    )


_ACTIVE: contextvars.ContextVar[FlashBlockDiffusion | None] = (
    contextvars.ContextVar("tunix_blockdiff_flash_attention", default=None)
)
_INSTALL_LOCK = threading.Lock()
_INSTALL_COUNTS: dict[str, int] = {}


@jax.tree_util.register_pytree_node_class
class PositionAwareKernel:
  """Stands in for Tunix's Splash kernel; masks from per-token positions.

  Called like a Splash kernel on one example: `q [N, Q, H]` (pre-scaled),
  `k, v [K, L, H]`, `segment_ids=SegmentIds(q=[Q, 2], kv=[L, 2])` where the
  last axis is (document, logical position). Q may be a query-sequence shard
  of L. No array leaves, so it passes through `shard_map` replicated.
  """

  def __init__(self, options: FlashBlockDiffusion, q_tile: int, kv_tile: int):
    self.options = options
    self.q_tile = q_tile
    self.kv_tile = kv_tile

  def manual_sharding_spec(self, sharding) -> PositionAwareKernel:
    del sharding
    return self

  def tree_flatten(self):
    return (), (self.options, self.q_tile, self.kv_tile)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def mask(self, carrier_q, carrier_kv) -> jax.Array:
    """bool [Q, L] from (document, position) pairs of queries and keys."""
    block = self.options.block_size
    same_doc = carrier_q[:, None, 0] == carrier_kv[None, :, 0]
    q_block = carrier_q[:, None, 1] // block
    k_block = carrier_kv[None, :, 1] // block
    if not self.options.two_stream:
      return same_doc & (q_block >= k_block)
    length = carrier_kv.shape[0]
    if carrier_q.shape[0] != length or length % 2:
      raise ValueError(
          "two_stream attention needs the whole [x0 | xt] row as queries"
          f" and keys (even length), got Q={carrier_q.shape[0]}, L={length}")
    noised = jnp.arange(length) >= length // 2
    q_noised, k_noised = noised[:, None], noised[None, :]
    # x0 -> x0 block-causal; xt -> x0 strictly earlier blocks; xt -> xt the
    # same block; x0 -> xt never (`masks.two_stream_mask`).
    clean_query = ~k_noised & (k_block <= q_block)
    noised_query = jnp.where(k_noised, k_block == q_block, k_block < q_block)
    return same_doc & jnp.where(q_noised, noised_query, clean_query)

  def __call__(self, query, key, value, segment_ids=None):
    carrier_q = None if segment_ids is None else segment_ids.q
    carrier_kv = None if segment_ids is None else segment_ids.kv
    for name, carrier, length in (
        ("q", carrier_q, query.shape[1]),
        ("kv", carrier_kv, key.shape[1]),
    ):
      if carrier is None or carrier.shape != (length, 2):
        raise ValueError(
            "Dynamic block-diffusion attention reads (document, position)"
            f" pairs from segment_ids; got {name}="
            f"{None if carrier is None else carrier.shape}, expected"
            f" ({length}, 2). Call the model through shim.block_diffusion_"
            "logits, or pass segment_ids=shim.model_segment_ids(...,"
            " position_aware=True)."
        )
    mask = self.mask(carrier_q, carrier_kv)
    if self.options.kernel == "tokamax":
      out = tokamax_path.tokamax_attention(
          jnp.swapaxes(query, 0, 1),
          jnp.swapaxes(key, 0, 1),
          jnp.swapaxes(value, 0, 1),
          mask,
          scale=1.0,
          implementation=self.options.tokamax_implementation,
      )
      return jnp.swapaxes(out, 0, 1)
    return splash.dynamic_splash_attention(
        query,
        key,
        value,
        mask,
        q_tile=self.q_tile,
        kv_tile=self.kv_tile,
        interpret=self.options.resolved_interpret(),
    )


class _MaskLibProxy:
  """`mask_lib` seen by a Tunix model module; block-causal inside a scope."""

  def __init__(self, original):
    self._original = original

  def __getattr__(self, name):
    return getattr(self._original, name)

  def CausalMask(self, shape, offset=0, shard_count=1):  # pylint: disable=invalid-name
    options = _ACTIVE.get()
    if options is None:
      return self._original.CausalMask(
          shape, offset=offset, shard_count=shard_count
      )
    if shape[0] != shape[1] or offset:
      raise ValueError(
          "block-diffusion flash attention needs square self-attention, got"
          f" shape={shape}, offset={offset}"
      )
    if options.two_stream:
      return splash.TwoStreamBlockMask(shape[0], options.block_size)
    return splash.block_causal_splash_mask(
        shape[0], options.block_size, cp_size=options.cp_size, kv_reordered=True
    )


class _SplashProxy:
  """`splash` seen by a Tunix model module; our kernels inside a scope."""

  def __init__(self, original):
    self._original = original

  def __getattr__(self, name):
    return getattr(self._original, name)

  def make_splash_mha(self, mask, *, block_sizes=None, **kwargs):
    options = _ACTIVE.get()
    if options is None:
      return self._original.make_splash_mha(
          mask, block_sizes=block_sizes, **kwargs
      )
    q_tile, kv_tile = options.tile_sizes(block_sizes)
    if options.position_aware:
      return PositionAwareKernel(options, q_tile, kv_tile)
    shards = dict(
        head_shards=kwargs.pop("head_shards", 1),
        q_seq_shards=kwargs.pop("q_seq_shards", 1),
    )
    kwargs.pop("interpret", None)
    sizes = splash.block_sizes(q_tile, kv_tile)
    interpret = options.resolved_interpret()
    if kwargs:  # Options this shim does not know: Splash's own builder.
      return self._original.make_splash_mha(
          mask, block_sizes=sizes, interpret=interpret, **shards, **kwargs
      )
    return splash.make_splash_kernel(
        mask, block_sizes=sizes, interpret=interpret, **shards
    )


def uses_flash_attention(model) -> bool:
  """Whether a Tunix model takes its flash (Splash) attention branch."""
  return bool(
      getattr(getattr(model, "config", None), "use_flash_attention", False)
  )


def _flash_module(model):
  if not uses_flash_attention(model):
    return None
  name = type(model).__module__
  if name not in SUPPORTED_FLASH_MODULES:
    raise ValueError(
        "Block-diffusion flash attention supports Tunix"
        f" {SUPPORTED_FLASH_MODULES}; {type(model).__name__} ({name}) has"
        " use_flash_attention=True. Set use_flash_attention=False to use the"
        " dense path, which works for any Tunix causal LM."
    )
  module = sys.modules[name]
  for attribute in ("mask_lib", "splash"):
    if not hasattr(module, attribute):
      raise ValueError(
          f"{name} has no `{attribute}` global to route attention through"
      )
  return module


def _install(module) -> None:
  with _INSTALL_LOCK:
    count = _INSTALL_COUNTS.get(module.__name__, 0)
    if count == 0:
      module.mask_lib = _MaskLibProxy(module.mask_lib)
      module.splash = _SplashProxy(module.splash)
    _INSTALL_COUNTS[module.__name__] = count + 1


def _uninstall(module) -> None:
  with _INSTALL_LOCK:
    count = _INSTALL_COUNTS[module.__name__] - 1
    _INSTALL_COUNTS[module.__name__] = count
    if count == 0:
      module.mask_lib = module.mask_lib._original  # pylint: disable=protected-access
      module.splash = module.splash._original  # pylint: disable=protected-access


@contextlib.contextmanager
def enable_block_diffusion_attention(
    model,
    block_size: int,
    *,
    cp_size: int = 1,
    kernel: str = "splash",
    mask_mode: str = "static",
    q_tile: int | None = None,
    kv_tile: int | None = None,
    interpret: bool | None = None,
    tokamax_implementation: str | None = None,
    two_stream: bool = False,
) -> Iterator[FlashBlockDiffusion]:
  """Flash forwards of `model` traced inside use block-diffusion attention.

  A no-op for dense models (their mask is the `attention_mask` argument).
  For flash models: `mask_mode='static'` uses the lazy block-causal mask
  over physical rows (documents at block multiples; pass
  `segment_ids=model_segment_ids(...)` for packing and padding);
  `mask_mode='dynamic'` or `kernel='tokamax'` build masks from positions
  and need `segment_ids=model_segment_ids(..., position_aware=True)`.
  Restores the model module on exit; nests; thread- and context-local.

  Args:
    model: A Tunix causal LM.
    block_size: Slots per block.
    cp_size: Load-balanced order of the rows (1: logical order).
    kernel: `splash` or `tokamax`.
    mask_mode: `static` or `dynamic` (`auto` needs the positions: use
      `block_diffusion_logits`).
    q_tile: Splash query tile override.
    kv_tile: Splash key tile override (multiple of 128).
    interpret: Pallas interpret mode; default True off TPU.
    tokamax_implementation: Tokamax implementation; default by backend.
    two_stream: Rows are `[x0 | xt]` under the two-stream mask (dynamic
      masks only).

  Yields:
    The validated `FlashBlockDiffusion` options.
  """
  if mask_mode == "auto":
    raise ValueError(
        "mask_mode='auto' needs the batch's positions; use"
        " shim.block_diffusion_logits, or pick 'static' or 'dynamic' here"
    )
  options = FlashBlockDiffusion(
      block_size,
      cp_size=cp_size,
      kernel=kernel,
      mask_mode=mask_mode,
      q_tile=q_tile,
      kv_tile=kv_tile,
      interpret=interpret,
      tokamax_implementation=tokamax_implementation,
      two_stream=two_stream,
  )
  module = _flash_module(model)
  if module is not None:
    _install(module)
  token = _ACTIVE.set(options)
  try:
    yield options
  finally:
    _ACTIVE.reset(token)
    if module is not None:
      _uninstall(module)
