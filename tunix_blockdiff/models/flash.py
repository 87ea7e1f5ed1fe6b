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
import dataclasses
from typing import Callable, Iterator

import jax
from jax.interpreters import pxla
import jax.numpy as jnp

from tunix_blockdiff import arrays
from tunix_blockdiff.attention import masks
from tunix_blockdiff.attention import splash
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models.flash_scope import _MaskLibProxy  # pylint: disable=unused-import
from tunix_blockdiff.models.flash_scope import _SplashProxy  # pylint: disable=unused-import
from tunix_blockdiff.models.flash_scope import enable_block_diffusion_attention
from tunix_blockdiff.models.flash_scope import FlashBlockDiffusion
from tunix_blockdiff.models.flash_scope import KERNELS  # pylint: disable=unused-import
from tunix_blockdiff.models.flash_scope import PositionAwareKernel  # pylint: disable=unused-import
from tunix_blockdiff.models.flash_scope import SUPPORTED_FLASH_MODULES
from tunix_blockdiff.models.flash_scope import uses_flash_attention
from tunix_blockdiff.objective import alignment as alignment_lib


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
  positions = arrays.asarray(positions)
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


def supports_splash(model) -> bool:
  """Whether `model` has a flash branch these kernels route (Qwen2/Qwen3)."""
  return (type(model).__module__ in SUPPORTED_FLASH_MODULES
          and hasattr(getattr(model, "config", None), "use_flash_attention"))


@contextlib.contextmanager
def splash_branch(model, tile: int) -> Iterator[None]:
  """Forwards of `model` traced inside take its flash (Splash) branch.

  Sets the shared `config.use_flash_attention` (and the flash block size)
  for the duration only, so that the same model stays on its dense, masked
  path everywhere else (decoding, scorers, export). The flag is read when a
  forward is traced: trace inside the scope.

  Raises:
    ValueError: the model has no such branch (`supports_splash`).
  """
  if not supports_splash(model):
    raise ValueError(
        f"Splash attention runs Tunix's Qwen2 and Qwen3 attention, not"
        f" {type(model).__name__} ({type(model).__module__})")
  config = model.config
  saved = (config.use_flash_attention, config.flash_attention_block_size)
  config.use_flash_attention, config.flash_attention_block_size = True, tile
  try:
    yield
  finally:
    config.use_flash_attention, config.flash_attention_block_size = saved


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


