"""Generation with a DiffusionGemma model: canvases over an exact KV cache.

`generate` encodes the (left-padded) prompts causally into the cache, then
per canvas runs one compiled program: the entropy-bound denoising loop
(`entropy_bound.denoise_canvas`) over the decoder, the per-row EOS handling,
and the causal encoding of the finished canvas into the cache. Positions are
physical slots (0 at the first, possibly padding, prompt slot), as in the
reference implementation, and a row stops once a canvas holds its EOS:
slots after that EOS and all later canvases are `pad_token_id`.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import distributed
from tunix_blockdiff.models import programs
from tunix_blockdiff.models.diffusion_gemma import config as config_lib
from tunix_blockdiff.models.diffusion_gemma import model as model_lib
from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """Generated canvases (NumPy).

  Attributes:
    tokens: int [B, K * C] the K canvases, pad after each row's first EOS.
    changed_at: int [B, K * C] the denoising step at which each token last
      changed (colours the output by step).
    canvas_steps: int [B, K] decoder calls per canvas and row.
    forward_passes: int [B] decoder calls per row (finished rows not counted).
    tokens_per_forward: float [B] non-pad new tokens / forward passes (the
      reference's `tokens_per_forward`).
    trace: Per canvas, the sampler's step record (`record_trace=True`):
      `denoise_canvas`'s trace fields, batch first ([B, N, ...]; the
      temperature [B, N]).
  """

  tokens: np.ndarray
  changed_at: np.ndarray
  canvas_steps: np.ndarray
  forward_passes: np.ndarray
  tokens_per_forward: np.ndarray
  trace: list[dict[str, np.ndarray]] | None = None


def finish_canvas(tokens, finished, eos_token_id, pad_token_id):
  """A canvas after the per-row stop (the reference's finalisation).

  Args:
    tokens: int [B, C] the argmax canvas.
    finished: bool [B] rows that stopped in an earlier canvas.
    eos_token_id: EOS id or None.
    pad_token_id: Pad id.

  Returns:
    (tokens with finished rows all pad and slots after a first EOS pad,
    finished after this canvas).
  """
  tokens = jnp.where(finished[:, None], pad_token_id, tokens)
  if eos_token_id is None:
    return tokens, finished
  is_eos = tokens == eos_token_id
  seen = jnp.cumsum(is_eos, axis=-1)
  after = (seen > 0) & ~((seen == 1) & is_eos)
  stopped = jnp.any(is_eos, axis=-1) & ~finished
  tokens = jnp.where(stopped[:, None] & after, pad_token_id, tokens)
  return tokens, finished | stopped


def batch_first(trace: dict[str, jax.Array] | None, batch: int):
  """`denoise_canvas`'s step-first trace [N, B, ...] as [B, N, ...].

  The temperature [N] is broadcast to [B, N], so that every field leads
  with the rows (on a mesh, the sharded and gathered axis).
  """
  if trace is None:
    return None
  out = {k: jnp.moveaxis(v, 0, 1) for k, v in trace.items()
         if k != "temperature"}
  out["temperature"] = jnp.broadcast_to(trace["temperature"],
                                        (batch,) + trace["temperature"].shape)
  return out


def valid_mask(width: int, lengths: np.ndarray) -> np.ndarray:
  """bool [B, width]: the right-aligned prompt slots of each row."""
  return np.arange(width)[None, :] >= (width - np.asarray(lengths))[:, None]


# The prefill and canvas programs, shared by every model with an equal
# GraphDef (`models.programs`): an evaluation's or a reloaded policy's new
# sampler traces and compiles nothing again.
_PROGRAMS: programs.ProgramCache = programs.ProgramCache(16)


def _programs(graphdef, cfg, config, record_trace):
  """(prefill, canvas) jitted programs of a model's GraphDef and settings."""
  key = (cfg, config, record_trace)
  return _PROGRAMS.get(graphdef, key,
                       lambda: _build(graphdef, cfg, config, record_trace))


def _build(graphdef, cfg, config, record_trace):
  """The (prefill, canvas) jitted programs (not yet traced)."""

  def prefill(state, tokens, valid, size):
    # The cache is made here, in the program, so that on a mesh it is laid
    # out like the rows (an eager one would live on one device).
    m = nnx.merge(graphdef, state)
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p), tokens.shape)
    _, cache = m(tokens, positions, valid, m.init_cache(b, size),
                 method="encode")
    return cache, jnp.zeros((b,), bool)

  def canvas(state, cache, key, finished):
    m = nnx.merge(graphdef, state)
    b = finished.shape[0]
    c = cfg.canvas_length
    positions = jnp.broadcast_to(cache.length + jnp.arange(c), (b, c))

    def decoder_fn(tokens, sc_logits, sc_on):
      return m(tokens, positions, cache, sc_logits, sc_on, method="decode")

    result = entropy_bound.denoise_canvas(
        decoder_fn, key, b, c, cfg.vocab_size, config, active=~finished,
        record_trace=record_trace)
    tokens, now_finished = finish_canvas(result.tokens, finished,
                                         config.eos_token_id,
                                         config.pad_token_id)
    _, cache = m(tokens, positions, jnp.ones((b, c), bool), cache,
                 method="encode")
    return (cache, tokens, result.steps, result.changed_at, now_finished,
            jnp.all(now_finished), batch_first(result.trace, b))

  return jax.jit(prefill, static_argnums=3), jax.jit(canvas)


