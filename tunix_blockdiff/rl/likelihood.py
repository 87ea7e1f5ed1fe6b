"""The likelihood of block-diffusion rollouts that RL trains with.

Two likelihoods of a rollout (its denoising trace: every committed token and
its commit step), both scored from the canvases `rl.scoring` rebuilds:

* `exact` (default): the probability of everything the sampler did, per step
  the committed tokens' proposal probabilities times the probability of the
  selection (which eligible slots cleared the threshold, or were the most
  confident, and which did not), in closed form (`rl.selection`). The
  empirical frequencies of sampled trajectories match it
  (tests/rl/test_likelihood.py). Per-token log-probs carry an even share of
  their step's selection log-prob, so they sum to the trajectory log-prob.
  Defined for sampling (temperature > 0): a greedy trajectory is
  deterministic, its log-prob is 0 by definition, and asking for it raises.
* `committed_only`: the product of the committed tokens' proposal
  probabilities alone (the log-probs the rollout records). It leaves out the
  selection events, so its policy gradient is biased.

`trajectory_logprob(model_or_logits_fn, generation_result, config)` is the
public entry point (`tbd.trajectory_logprob`); `per_token_logps` and
`score_trajectories_jit` serve the RL losses and the cluster.

Shapes: B batch, P prompt slots, N completion slots, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable
import threading

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rl import selection
from tunix_blockdiff.rl import trajectory_batch
from tunix_blockdiff.rollout import transition

LIKELIHOODS = ("exact", "committed_only")


def check_likelihood(
    likelihood: str, config: config_lib.DenoiseConfig | None = None
) -> str:
  """Returns `likelihood` if valid for rollouts made with `config`, else raises.

  Args:
    likelihood: `exact` or `committed_only`.
    config: The rollout's `DenoiseConfig`, if known.

  Raises:
    ValueError: an unknown name, or `exact` for greedy rollouts (temperature
      0: the trajectory is deterministic and its log-prob is 0 by definition;
      use `committed_only` to score greedy tokens under the plain softmax).
  """
  if likelihood not in LIKELIHOODS:
    raise ValueError(
        f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}"
    )
  if likelihood == "exact" and config is not None and config.temperature == 0:
    raise ValueError(
        "likelihood='exact' needs sampled rollouts (config.temperature > 0):"
        " a greedy trajectory is deterministic (log-prob 0 by definition);"
        " use likelihood='committed_only' for greedy rollouts"
    )
  return likelihood


def check_attention(attention) -> None:
  """A TypeError unless `attention` is None or an `AttentionConfig`."""
  if attention is not None and not isinstance(
      attention, config_lib.AttentionConfig):
    raise TypeError("attention must be an AttentionConfig or None, got"
                    f" {type(attention).__name__}")


def per_token_logps(
    model,
    batch: compat.DiffusionTokenBatch,
    config: config_lib.DenoiseConfig,
    *,
    likelihood: str = "exact",
    stop_gradient: bool = True,
    return_entropy: bool = False,
    attention: config_lib.AttentionConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Per-token log-probs of a prepared rollout batch under `likelihood`.

  Args:
    model: The policy (a Tunix model used as a block-diffusion model).
    batch: From `prepare_trajectory_batch`: the whole trace (every
      committed token, also those after EOS in its block: they shaped later
      canvases); `loss_weights == 0` marks slots returned as 0.
    config: The rollout's `DenoiseConfig`.
    likelihood: `exact` or `committed_only` (see the module docstring).
    stop_gradient: Detach the result from the model.
    return_entropy: Also return each slot's proposal entropy at its step.
    attention: The scoring call's attention (`flash.chosen_logits`: Splash
      where it applies, else dense; None: dense). The learner's loss and the
      engine's old/reference scores must use the same one, so that the
      GRPO ratio is exactly 1 before the first update.

  Returns:
    float32 [B, N] log-probs (0 where `loss_weights == 0`; with `exact`, a
    token's proposal log-prob plus its share of its step's selection
    log-prob), and with `return_entropy` float32 [B, N] entropies.
  """
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  check_likelihood(likelihood, config)
  check_attention(attention)
  if likelihood == "committed_only":
    return scoring.compute_diffusion_per_token_logps(
        model,
        batch,
        scoring.trajectory_logits_fn_for(config, attention),
        config=config,
        stop_gradient=stop_gradient,
        return_entropy=return_entropy,
    )
  inputs = batch.model_inputs
  logits, ranks = scoring.rank_logits_fn_for(config, attention)(model, inputs)
  transition.check_vocab(logits.shape[-1], config)
  commit_step = inputs["commit_step"]
  committed = commit_step >= 0
  positions = trajectory_batch.sequence_layout(inputs, config.mask_token_id)[
      "positions"
  ][:, -commit_step.shape[1] :]
  log_probs = transition.proposal_log_probs(logits, config)
  logps = selection.per_token_log_likelihood(
      log_probs,
      inputs["completion_tokens"],
      jnp.where(committed, ranks, -1),
      ranks,
      positions,
      config,
  )
  active = jnp.asarray(batch.loss_weights) != 0
  logps = jnp.where(active, logps, 0.0)
  if stop_gradient:
    logps = jax.lax.stop_gradient(logps)
  if not return_entropy:
    return logps
  own = jnp.take_along_axis(log_probs, ranks[None, :, :, None], axis=0)[0]
  entropy = jnp.where(active, scoring.proposal_entropy(own), 0.0)
  if stop_gradient:
    entropy = jax.lax.stop_gradient(entropy)
  return logps, entropy


