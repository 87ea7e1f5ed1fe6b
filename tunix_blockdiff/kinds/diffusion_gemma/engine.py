"""`DiffusionGemmaRollout`: DiffusionGemma's entropy-bound sampler for Tunix RL.

A Tunix `BaseRollout`, built by `RLCluster` like `BlockDiffusionRollout`:

    ClusterConfig(
        rollout_engine=functools.partial(
            DiffusionGemmaRollout, sampler_config=dg.SamplerConfig(...)),
        ...)

and used with `kinds.diffusion_gemma.cluster.DiffusionGemmaRLCluster`.
Generation is `kinds/diffusion_gemma/sampler.DiffusionGemmaSampler` (JAX, one
compiled program per canvas) with `record_trace=True`; each call returns a
`DiffusionGemmaRolloutOutput` holding every row's trace (canvases, accepted
masks, sampled tokens, temperatures, live steps, self-conditioning switch)
and the sampler's own log-prob of each row's trajectories.

The sampling distribution is the `SamplerConfig`'s (temperature schedule,
entropy bound, adaptive stop); of Tunix's `RolloutConfig` only
`max_tokens_to_generate`, `max_prompt_length` and `seed` apply (its
temperature, top-k and top-p do not describe this sampler). EOS and pad
are the tokenizer's.

On a mesh (the cluster's rollout mesh, over one or several processes)
the rows of every rollout and score are sharded over its fsdp axis and
gathered, so every process gets every row, the same rows as one device.

Log-probs are sequence-level: a DiffusionGemma rollout revises tokens, so
no token has a probability of its own. `get_per_token_logps` and `score`
return float32 [B], `kinds.diffusion_gemma.scoring.sequence_logprobs` under
the given parameters (the rollout's own: the sampler's log-probs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
from flax import nnx
import jax
import numpy as np
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from tunix_blockdiff.models.diffusion_gemma import config as dg_config
from tunix_blockdiff.models.diffusion_gemma import model as model_lib
from tunix_blockdiff.kinds.diffusion_gemma import scoring as scoring
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.kinds.diffusion_gemma import output as output_lib
from tunix_blockdiff.rollout import engine_common
from tunix_blockdiff.rollout import prompts as prompts_lib
from tunix_blockdiff.rollout import sampling

DiffusionGemmaRolloutOutput = output_lib.DiffusionGemmaRolloutOutput
DiffusionGemmaTrace = output_lib.DiffusionGemmaTrace
concat_outputs = output_lib.concat_outputs


def completions(tokens: np.ndarray, eos_id: int | None,
                tokenizer) -> tuple[list[np.ndarray], list[str]]:
  """Each row of `tokens` [B, T] cut before its first EOS, and its text."""
  return engine_common.completions(tokens, eos_id, tokenizer)[:2]


class DiffusionGemmaRollout(
    engine_common.RolloutEngineMixin, base_rollout.BaseRollout
):
  """Tunix rollout engine sampling a `DiffusionGemma` (see module docstring).

  Attributes:
    mesh: The rollout mesh (reported to `RLCluster`).
    sampler_config: The `SamplerConfig` every rollout uses (EOS and pad the
      tokenizer's).
    truncated_prompts: Prompts longer than `max_prompt_length` so far.
  """

  def __init__(
      self,
      rollout_actor: model_lib.DiffusionGemma,
      tokenizer: Any,
      mesh: jax.sharding.Mesh | None = None,
      rollout_config: base_rollout.RolloutConfig | None = None,
      *,
      sampler_config: dg_config.SamplerConfig | None = None,
      max_tokens_to_generate: int | None = None,
      seed: int = 0,
      splash_tile: int | None = None,
      splash_interpret: bool | None = None,
  ):
    """Builds the engine.

    Args:
      rollout_actor: The `DiffusionGemma` to sample from.
      tokenizer: A Tunix-compatible tokenizer (wrapped in `TokenizerAdapter`
        if it is not one).
      mesh: Rollout mesh, if any: rollouts and scores shard their rows over
        its fsdp axis (any number of processes) and gather them, so every
        process gets every row.
      rollout_config: Tunix's TRAIN `RolloutConfig` (kept for defaults).
      sampler_config: The sampler settings (default: the reference's
        `SamplerConfig()`); its EOS and pad are replaced by the tokenizer's.
      max_tokens_to_generate: Overrides `RolloutConfig.max_tokens_to_generate`.
      seed: Seed of the sampling noise when `RolloutConfig.seed` is None;
        call i draws with `fold_in(key(seed), i)`.
      splash_tile: The scorers (`score`) run every attention
        call on the Splash kernel with this tile (it divides the prompt
        width and the canvas); None: dense. Sampling stays dense.
      splash_interpret: Pallas interpret mode; None: off TPU.
    """
    if not isinstance(rollout_actor, model_lib.DiffusionGemma):
      raise TypeError(
          "rollout_actor must be a DiffusionGemma, got"
          f" {type(rollout_actor).__name__}")
    if tokenizer is None:
      raise ValueError("tokenizer is required")
    if sampler_config is None:
      sampler_config = dg_config.SamplerConfig()
    if not isinstance(sampler_config, dg_config.SamplerConfig):
      raise TypeError(
          "sampler_config must be a SamplerConfig, got"
          f" {type(sampler_config).__name__}")
    scoring.check_samples(sampler_config)
    scoring.check_splash_tile(
        splash_tile, canvas_length=rollout_actor.config.canvas_length)
    self.splash_tile = splash_tile
    self.splash_interpret = splash_interpret
    if not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):
      tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    self._model = rollout_actor
    self._tokenizer = tokenizer
    self.mesh = mesh
    self.truncated_prompts = 0
    self.sampler_config = dataclasses.replace(
        sampler_config, eos_token_id=int(tokenizer.eos_id()),
        pad_token_id=int(tokenizer.pad_id()))
    self._max_tokens = sampling.optional_positive_int(
        "max_tokens_to_generate", max_tokens_to_generate)
    self._init_engine(seed)
    self._train_rollout_config = rollout_config
    self._sampler = dg_rollout.DiffusionGemmaSampler(
        rollout_actor, self.sampler_config, record_trace=True, mesh=mesh)
    # id(model) -> (model, scorer): one compiled scorer per scored model.
    self._scorers: dict[int, tuple[nnx.Module, scoring.SequenceScorer]] = {}

  # -- generation -------------------------------------------------------------

  def max_new_tokens(self, rollout_config: base_rollout.RolloutConfig) -> int:
    return self._max_tokens or int(rollout_config.max_tokens_to_generate)

  def generate(self, prompts: list[str],
               rollout_config: base_rollout.RolloutConfig,
               **kwargs) -> DiffusionGemmaRolloutOutput:
    """Samples completions for `prompts` with the entropy-bound sampler.

    Args:
      prompts: B prompt strings.
      rollout_config: Tunix `RolloutConfig` (max tokens, max prompt length,
        seed).
      **kwargs: Unused (Tunix passes engine-specific extras).

    Returns:
      `DiffusionGemmaRolloutOutput`: `tokens` per row cut at the first EOS
      (EOS excluded), `text`, the left-padded prompts [B, P], the trace and
      the sampler's sequence log-probs [B].
    """
    del kwargs
    if not prompts:
      raise ValueError("prompts must not be empty")
    encoded = prompts_lib.tokenize_prompts(
        self._tokenizer, list(prompts), int(rollout_config.max_prompt_length))
    if encoded.truncated:
      self.truncated_prompts += encoded.truncated
      logging.warning("%d of %d prompts truncated to max_prompt_length=%d",
                      encoded.truncated, len(prompts),
                      rollout_config.max_prompt_length)
    result = self._sampler.generate(
        encoded.tokens, encoded.lengths,
        max_new_tokens=self.max_new_tokens(rollout_config),
        rng=self._next_key(rollout_config))
    trace = output_lib.trace_from_result(
        result, self._model.config.canvas_length)
    out_tokens, texts = completions(result.tokens,
                                    self.sampler_config.eos_token_id,
                                    self._tokenizer)
    output = DiffusionGemmaRolloutOutput(
        text=texts,
        logits=[],
        tokens=out_tokens,
        left_padded_prompt_tokens=encoded.tokens,
        logprobs=None,
        trace=trace,
        sequence_logprobs=output_lib.sampler_logprobs(
            trace, self._model.config.vocab_size),
        prompt_lengths=encoded.lengths,
        sampler_config=self.sampler_config,
    )
    return self._record(output)

  # -- scoring ----------------------------------------------------------------

  def score(self, model: nnx.Module, prompt_tokens, prompt_mask,
            trace: DiffusionGemmaTrace) -> jax.Array:
    """float32 [B] log P of the rollouts' trajectories under `model`.

    Args:
      model: A `DiffusionGemma` (policy, reference, rollout copy).
      prompt_tokens: int [B, P] the rollouts' left-padded prompts.
      prompt_mask: bool [B, P] their real slots.
      trace: The rollouts' `DiffusionGemmaTrace`.
    """
    entry = self._scorers.get(id(model))
    if entry is None or entry[0] is not model:
      entry = (model, scoring.SequenceScorer(model, self.sampler_config,
                                             mesh=self.mesh,
                                             splash_tile=self.splash_tile,
                                             splash_interpret=(
                                                 self.splash_interpret)))
      self._scorers[id(model)] = entry
    return entry[1](model, np.asarray(prompt_tokens),
                    np.asarray(prompt_mask, bool), trace)

  def get_per_token_logps(self, prompt_tokens: jax.Array,
                          completion_tokens: jax.Array, *,
                          trace: DiffusionGemmaTrace | None = None,
                          prompt_mask=None) -> jax.Array:
    """Sequence log-probs float32 [B] under the current rollout parameters.

    Not per token: a DiffusionGemma rollout revises tokens, so only whole
    trajectories have probabilities.

    Args:
      prompt_tokens: int [B, P] left-padded prompts.
      completion_tokens: int [B, K * C] the trace's tokens.
      trace: The rollouts' `DiffusionGemmaTrace` (required).
      prompt_mask: bool [B, P]; default: slots from the first non-pad on.
    """
    if trace is None:
      raise ValueError(
          "trace is required: a DiffusionGemma rollout is scored from its"
          " DiffusionGemmaTrace (DiffusionGemmaRolloutOutput.trace)")
    if np.shape(completion_tokens) != np.shape(trace.tokens):
      raise ValueError(
          f"completion_tokens shape {np.shape(completion_tokens)} differs"
          f" from trace.tokens {np.shape(trace.tokens)}")
    if prompt_mask is None:
      prompt_mask = prompts_lib.prompt_mask_from_tokens(prompt_tokens,
                                                        self.pad_id())
    return self.score(self._model, prompt_tokens, prompt_mask, trace)

  # -- BaseRollout interface --------------------------------------------------

  def eos_id(self) -> int:
    return int(self.sampler_config.eos_token_id)



__all__ = ["DiffusionGemmaRollout", "DiffusionGemmaRolloutOutput",
           "DiffusionGemmaTrace", "completions", "concat_outputs"]
