"""Trajectory-exact log-probs of DiffusionGemma rollouts under any parameters.

A row's rollout is its prompt, then K canvases, each denoised by the
entropy-bound sampler over a cache of the prompt and the finished canvases
before it. Its log-probability is the sum, over the canvases the row was
still generating in, of `likelihood.canvas_logprob` (whose docstring
derives it): the canvas's uniform start, and per live step the
accepted slots' sampled tokens under that step's temperature-scaled
distribution plus log(1/V) per renoised slot, with the self-conditioning
chain replayed under the scored parameters and acceptance recomputed from
their entropies.

Two deterministic events are conditioned on, exactly as the per-canvas stop
is: each canvas's result (the last argmax, then EOS handling) is taken as
recorded (`trace.tokens`) when encoding the context of later canvases, and
a row's canvases after its EOS are left out (they are discarded: the
completion does not depend on them). Under other parameters their exact
likelihood is an indicator, 1 at the rollout's parameters with zero
gradient, so conditioning on them keeps the scorer exact there (PPO ratio
1) and differentiable.

The context is encoded once, causally over `[prompt ; canvas_1 .. canvas_K]`
(the same causal pass the sampler runs piecewise); canvas k's decoder sees
its first `P + (k - 1) C` slots. With `splash_tile` every attention call of
the scorer (the encoder's [P + K C, P + K C], each canvas's decoder) runs
the Splash kernel on its mask (`layers.attention_scope`); the tile must
divide P and C.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import arrays
from tunix_blockdiff import distributed
from tunix_blockdiff.models.diffusion_gemma import config as dg_config
from tunix_blockdiff.models.diffusion_gemma import layers as dg_layers
from tunix_blockdiff.models.diffusion_gemma import model as model_lib
from tunix_blockdiff.kinds.diffusion_gemma import likelihood as entropy_bound_likelihood
from tunix_blockdiff.kinds.diffusion_gemma import output as output_lib


def check_samples(config: dg_config.SamplerConfig) -> None:
  """Raises ValueError for a greedy `SamplerConfig` (no likelihood)."""
  if config.greedy:
    raise ValueError(
        "sampler_config.greedy=True: greedy trajectories have no likelihood"
        " (each step's denoiser canvas is an argmax, not a draw); RL rollouts"
        " and their scorer need the sampling config")


def check_inputs(model: model_lib.DiffusionGemma, prompt_tokens, prompt_valid,
                 trace: output_lib.DiffusionGemmaTrace) -> None:
  """Raises ValueError, naming the argument, for inconsistent shapes."""
  if not isinstance(trace, output_lib.DiffusionGemmaTrace):
    raise TypeError(
        f"trace must be a DiffusionGemmaTrace, got {type(trace).__name__}")
  if prompt_tokens.ndim != 2:
    raise ValueError(
        f"prompt_tokens must be int [B, P], got shape {prompt_tokens.shape}")
  b = prompt_tokens.shape[0]
  if prompt_valid.shape != prompt_tokens.shape:
    raise ValueError(
        f"prompt_valid must have prompt_tokens' shape {prompt_tokens.shape},"
        f" got {prompt_valid.shape}")
  if trace.canvas.ndim != 4 or trace.canvas.shape[0] != b:
    raise ValueError(
        f"trace.canvas must be int [B={b}, K, N, C], got shape"
        f" {trace.canvas.shape}")
  _, k, _, c = trace.canvas.shape
  if c != model.config.canvas_length:
    raise ValueError(
        f"trace canvases have {c} slots, the model's canvas_length is"
        f" {model.config.canvas_length}")
  if trace.tokens.shape != (b, k * c):
    raise ValueError(
        f"trace.tokens must be int [B={b}, K*C={k * c}], got shape"
        f" {trace.tokens.shape}")


def check_splash_tile(tile: int | None, **lengths: int) -> None:
  """ValueError unless `tile` (None: dense) is a multiple of 128 that
  divides every length given (by name: `prompt_width=P`, ...)."""
  if tile is None:
    return
  if isinstance(tile, bool) or not isinstance(tile, int) or tile < 128 or (
      tile % 128):
    raise ValueError(f"splash_tile must be a multiple of 128, got {tile!r}")
  bad = [f"{name} {length}" for name, length in lengths.items()
         if length % tile]
  if bad:
    raise ValueError(f"splash_tile {tile} must divide the {', '.join(bad)}")


def sequence_logprobs(model: model_lib.DiffusionGemma, prompt_tokens,
                      prompt_valid, trace: output_lib.DiffusionGemmaTrace,
                      config: dg_config.SamplerConfig, *,
                      per_canvas: bool = False,
                      splash_tile: int | None = None,
                      splash_interpret: bool | None = None) -> jax.Array:
  """log P of each row's recorded trajectories under `model` (differentiable).

  Args:
    model: The scored `DiffusionGemma` (any parameters).
    prompt_tokens: int [B, P] the rollout's left-padded prompts.
    prompt_valid: bool [B, P] the real prompt slots.
    trace: The rollout's `DiffusionGemmaTrace`.
    config: The rollout's `SamplerConfig` (temperature schedule, bound).
    per_canvas: Return float32 [B, K] (0 for inactive canvases) instead of
      the row totals.
    splash_tile: Run every attention call on the Splash kernel with this
      tile (it divides P and C); None: dense.
    splash_interpret: Pallas interpret mode; None: off TPU.

  Returns:
    float32 [B] (or [B, K]).
  """
  check_samples(config)
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_valid = jnp.asarray(prompt_valid, bool)
  check_inputs(model, prompt_tokens, prompt_valid, trace)
  b, p = prompt_tokens.shape
  _, k, _, c = trace.canvas.shape
  check_splash_tile(splash_tile, prompt_width=p, canvas_length=c)
  with dg_layers.attention_scope(splash_tile, splash_interpret):
    return _sequence_logprobs(model, prompt_tokens, prompt_valid, trace,
                              config, per_canvas)


def _sequence_logprobs(model, prompt_tokens, prompt_valid, trace, config,
                       per_canvas: bool) -> jax.Array:
  """`sequence_logprobs` after its checks, in the caller's attention scope."""
  b, p = prompt_tokens.shape
  _, k, _, c = trace.canvas.shape
  total = p + k * c
  tokens = jnp.concatenate(
      [prompt_tokens, jnp.asarray(trace.tokens, prompt_tokens.dtype)], axis=1)
  valid = jnp.concatenate([prompt_valid, jnp.ones((b, k * c), bool)], axis=1)
  positions = jnp.broadcast_to(jnp.arange(total), (b, total))
  _, cache = model(tokens, positions, valid, model.init_cache(b, total),
                   method="encode")
  slots = jnp.arange(total)
  vocab = model.config.vocab_size

  def one_canvas(carry, xs):
    index, canvas, nxt, live, sc_on, active = xs
    length = (p + index * c).astype(jnp.int32)
    context = model_lib.Cache(cache.k, cache.v,
                              cache.valid & (slots < length)[None], length)
    canvas_positions = jnp.broadcast_to(length + jnp.arange(c), (b, c))

    def decoder_fn(x, sc_logits, sc_mask):
      return model(x, canvas_positions, context, sc_logits, sc_mask,
                   method="decode")

    step_trace = dict(canvas=canvas, next_canvas=nxt, live=live, sc_on=sc_on)
    logp = entropy_bound_likelihood.canvas_logprob(decoder_fn, step_trace,
                                                   config, vocab)
    return carry, jnp.where(active, logp, 0.0)

  def steps_first(x):  # [B, K, N, ...] -> [K, N, B, ...]
    return jnp.moveaxis(arrays.asarray(x), 0, 2)

  xs = (jnp.arange(k), steps_first(trace.canvas),
        steps_first(trace.next_canvas), steps_first(trace.live),
        steps_first(trace.sc_on), arrays.asarray(trace.active).T)
  _, per_canvas_logp = jax.lax.scan(one_canvas, None, xs)   # [K, B]
  per_canvas_logp = per_canvas_logp.T
  if per_canvas:
    return per_canvas_logp
  return jnp.sum(per_canvas_logp, axis=-1)


