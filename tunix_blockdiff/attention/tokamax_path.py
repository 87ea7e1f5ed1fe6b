"""Block-causal attention through Tokamax (`tokamax.dot_product_attention`).

Tokamax picks an attention kernel per backend: `xla` and `xla_chunked` run
everywhere (CPU included), `triton` and `cudnn` need a GPU, `mosaic` a GPU or
TPU. The block-causal mask is passed as a boolean array built from logical
positions, so packed, unaligned and load-balanced rows are all exact.

Shapes: B batch, T query length, S key length, N query heads, K key heads,
H head dim.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from tunix_blockdiff.attention import masks

# implementation -> backends it runs on (None: every backend).
IMPLEMENTATION_BACKENDS = {
    "xla": None,
    "xla_chunked": None,
    "triton": ("gpu",),
    "cudnn": ("gpu",),
    "mosaic": ("gpu", "tpu"),
}
_DEFAULT_BY_BACKEND = {"tpu": "mosaic", "gpu": "triton"}


def tokamax_available() -> bool:
  """Whether the optional `tokamax` package can be imported."""
  try:
    importlib.import_module("tokamax")
  except ImportError:
    return False
  return True


def _tokamax():
  try:
    tokamax = importlib.import_module("tokamax")
  except ImportError as error:
    raise ImportError(
        "The Tokamax attention path needs the `tokamax` package: pip install"
        " tokamax"
    ) from error
  # Tokamax reads its options from absl flags and, if nobody parsed them,
  # parses sys.argv itself, which fails under any other command line (pytest,
  # a notebook kernel). Keep the defaults instead.
  from absl import flags  # pylint: disable=g-import-not-at-top

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def resolve_implementation(
    implementation: str | None = None, backend: str | None = None
) -> str:
  """The Tokamax implementation to use on `backend`, checked before compute.

  Args:
    implementation: One of `IMPLEMENTATION_BACKENDS`, or None for the
      backend's default (`mosaic` on TPU, `triton` on GPU, `xla` elsewhere).
    backend: `jax.default_backend()` when None.

  Returns:
    The implementation name.

  Raises:
    ValueError: unknown implementation, or one that does not run on `backend`.
  """
  backend = jax.default_backend() if backend is None else backend
  if implementation is None:
    return _DEFAULT_BY_BACKEND.get(backend, "xla")
  if implementation not in IMPLEMENTATION_BACKENDS:
    raise ValueError(
        f"implementation must be one of {tuple(IMPLEMENTATION_BACKENDS)} or"
        f" None, got {implementation!r}"
    )
  backends = IMPLEMENTATION_BACKENDS[implementation]
  if backends is not None and backend not in backends:
    raise ValueError(
        f"Tokamax implementation {implementation!r} runs only on"
        f" {' or '.join(backends)}, but the JAX backend is {backend!r}; use"
        " implementation='xla' (or None to pick by backend)"
    )
  return implementation


def tokamax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
  """`tokamax.dot_product_attention` with a boolean mask shared by all heads.

  Args:
    query: float [B, T, N, H] (or [T, N, H]).
    key: float [B, S, K, H] (K divides N).
    value: float [B, S, K, H].
    mask: bool [B, T, S] (or [T, S]); no all-False rows at used queries.
    scale: Logit scale; default `H ** -0.5`.
    implementation: See `resolve_implementation`.

  Returns:
    float [B, T, N, H].
  """
  implementation = resolve_implementation(implementation)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be bool, got {mask.dtype}")
  if mask.ndim != query.ndim - 1 or mask.shape[-2:] != (
      query.shape[-3],
      key.shape[-3],
  ):
    raise ValueError(
        f"mask must have shape [..., T, S] = [..., {query.shape[-3]},"
        f" {key.shape[-3]}] matching query/key, got {mask.shape}"
    )
  return _tokamax().dot_product_attention(
      query,
      key,
      value,
      mask=mask[..., None, :, :],
      scale=scale,
      implementation=implementation,
  )


def tokamax_block_causal_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block_size: int,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    validity: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
  """Block-causal self-attention through Tokamax, from logical positions.

  Args:
    query: float [B, L, N, H].
    key: float [B, L, K, H].
    value: float [B, L, K, H].
    block_size: Slots per block.
    positions: int [B, L] logical positions (any physical order).
    segment_ids: Optional int [B, L] document ids.
    validity: Optional bool [B, L]; invalid keys are never attended.
    scale: Logit scale; default `H ** -0.5`.
    implementation: See `resolve_implementation`.

  Returns:
    float [B, L, N, H]; rows of invalid queries are unspecified.
  """
  implementation = resolve_implementation(implementation)
  mask = masks.block_causal_mask(
      positions,
      positions,
      block_size,
      q_segment_ids=segment_ids,
      kv_segment_ids=segment_ids,
      kv_valid=validity,
  )
  # A query always attends itself, so padding rows never have an empty mask.
  mask = mask | jnp.eye(mask.shape[-1], dtype=jnp.bool_)[None]
  return tokamax_attention(
      query, key, value, mask, scale=scale, implementation=implementation
  )