def two_stream_logits(
    model,
    clean_tokens: jax.Array,
    noised_tokens: jax.Array,
    positions: jax.Array,
    *,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kernel: str = "splash",
    mask_mode: str = "dynamic",
    q_tile: int | None = None,
    kv_tile: int | None = None,
    interpret: bool | None = None,
    tokamax_implementation: str | None = None,
) -> jax.Array:
  """`modeling.two_stream_logits` on the model's own attention path.

  Dense models: `modeling.two_stream_logits`. Flash models (Qwen2/3): the
  model runs once on `[x0 | xt]` (length 2L), so each noised block sees the
  clean earlier blocks and itself, under the lazy `TwoStreamBlockMask` with
  segment ids (`mask_mode='static'`: nothing materialised, masked tiles
  skipped; documents must start at block multiples, as for the single
  stream's static mask) or the mask built per example from (document,
  position) pairs (`dynamic`, any layout: [N, 2L, 2L] per example and
  layer); `auto` picks per batch (a `lax.cond` when traced: not for
  gradients, see `config.AttentionConfig`).

  Args:
    model: Tunix causal LM.
    clean_tokens: int [B, L] clean sequence x0.
    noised_tokens: int [B, L] corrupted sequence xt.
    positions: int [B, L] logical positions (shared by both streams).
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L].
    segment_ids: Optional int [B, L].
    kernel: `splash` or `tokamax` (flash path; Tokamax is always
      position-aware).
    mask_mode: `dynamic`, `static` or `auto` (flash path, Splash).
    q_tile: Splash query tile override.
    kv_tile: Splash key tile override.
    interpret: Pallas interpret mode; default True off TPU.
    tokamax_implementation: Tokamax implementation; default by backend.

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of xt slot i.
  """
  common = dict(block_size=block_size, alignment=alignment,
                validity=validity, segment_ids=segment_ids)
  if not uses_flash_attention(model):
    return modeling.two_stream_logits(
        model, clean_tokens, noised_tokens, positions, **common)
  _check_flash_mesh()
  positions = jnp.asarray(positions, jnp.int32)
  twice = lambda x: None if x is None else jnp.concatenate([x, x], axis=1)
  tokens = jnp.concatenate([clean_tokens, noised_tokens], axis=1)
  source = modeling.two_stream_source_index(positions, **common)

  def forward(mode: str) -> jax.Array:
    options = FlashBlockDiffusion(
        block_size, kernel=kernel, mask_mode=mode, q_tile=q_tile,
        kv_tile=kv_tile, interpret=interpret,
        tokamax_implementation=tokamax_implementation, two_stream=True)
    carrier = model_segment_ids(
        twice(positions), segment_ids=twice(segment_ids),
        validity=twice(validity), position_aware=options.position_aware)
    with enable_block_diffusion_attention(model,
                                          **dataclasses.asdict(options)):
      # The output head runs on the L source slots only, not on all 2L.
      return modeling.call_model(
          model, tokens, twice(positions), None, segment_ids=carrier,
          pick=modeling.source_picker(source))

  if kernel == "tokamax" or mask_mode == "dynamic":
    return forward("dynamic")
  matches = splash.static_mask_matches(
      positions, block_size, segment_ids=segment_ids, validity=validity)
  return splash.static_or_dynamic(mask_mode, matches,
                                  lambda: forward("static"),
                                  lambda: forward("dynamic"))


def chosen_logits(
    model,
    inputs: jax.Array,
    positions: jax.Array,
    *,
    attention,
    clean_tokens: jax.Array | None = None,
    block_size: int,
    alignment: str = "same_position",
    validity: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Target-aligned logits on the attention that `attention` picks.

  Single-stream (`clean_tokens` None) or two-stream `[clean_tokens |
  inputs]`; through Splash where `attention.uses_splash` holds for the
  attended length (the model's flash branch taken for this call only,
  `splash_branch`), else on dense masks. The training objective and the RL
  scorers call this one function.

  Args:
    model: Tunix causal LM.
    inputs: int [B, L] the canvas (two-stream: the noised stream).
    positions: int [B, L] logical positions.
    attention: A `config.AttentionConfig`, or None (dense).
    clean_tokens: int [B, L] the clean stream of a two-stream call.
    block_size: Slots per block.
    alignment: `same_position` or `shifted`.
    validity: Optional bool [B, L].
    segment_ids: Optional int [B, L].

  Returns:
    float32 [B, L, V]: `out[:, i]` predicts the clean token of slot i.
  """
  common = dict(block_size=block_size, alignment=alignment,
                validity=validity, segment_ids=segment_ids)
  length = inputs.shape[1] * (1 if clean_tokens is None else 2)
  backend = jax.default_backend()
  scope, tiles = contextlib.nullcontext(), {}
  if attention is not None and attention.uses_splash(
      length, backend, supports_splash(model)):
    tile = attention.tile_for(length, backend)
    scope = splash_branch(model, tile)
    tiles = dict(q_tile=tile, kv_tile=tile, interpret=attention.interpret)
    # `auto` keeps its meaning for the single stream; the two-stream call
    # takes it as `dynamic` (its old, always-right default).
    tiles["mask_mode"] = attention.mask_mode if (
        clean_tokens is None or attention.mask_mode != "auto") else "dynamic"
  # Outside the scope a model is on its own path: dense masks, or the flash
  # branch where it was built with one.
  with scope:
    if clean_tokens is None:
      return block_diffusion_logits(model, inputs, positions, **common,
                                    **tiles)
    return two_stream_logits(model, clean_tokens, inputs, positions,
                             **common, **tiles)


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
