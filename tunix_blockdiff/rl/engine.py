"""`BlockDiffusionRollout`: the block-diffusion rollout engine for Tunix RL.

A Tunix `BaseRollout`, so `RLCluster` builds it like any custom engine:

    ClusterConfig(
        rollout_engine=functools.partial(
            BlockDiffusionRollout, block_size=4, threshold=0.9),
        ...)

`RLCluster` (google-tunix 0.1.7 and later) accepts a `BaseRollout` subclass or
a `functools.partial` of one and calls it with `rollout_actor`, `tokenizer`
(a `TokenizerAdapter`), `mesh` and the TRAIN `rollout_config`. Generation
uses the exact block-KV-cached driver (`rollout/cached.py`); the sampling
knobs (temperature, top-k, top-p, EOS, max tokens, prompt width, seed) come
from Tunix's `RolloutConfig` of each call, the block-diffusion ones (block
size, mask id, threshold, alignment, steps per block) from this engine.

Besides Tunix's `RolloutOutput` fields (text and tokens cut at EOS, EOS
excluded, per-token log-probs), `generate` returns a
`BlockDiffusionRolloutOutput` carrying each rollout's denoising trace:
every committed token and its commit step. Trajectory-exact scoring
(`tunix_blockdiff.rl.scoring`, `rl.likelihood`) rebuilds each step's canvas
from it.
"""

from __future__ import annotations

from typing import Any

from absl import logging
from flax import nnx
import jax
import numpy as np
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import engine_common
from tunix_blockdiff.rollout import output as output_lib
from tunix_blockdiff.rollout import prompts as prompts_lib
from tunix_blockdiff.rollout import sampling

# The engine's concepts live in their own modules: the output type
# (`output.py`), prompt tokenisation (`prompts.py`), RolloutConfig ->
# DenoiseConfig (`sampling.py`) and parameter updates (`weights.py`). These
# names stay importable from here too.
BlockDiffusionRolloutOutput = output_lib.BlockDiffusionRolloutOutput
concat_outputs = output_lib.concat_outputs
prompt_mask_from_tokens = prompts_lib.prompt_mask_from_tokens