# (config, likelihood, attention) -> [(graphdef, jitted scorer)]. Models with equal graph
# definitions (the policy and its reference copy, the rollout and the actor)
# share one compiled program; GraphDefs are unhashable, so they are compared
# with ==.
_SCORERS: dict[tuple[config_lib.DenoiseConfig, str, Any], list] = {}
_SCORERS_LOCK = threading.Lock()


def _jitted_scorer(graphdef, config: config_lib.DenoiseConfig, likelihood,
                   attention=None):
  with _SCORERS_LOCK:
    entries = _SCORERS.setdefault((config, likelihood, attention), [])
    for known, program in entries:
      if known == graphdef:
        return program

    def run(state, model_inputs, target_ids, loss_weights):
      batch = compat.DiffusionTokenBatch(
          model_inputs=model_inputs,
          target_ids=target_ids,
          loss_weights=loss_weights,
      )
      return per_token_logps(
          nnx.merge(graphdef, state), batch, config, likelihood=likelihood,
          attention=attention,
      )

    program = jax.jit(run)
    entries.append((graphdef, program))
    return program


def score_trajectories_jit(
    model,
    prompt_tokens,
    prompt_mask,
    completion_tokens,
    commit_step,
    config: config_lib.DenoiseConfig,
    *,
    likelihood: str = "exact",
    attention: config_lib.AttentionConfig | None = None,
) -> jax.Array:
  """Detached per-token log-probs of rollouts, as a cached compiled program.

  Validates eagerly, then runs one program compiled per (model structure,
  config, likelihood, attention, shapes); the model's current parameters are passed on
  each call, so updated weights need no recompilation.

  Args:
    model: Tunix causal LM used as a block-diffusion model.
    prompt_tokens: int [B, P] left-padded prompts.
    prompt_mask: bool [B, P].
    completion_tokens: int [B, N] the trace tokens.
    commit_step: int [B, N], -1 where never committed.
    config: The rollout's `DenoiseConfig`.
    likelihood: `exact` or `committed_only`.
    attention: The model call's attention (see `per_token_logps`).

  Returns:
    float32 [B, N] log-probs, 0 where never committed (see `per_token_logps`).
  """
  check_likelihood(likelihood, config)
  check_attention(attention)
  batch = trajectory_batch.prepare_trajectory_batch(
      prompt_tokens,
      prompt_mask,
      completion_tokens,
      commit_step,
      mask_token_id=config.mask_token_id,
  )
  graphdef, state = nnx.split(model)
  program = _jitted_scorer(graphdef, config, likelihood, attention)
  return program(
      state, batch.model_inputs, batch.target_ids, batch.loss_weights
  )


def _per_step_logits(logits_fn, result, config) -> jax.Array:
  """Completion logits float32 [T, B, N, V] of every global step's canvas."""
  tokens, positions, _, _ = result.sequence()
  del tokens
  num_new = result.trace_tokens.shape[1]
  num_steps = int(np.max(np.asarray(result.trace_commit_step), initial=-1)) + 1
  per_step = []
  for step in range(num_steps):
    canvas = result.canvas_at(step, config.mask_token_id)
    logits = logits_fn(canvas, positions)
    if logits.ndim != 3 or logits.shape[:2] != canvas.shape:
      raise ValueError(
          "logits_fn must return logits of shape [batch, length, vocab] with"
          f" [batch, length] = {canvas.shape}, got {logits.shape}"
      )
    per_step.append(logits[:, -num_new:].astype(jnp.float32))
  if not per_step:
    return jnp.zeros((0,) + result.trace_tokens.shape + (2,), jnp.float32)
  return jnp.stack(per_step)