class DiffusionGemmaSampler:
  """Samples a model with compiled prefill and canvas programs.

  The programs are shared by every sampler of a model with an equal
  GraphDef and the same settings (`_PROGRAMS`), so a new sampler of a
  reloaded or retrained model of one architecture compiles nothing again.

  On a mesh (`mesh`, several devices, possibly several processes) the rows
  of every call are sharded over its fsdp axis (`distributed.call_sharded`:
  padded to a multiple of mesh.fsdp, gathered back), so every process gets
  every row, and the same rows as on one device: the noise of row i does
  not depend on the batch size or on the sharding.

  Attributes:
    model: The `DiffusionGemma` (sharded on `mesh` when there is one).
    config: The sampler settings.
    mesh: The mesh rows are sharded over, or None.
  """

  def __init__(self, model: model_lib.DiffusionGemma,
               config: config_lib.SamplerConfig, *,
               record_trace: bool = False,
               mesh: jax.sharding.Mesh | None = None):
    self.model = model
    self.config = config
    self.record_trace = record_trace
    self.mesh = mesh
    # Shared with every sampler of an equal GraphDef and settings.
    self._prefill, self._canvas = _programs(nnx.graphdef(model), model.config,
                                            config, record_trace)

  def generate(self, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
               rng: jax.Array) -> GenerateResult:
    """Samples `ceil(max_new_tokens / C)` canvases after left-padded prompts.

    Args:
      prompt_tokens: int [B, P], each row's prompt right-aligned.
      prompt_lengths: int [B] in [1, P].
      max_new_tokens: New tokens wanted (rounded up to whole canvases).
      rng: PRNG key.

    Returns:
      A `GenerateResult`.
    """
    prompt_tokens = np.asarray(prompt_tokens)
    lengths = np.asarray(prompt_lengths)
    if prompt_tokens.ndim != 2:
      raise ValueError("prompt_tokens must be int [B, P], got shape"
                       f" {prompt_tokens.shape}")
    b, p = prompt_tokens.shape
    if lengths.shape != (b,) or np.any(lengths < 1) or np.any(lengths > p):
      raise ValueError(
          f"prompt_lengths must be int [B={b}] in [1, {p}], got {lengths}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError("max_new_tokens must be a positive int, got"
                       f" {max_new_tokens!r}")
    vocab = self.model.config.vocab_size
    if prompt_tokens.min() < 0 or prompt_tokens.max() >= vocab:
      raise ValueError(f"prompt_tokens must be in [0, {vocab})")
    image = self.model.config.image_token_id
    if image is not None and np.any((prompt_tokens == image) & valid_mask(
        p, lengths)):
      raise ValueError(
          f"prompt_tokens hold the image token {image}: image inputs are"
          " not supported (DiffusionGemma text only)")
    c = self.model.config.canvas_length
    canvases = math.ceil(max_new_tokens / c)
    state = nnx.state(self.model)
    keys = jax.random.split(rng, canvases)

    def run(tokens, valid):
      """Per-canvas outputs (lists) for (possibly global) [B, ...] rows."""
      cache, finished = self._prefill(state, tokens, valid, p + canvases * c)
      out = ([], [], [], [])
      for key in keys:
        cache, canvas, n, ch, finished, done, trace = self._canvas(
            state, cache, key, finished)
        for part, x in zip(out, (canvas, ch, n, trace)):
          part.append(x)
        # The same gathered value on every process: one loop length.
        if bool(distributed.gather(done)):
          break
      return out

    tokens, changed, steps, traces = distributed.call_sharded(
        run, self.mesh, prompt_tokens, valid_mask(p, lengths))
    tokens = np.concatenate([np.asarray(t) for t in tokens], axis=1)
    pad_rest = canvases * c - tokens.shape[1]
    changed = np.concatenate([np.asarray(t) for t in changed], axis=1)
    steps = np.stack([np.asarray(t) for t in steps], axis=1)
    if pad_rest:
      tokens = np.pad(tokens, ((0, 0), (0, pad_rest)),
                      constant_values=self.config.pad_token_id)
      changed = np.pad(changed, ((0, 0), (0, pad_rest)))
      steps = np.pad(steps, ((0, 0), (0, canvases - steps.shape[1])))
    passes = steps.sum(axis=1)
    kept = (tokens != self.config.pad_token_id).sum(axis=1)
    return GenerateResult(
        tokens=tokens,
        changed_at=changed,
        canvas_steps=steps,
        forward_passes=passes,
        tokens_per_forward=kept / np.maximum(passes, 1),
        trace=([jax.tree.map(np.asarray, t) for t in traces]
               if self.record_trace else None),
    )


def generate(model: model_lib.DiffusionGemma, prompt_tokens, prompt_lengths,
             config: config_lib.SamplerConfig, *, max_new_tokens: int,
             rng: jax.Array | None = None) -> GenerateResult:
  """One-shot `DiffusionGemmaSampler(model, config).generate(...)`."""
  rng = jax.random.key(0) if rng is None else rng
  return DiffusionGemmaSampler(model, config).generate(
      prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens, rng=rng)