class SequenceScorer:
  """A compiled `sequence_logprobs` for one model structure.

  The model's GraphDef is split once here and closed over (it is not
  hashable, so it is never a static argument); `__call__` takes any model
  of that structure (the policy, the reference, the rollout copy). On a
  mesh (`mesh`) the rows, prompts and trace alike, are sharded over its
  fsdp axis and the log-probs gathered (`distributed.call_sharded`), the
  same on every process.
  """

  def __init__(self, model: model_lib.DiffusionGemma,
               config: dg_config.SamplerConfig, *,
               mesh: jax.sharding.Mesh | None = None,
               splash_tile: int | None = None,
               splash_interpret: bool | None = None):
    if not isinstance(config, dg_config.SamplerConfig):
      raise TypeError(
          f"config must be a SamplerConfig, got {type(config).__name__}")
    check_samples(config)
    check_splash_tile(splash_tile, canvas_length=model.config.canvas_length)
    graphdef, _ = nnx.split(model)
    self.config = config
    self.mesh = mesh
    self.splash_tile = splash_tile

    def score(state, prompt_tokens, prompt_valid, trace):
      m = nnx.merge(graphdef, state)
      return sequence_logprobs(m, prompt_tokens, prompt_valid, trace, config,
                               splash_tile=splash_tile,
                               splash_interpret=splash_interpret)

    self._score = jax.jit(score)

  def __call__(self, model: model_lib.DiffusionGemma, prompt_tokens,
               prompt_valid, trace: output_lib.DiffusionGemmaTrace
               ) -> jax.Array:
    """float32 [B] log P of each row's trajectories under `model`."""
    check_inputs(model, arrays.asarray(prompt_tokens),
                 arrays.asarray(prompt_valid), trace)
    leaves, treedef = jax.tree.flatten(trace)
    state = nnx.state(model)
    return arrays.asarray(distributed.call_sharded(
        lambda tokens, valid, *rows: self._score(
            state, tokens, valid, jax.tree.unflatten(treedef, rows)),
        self.mesh, prompt_tokens, np.asarray(prompt_valid, bool), *leaves))


__all__ = ["SequenceScorer", "check_inputs", "check_samples",
           "check_splash_tile", "sequence_logprobs"]
