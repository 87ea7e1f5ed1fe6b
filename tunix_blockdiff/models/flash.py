"""Block-diffusion attention for Tunix models, without forking their code.

(Formerly `tunix_blockdiff.attention.shim`: it calls the model, so it lives
with the models, above the kernels and masks of `attention/`.)

Dense path (any Tunix causal LM, `use_flash_attention=False`): the model
already takes an `attention_mask`; `block_diffusion_logits` passes the
block-causal mask from logical positions. Nothing is patched.

Flash path (Tunix Qwen2 and Qwen3 with `use_flash_attention=True`): their
`Attention.block` builds `mask_lib.CausalMask` and `splash.make_splash_mha`
from module globals and ignores the attention mask. Inside
`enable_block_diffusion_attention`, those two globals of the model's module
are proxies that, *for forwards traced in this thread and context*, return
the block-causal Splash mask (static mode) or a position-aware kernel that
builds each example's mask from its logical positions (dynamic mode, or the
Tokamax kernel). Outside every scope the proxies are removed; while one
scope is open elsewhere they delegate unchanged, so other threads and
ordinary decoding (which never takes the flash branch for one token, and
whose prefill is traced outside the scope) stay causal.

The scope acts when a forward is *traced*: jit a function that enters it
(`block_diffusion_logits` and `make_logits_fn` do so themselves), not a
function that was traced before the scope was entered.

Positions reach the position-aware kernel through the model's `segment_ids`
argument, which Tunix hands to the kernel unchanged: `model_segment_ids`
stacks (document, position) into an int32 [B, L, 2] array there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
from typing import Callable, Iterator

import jax
from jax.interpreters import pxla
import jax.numpy as jnp

from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash
from tunix_blockdiff.attention import tokamax_path
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.objective import alignment as alignment_lib

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
  """

  block_size: int
  cp_size: int = 1
  kernel: str = "splash"
  mask_mode: str = "auto"
  q_tile: int | None = None
  kv_tile: int | None = None
  interpret: bool | None = None
  tokamax_implementation: str | None = None

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
    block = self.options.block_size
    mask = (carrier_q[:, None, 0] == carrier_kv[None, :, 0]) & (
        carrier_q[:, None, 1] // block >= carrier_kv[None, :, 1] // block
    )
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


def model_segment_ids(
    positions: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    validity: jax.Array | None = None,
    position_aware: bool = False,
) -> jax.Array | None:
  """The `segment_ids` argument of a flash Tunix model in a scope.

  Args:
    positions: int [B, L] logical positions.
    segment_ids: Optional int [B, L] document ids.
    validity: Optional bool [B, L].
    position_aware: For `mask_mode='dynamic'` / `kernel='tokamax'`.

  Returns:
    Static: int32 [B, L] document ids with padding apart (None when there is
    neither). Position-aware: int32 [B, L, 2] of (document, position).
  """
  positions = jnp.asarray(positions)
  if positions.ndim != 2:
    raise ValueError(
        f"positions must have shape [batch, length], got {positions.shape}"
    )
  documents = splash.combined_segment_ids(
      segment_ids, validity, positions.shape
  )
  if not position_aware:
    return documents
  if documents is None:
    documents = jnp.zeros(positions.shape, jnp.int32)
  return jnp.stack([documents, positions.astype(jnp.int32)], axis=-1)


def _check_flash_mesh() -> None:
  if pxla.thread_resources.env.physical_mesh.empty:
    raise ValueError(
        "Tunix's flash attention path reads the legacy mesh context: run the"
        " forward inside `with mesh:` (a jax.sharding.Mesh with the model's"
        " sharding axes, e.g. 'fsdp' and 'tp')"
    )


def block_diffusion_logits(
    model,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cp_size: int = 1,
    kernel: str = "splash",
    mask_mode: str = "auto",
    q_tile: int | None = None,
    kv_tile: int | None = None,
    interpret: bool | None = None,
    tokamax_implementation: str | None = None,
) -> jax.Array:
  """Target-aligned block-diffusion logits on the model's own attention path.

  Dense models: `modeling.block_diffusion_logits`. Flash models (Qwen2/3):
  the same logits through Splash or Tokamax; with `mask_mode='auto'` the
  static mask is used when `splash.static_mask_matches` holds for the batch
  and the per-example dynamic mask otherwise (a `lax.cond` when traced, so
  both variants are compiled); `static` on a batch that breaks it raises
  (concrete inputs) or returns NaN logits (traced), never wrong numbers.

  Args:
    model: Tunix causal LM.
    tokens: int [B, L] canvas, physical order.
    positions: int [B, L] logical positions.
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L].
    segment_ids: Optional int [B, L] document ids.
    cp_size: Load-balanced order of the rows (flash path only; the dense
      mask follows positions in any order).
    kernel: `splash` or `tokamax` (flash path).
    mask_mode: `auto`, `static` or `dynamic` (flash path).
    q_tile: Splash query tile override.
    kv_tile: Splash key tile override.
    interpret: Pallas interpret mode; default True off TPU.
    tokamax_implementation: Tokamax implementation; default by backend.

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of slot i.
  """
  if not uses_flash_attention(model):
    return modeling.block_diffusion_logits(
        model,
        tokens,
        positions,
        block_size=block_size,
        alignment=alignment,
        validity=validity,
        segment_ids=segment_ids,
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
  )
  _check_flash_mesh()
  positions = jnp.asarray(positions, jnp.int32)

  def forward(mode: str) -> jax.Array:
    scoped = dataclasses.replace(options, mask_mode=mode)
    carrier = model_segment_ids(
        positions,
        segment_ids=segment_ids,
        validity=validity,
        position_aware=scoped.position_aware,
    )
    with enable_block_diffusion_attention(model, **dataclasses.asdict(scoped)):
      return modeling.call_model(
          model, tokens, positions, None, segment_ids=carrier
      )

  if options.position_aware:
    logits = forward("dynamic")
  else:
    matches = splash.static_mask_matches(
        positions,
        block_size,
        segment_ids=segment_ids,
        validity=validity,
        cp_size=cp_size,
    )
    logits = splash.static_or_dynamic(
        mask_mode,
        matches,
        lambda: forward("static"),
        lambda: forward("dynamic"),
    )
  return alignment_lib.align_logits(
      logits, alignment, positions, validity, segment_ids=segment_ids
  )


def make_logits_fn(
    model,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    **attention_options,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`logits_fn(tokens [B, L], positions [B, L]) -> [B, L, V]` for `denoise`.

  Like `modeling.make_logits_fn`, on the model's own attention path;
  `attention_options` are those of `block_diffusion_logits` (cp_size,
  kernel, mask_mode, tiles, interpret, tokamax_implementation).
  """
  masks.check_block_size(block_size)

  def logits_fn(tokens, positions):
    return block_diffusion_logits(
        modeling.fresh_view(model),  # callable inside loop bodies (qwix)
        tokens,
        positions,
        block_size=block_size,
        alignment=alignment,
        validity=validity,
        segment_ids=segment_ids,
        **attention_options,
    )

  return logits_fn