def trajectory_per_token_logprob(
    model_or_logits_fn: Any,
    generation_result,
    config: config_lib.DenoiseConfig,
    *,
    likelihood: str = "exact",
) -> jax.Array:
  """Per-token log-probs float32 [B, N] of a `generate` result's trace.

  Arguments as `trajectory_logprob`. Returns each committed trace slot's
  log-prob (see `per_token_logps`), 0 where never committed; rows sum to
  `trajectory_logprob`.
  """
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  check_likelihood(likelihood, config)
  for name in ("prompt_tokens", "prompt_lengths", "trace_tokens"):
    if getattr(generation_result, name, None) is None:
      raise TypeError(
          "generation_result must be a GenerationResult of tbd.generate"
          f" (it has no {name})"
      )
  result = generation_result
  prompt_width = result.prompt_tokens.shape[1]
  prompt_mask = (
      np.arange(prompt_width)[None, :]
      >= prompt_width - np.asarray(result.prompt_lengths)[:, None]
  )
  if isinstance(model_or_logits_fn, nnx.Module):
    return score_trajectories_jit(
        model_or_logits_fn,
        result.prompt_tokens,
        prompt_mask,
        result.trace_tokens,
        result.trace_commit_step,
        config,
        likelihood=likelihood,
    )
  if not callable(model_or_logits_fn):
    raise TypeError(
        "model_or_logits_fn must be a Tunix model (nnx.Module) or a"
        " target-aligned logits_fn(tokens [B, L], positions [B, L]) ->"
        f" [B, L, V], got {type(model_or_logits_fn).__name__}"
    )
  trajectory_batch.prepare_trajectory_batch(  # validates the trace
      result.prompt_tokens,
      prompt_mask,
      result.trace_tokens,
      result.trace_commit_step,
      mask_token_id=config.mask_token_id,
  )
  logits = _per_step_logits(model_or_logits_fn, result, config)
  transition.check_vocab(logits.shape[-1], config)
  log_probs = transition.proposal_log_probs(logits, config)
  commit_step = jnp.asarray(result.trace_commit_step, jnp.int32)
  committed = commit_step >= 0
  if likelihood == "committed_only":
    step = jnp.maximum(commit_step, 0)[None, :, :, None]
    own = jnp.take_along_axis(log_probs, step, axis=0)[0]
    own = jnp.take_along_axis(
        own, jnp.maximum(result.trace_tokens, 0)[..., None], axis=-1
    )[..., 0]
    return jnp.where(committed, jnp.maximum(own, scoring.LOGP_FLOOR), 0.0)
  positions = np.asarray(result.prompt_lengths)[:, None] + np.arange(
      commit_step.shape[1]
  )
  ranks = scoring.commit_ranks(commit_step, positions, config.block_size)
  return selection.per_token_log_likelihood(
      log_probs,
      jnp.asarray(result.trace_tokens),
      commit_step,
      ranks,
      jnp.asarray(positions, jnp.int32),
      config,
  )


def trajectory_logprob(
    model_or_logits_fn: (
        nnx.Module | Callable[[jax.Array, jax.Array], jax.Array]
    ),
    generation_result,
    config: config_lib.DenoiseConfig,
    *,
    likelihood: str = "exact",
) -> jax.Array:
  """Log-probability float32 [B] of each rollout of a `generate` call.

  The exact likelihood (default) is the probability of the whole trajectory
  the sampler took: every step's committed tokens and its selection of which
  eligible slots committed (closed form, `rl.selection`); the probabilities
  of all trajectories of a prompt sum to 1. Scored over the raw trace
  (`trace_tokens`, `trace_commit_step`: slots committed after a row's first
  EOS shaped later canvases); steps after a row finished do not exist in the
  trace and contribute nothing.

  Args:
    model_or_logits_fn: The Tunix model that generated (scored with one
      stacked two-stream pass, `rl.scoring`), or a target-aligned
      `logits_fn(tokens int32 [B, L], positions int32 [B, L]) -> [B, L, V]`
      over the `GenerationResult.sequence()` layout (e.g.
      `tbd.make_logits_fn(model, block_size=..., validity=...)`; called once
      per denoising step, on `GenerationResult.canvas_at(step)`).
    generation_result: The `GenerationResult` of `tbd.generate`.
    config: The `DenoiseConfig` it was generated with; temperature > 0 for
      `exact` (a greedy trajectory has log-prob 0 by definition: raises).
    likelihood: `exact` or `committed_only` (the product of the committed
      tokens' proposal probabilities only).

  Returns:
    float32 [B], detached (differentiate `per_token_logps` instead).
  """
  per_token = trajectory_per_token_logprob(
      model_or_logits_fn, generation_result, config, likelihood=likelihood
  )
  return jnp.sum(jax.lax.stop_gradient(per_token), axis=1)


__all__ = [
    "LIKELIHOODS",
    "check_likelihood",
    "per_token_logps",
    "score_trajectories_jit",
    "trajectory_logprob",
    "trajectory_per_token_logprob",
]