class BlockDiffusionRollout(
    engine_common.RolloutEngineMixin, base_rollout.BaseRollout
):
  """Tunix rollout engine that samples with block diffusion.

  Constructed by `RLCluster` as
  `engine(rollout_actor=, tokenizer=, mesh=, rollout_config=)`; bind the
  block-diffusion options with `functools.partial`.

  Attributes:
    mesh: The rollout mesh (reported to `RLCluster`).
    truncated_prompts: Prompts longer than `max_prompt_length` so far (they
      keep their last tokens).
  """

  def __init__(
      self,
      rollout_actor: nnx.Module,
      tokenizer: Any,
      mesh: jax.sharding.Mesh | None = None,
      rollout_config: base_rollout.RolloutConfig | None = None,
      *,
      block_size: int = 4,
      mask_token_id: int | None = None,
      threshold: float = 0.9,
      alignment: str = "same_position",
      steps_per_block: int | None = None,
      sub_block_size: int | None = None,
      max_tokens_to_generate: int | None = None,
      use_cache: bool = True,
      cache_phases: int = 1,
      lockstep: bool = False,
      ragged_cache: bool = False,
      fused_head: bool = False,
      one_program: bool = False,
      seed: int = 0,
      attention: config_lib.AttentionConfig | None = None,
  ):
    """Builds the engine.

    Args:
      rollout_actor: The Tunix model to sample from (shared with the actor
        when colocated).
      tokenizer: A Tunix-compatible tokenizer (wrapped in `TokenizerAdapter`
        if it is not one already).
      mesh: Rollout mesh, if any.
      rollout_config: Tunix `RolloutConfig` of TRAIN mode; its sampling knobs
        define the default scoring distribution (`score_config`).
      block_size: Slots per block; must be the block size the model was
        trained with (default 4, SDAR's, so the bare class works as
        `ClusterConfig(rollout_engine=BlockDiffusionRollout)`; bind yours
        with `functools.partial`).
      mask_token_id: Mask token id; default `tokenizer.mask_id()` (or
        `mask_token_id`) when the tokenizer has one.
      threshold: Confidence threshold of the denoiser (DESIGN.md 5.3).
      alignment: `same_position` or `shifted`.
      steps_per_block: Optional static schedule.
      sub_block_size: Optional sub-blocks (`DenoiseConfig.sub_block_size`,
        Fast-dLLM v2's rule); the scorer's exact likelihood follows it.
      max_tokens_to_generate: Overrides `RolloutConfig.max_tokens_to_generate`.
      use_cache: Block-KV-cached driver (True) or cacheless `denoise`.
      cache_phases: The cached driver's loop in that many phases, each
        reading only the KV-cache prefix it uses (`generate(cache_phases=)`).
      lockstep: The cached driver's rows start their blocks together
        (`generate(lockstep=)`): fewer 2W-wide steps when rows fall out of
        phase; the trace's commit steps count each row's own steps, so the
        scorer's likelihood is unchanged.
      ragged_cache: The cached driver reads its cache with the Pallas kernel
        that fetches only the slots in use (`generate(ragged_cache=)`;
        slower than the default on a TPU v5e).
      fused_head: The cached driver's greedy proposals come from the Pallas
        kernel that never writes the logits (`generate(fused_head=)`): greedy
        calls only (a sampling `RolloutConfig` is then refused), the
        same_position alignment and a head without LoRA weights.
      one_program: With `cache_phases` > 1, the cached driver's stages in
        one program instead of one each (`generate(one_program=)`): faster
        to run, slower to compile.
      seed: Seed of the sampling noise when `RolloutConfig.seed` is None;
        every call folds in a call counter, so calls draw fresh noise.
      attention: The attention of the trajectory scorer (`score`,
        `get_per_token_logps`; `flash.chosen_logits`: Splash where it
        applies, None: dense); the GRPO and OPD learners score with the
        same one. Generation itself runs the cached driver.
    """
    if rollout_actor is None:
      raise ValueError("rollout_actor (the model to sample from) is required")
    if tokenizer is None:
      raise ValueError("tokenizer is required")
    if not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):
      tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    likelihood_lib.check_attention(attention)
    self._model = rollout_actor
    self._tokenizer = tokenizer
    self.mesh = mesh
    self.attention = attention
    # Prompts cut to `max_prompt_length` over every `generate` call.
    self.truncated_prompts = 0
    if mask_token_id is None:
      mask_token_id = sampling.default_mask_id(tokenizer)
    if mask_token_id is None:
      raise ValueError(
          "mask_token_id is required: the tokenizer has no mask_id()/"
          "mask_token_id"
      )
    # Validates the block-diffusion fields once, at construction.
    self._base_config = config_lib.DenoiseConfig(
        block_size=block_size,
        mask_token_id=mask_token_id,
        threshold=threshold,
        alignment=alignment,
        steps_per_block=steps_per_block,
        sub_block_size=sub_block_size,
        eos_token_id=int(tokenizer.eos_id()),
        pad_token_id=int(tokenizer.pad_id()),
    )
    self._max_tokens = sampling.optional_positive_int(
        "max_tokens_to_generate", max_tokens_to_generate
    )
    self._use_cache = bool(use_cache)
    self._cache_phases = sampling.optional_positive_int(
        "cache_phases", cache_phases) or 1
    sampling.check_cached_modes(use_cache, lockstep=lockstep,
                                ragged_cache=ragged_cache,
                                fused_head=fused_head,
                                one_program=one_program)
    if fused_head and alignment != "same_position":
      raise ValueError("fused_head=True needs the same_position alignment,"
                       f" got {alignment!r}")
    self._lockstep = lockstep
    self._ragged_cache = ragged_cache
    self._fused_head = fused_head
    self._one_program = one_program
    self._init_engine(seed)
    self._train_rollout_config = rollout_config

  # ---------------------------------------------------------------------------
  # Configuration.
  # ---------------------------------------------------------------------------

  def denoise_config(
      self, rollout_config: base_rollout.RolloutConfig | None = None
  ) -> config_lib.DenoiseConfig:
    """The `DenoiseConfig` a `generate` call with `rollout_config` uses."""
    return sampling.denoise_config_for(
        self._base_config, rollout_config or self._train_rollout_config
    )

  @property
  def score_config(self) -> config_lib.DenoiseConfig:
    """The config of TRAIN rollouts: what their log-probs are defined under."""
    return self.denoise_config(None)

  def max_new_tokens(self, rollout_config: base_rollout.RolloutConfig) -> int:
    return self._max_tokens or int(rollout_config.max_tokens_to_generate)

  # ---------------------------------------------------------------------------
  # Generation.
  # ---------------------------------------------------------------------------

  def tokenize_prompts(
      self, prompts: list[str], max_prompt_length: int
  ) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids int32 [B, max_prompt_length] and lengths [B].

    BOS is prepended when the tokenizer has one (as Tunix's sampler does);
    prompts longer than `max_prompt_length` keep their last tokens. They are
    counted in `truncated_prompts`, with one warning per call that cuts any.
    """
    encoded = prompts_lib.tokenize_prompts(
        self._tokenizer, prompts, max_prompt_length
    )
    if encoded.truncated:
      self.truncated_prompts += encoded.truncated
      logging.warning(
          "%d of %d prompts (longest %d tokens) truncated to"
          " max_prompt_length=%d (%d so far)",
          encoded.truncated,
          len(prompts),
          encoded.longest,
          max_prompt_length,
          self.truncated_prompts,
      )
    return encoded.tokens, encoded.lengths

  def generate(
      self,
      prompts: list[str],
      rollout_config: base_rollout.RolloutConfig,
      **kwargs,
  ) -> BlockDiffusionRolloutOutput:
    """Samples completions for `prompts` with block diffusion.

    Args:
      prompts: B prompt strings.
      rollout_config: Tunix `RolloutConfig` (temperature, top-k, top-p, EOS,
        max tokens, max prompt length, seed).
      **kwargs: Unused (Tunix passes engine-specific extras).

    Returns:
      `BlockDiffusionRolloutOutput`: `tokens`/`logprobs` per row cut at the
      first EOS (EOS excluded, like Tunix's sampler), `text`, the left-padded
      prompts [B, P] and the denoising trace [B, N].
    """
    del kwargs
    if not prompts:
      raise ValueError("prompts must not be empty")
    config = self.denoise_config(rollout_config)
    prompt_tokens, lengths = self.tokenize_prompts(
        list(prompts), int(rollout_config.max_prompt_length)
    )
    max_new_tokens = self.max_new_tokens(rollout_config)
    rng = self._next_key(rollout_config)
    # On a mesh the prompts are sharded over fsdp and the results gathered:
    # every process gets every row.
    result = distributed.call_sharded(
        lambda tokens, lens: cached.generate(
            self._model,
            tokens,
            lens,
            config,
            max_new_tokens=max_new_tokens,
            rng=rng,
            use_cache=self._use_cache,
            cache_phases=self._cache_phases,
            lockstep=self._lockstep,
            ragged_cache=self._ragged_cache,
            fused_head=self._fused_head,
            one_program=self._one_program,
        ),
        self.mesh,
        prompt_tokens,
        lengths,
    )
    out_tokens, texts, (out_logprobs,) = engine_common.completions(
        np.asarray(result.tokens),
        config.eos_token_id,
        self._tokenizer,
        np.asarray(result.logprobs),
    )
    output = BlockDiffusionRolloutOutput(
        text=texts,
        logits=[],
        tokens=out_tokens,
        left_padded_prompt_tokens=prompt_tokens,
        logprobs=out_logprobs,
        trace_tokens=np.asarray(result.trace_tokens),
        commit_steps=np.asarray(result.trace_commit_step),
        trace_logprobs=np.asarray(result.trace_logprobs),
        denoise_config=config,
    )
    return self._record(output)

  # ---------------------------------------------------------------------------
  # BaseRollout interface.
  # ---------------------------------------------------------------------------

  def get_per_token_logps(
      self,
      prompt_tokens: jax.Array,
      completion_tokens: jax.Array,
      commit_step: jax.Array | None = None,
      *,
      config: config_lib.DenoiseConfig | None = None,
      likelihood: str = "exact",
  ) -> jax.Array:
    """Trajectory-exact log-probs of rollouts under the current parameters.

    Args:
      prompt_tokens: int [B, P] left-padded prompts.
      completion_tokens: int [B, N] the rollout's trace tokens.
      commit_step: int [B, N] commit steps (-1: never). Required: a
        block-diffusion rollout's probability depends on the order its
        tokens were committed, which the tokens alone do not tell.
      config: The rollout's `DenoiseConfig` (default: `score_config`).
      likelihood: `exact` (per-token shares of the exact trajectory
        log-prob, selection included) or `committed_only` (the log-probs
        the rollout recorded); see `rl.likelihood`.

    Returns:
      float32 [B, N] log-probs, 0 where never committed.
    """
    if commit_step is None:
      raise ValueError(
          "commit_step is required: a block-diffusion rollout is scored from"
          " the step that committed each token (use BlockDiffusionGRPOLearner"
          " or pass BlockDiffusionRolloutOutput.commit_steps)"
      )
    return self.score(
        self._model,
        prompt_tokens,
        completion_tokens,
        commit_step,
        config=config,
        likelihood=likelihood,
    )

  def score(
      self,
      model: nnx.Module,
      prompt_tokens,
      completion_tokens,
      commit_step,
      *,
      config: config_lib.DenoiseConfig | None = None,
      likelihood: str = "exact",
      mesh: jax.sharding.Mesh | None = None,
  ) -> jax.Array:
    """Trajectory-exact log-probs float32 [B, N] of rollouts under `model`.

    `get_per_token_logps` for any model (the reference, say). On a mesh
    (`mesh`, default the rollout mesh: `model`'s) the rows are sharded over
    fsdp and the result gathered, the same on every process.
    """
    config = config or self.score_config
    prompt_tokens = np.asarray(prompt_tokens)
    return distributed.call_sharded(
        lambda *arrays: likelihood_lib.score_trajectories_jit(
            model, *arrays, config, likelihood=likelihood,
            attention=self.attention,
        ),
        self.mesh if mesh is None else mesh,
        prompt_tokens,
        prompt_mask_from_tokens(prompt_tokens, self.pad_id()),
        np.asarray(completion_tokens),
        np.asarray(commit_step),
    )

  def eos_id(self) -> int:
    return int(self.score_config.eos_token_id)

