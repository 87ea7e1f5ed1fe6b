"""Tests for trajectory-exact scoring of block-diffusion rollouts (DESIGN 5.5)."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rl import likelihood
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import denoise as denoise_lib

VOCAB, MASK, EOS = 40, 3, 2
BLOCK, NEW_TOKENS, PROMPT_WIDTH = 4, 9, 7
PROMPT_LENGTHS = np.array([7, 3, 5, 1])


@functools.lru_cache(maxsize=None)
def _model():
  return tiny_models.tiny_qwen3(VOCAB, seed=3, num_layers=1)


def _prompts():
  rs = np.random.RandomState(0)
  tokens = rs.randint(4, VOCAB, size=(len(PROMPT_LENGTHS), PROMPT_WIDTH))
  mask = (
      np.arange(PROMPT_WIDTH)[None, :] >= PROMPT_WIDTH - PROMPT_LENGTHS[:, None]
  )
  return np.where(mask, tokens, 0).astype(np.int32), mask


CONFIGS = {
    "greedy-threshold-same-position": config_lib.DenoiseConfig(
        block_size=BLOCK, mask_token_id=MASK, threshold=0.15, eos_token_id=EOS
    ),
    "sampled-static-shifted-topk-topp": config_lib.DenoiseConfig(
        block_size=BLOCK,
        mask_token_id=MASK,
        alignment="shifted",
        steps_per_block=3,
        temperature=0.8,
        top_k=12,
        top_p=0.9,
        eos_token_id=EOS,
    ),
}


# The cached driver is what BlockDiffusionRollout runs; the sampled case uses
# the cacheless `denoise` program (equal to it, tests/rollout/test_cached.py)
# to keep compile time down.
USE_CACHE = {
    "greedy-threshold-same-position": True,
    "sampled-static-shifted-topk-topp": False,
}


@functools.lru_cache(maxsize=None)
def _rollout(name):
  prompts, _ = _prompts()
  return cached.generate(
      _model(),
      prompts,
      PROMPT_LENGTHS,
      CONFIGS[name],
      max_new_tokens=NEW_TOKENS,
      rng=jax.random.key(11),
      use_cache=USE_CACHE[name],
  )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scorer_reproduces_the_rollouts_log_probs(name):
  config = CONFIGS[name]
  result = _rollout(name)
  prompts, prompt_mask = _prompts()
  steps = np.asarray(result.trace_commit_step)
  # Several steps per block, and a real mix of committed / never committed.
  assert steps.max() >= NEW_TOKENS // 2
  scores = likelihood.score_trajectories_jit(
      _model(),
      prompts,
      prompt_mask,
      result.trace_tokens,
      steps,
      config,
      likelihood="committed_only",
  )
  expected = np.asarray(result.trace_logprobs)
  assert np.abs(np.asarray(scores) - expected).max() <= 1e-4
  assert np.all(np.asarray(scores)[steps < 0] == 0.0)


def test_scorer_matches_step_by_step_rescoring_with_single_stream_logits():
  # Independent route: rebuild each step's canvas and run the plain
  # single-stream block-causal model on it, one step at a time.
  config = CONFIGS["greedy-threshold-same-position"]
  result = _rollout("greedy-threshold-same-position")
  prompts, prompt_mask = _prompts()
  tokens, positions, validity, _ = result.sequence()
  steps = np.asarray(result.trace_commit_step)

  @nnx.jit
  def step_log_probs(model, canvas):
    logits = modeling.block_diffusion_logits(
        model, canvas, positions, block_size=BLOCK, validity=validity
    )[:, PROMPT_WIDTH:]
    log_probs = denoise_lib.proposal_log_probs(logits, config)
    return jnp.take_along_axis(
        log_probs, result.trace_tokens[..., None], axis=-1
    )[..., 0]

  expected = np.zeros(steps.shape, np.float32)
  for step in range(int(steps.max()) + 1):
    picked = step_log_probs(_model(), result.canvas_at(step, MASK))
    expected = np.where(steps == step, picked, expected)
  scores = likelihood.score_trajectories_jit(
      _model(),
      prompts,
      prompt_mask,
      result.trace_tokens,
      steps,
      config,
      likelihood="committed_only",
  )
  np.testing.assert_allclose(scores, expected, atol=1e-4)


def test_scores_are_differentiable_with_finite_nonzero_gradients():
  config = CONFIGS["sampled-static-shifted-topk-topp"]
  result = _rollout("sampled-static-shifted-topk-topp")
  prompts, prompt_mask = _prompts()

  def total(model):
    logps = scoring.score_trajectories(
        model,
        prompts,
        prompt_mask,
        result.trace_tokens,
        result.trace_commit_step,
        config,
        stop_gradient=False,
    )
    return jnp.sum(logps)

  grads = nnx.jit(nnx.grad(total))(_model())
  leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
  assert all(np.all(np.isfinite(g)) for g in leaves)
  assert sum(float(np.abs(g).sum()) for g in leaves) > 0


def _brute_force_ranks(steps, positions, block_size):
  ranks = np.zeros_like(steps)
  for b in range(steps.shape[0]):
    for i in range(steps.shape[1]):
      if steps[b, i] < 0:
        continue
      same = positions[b] // block_size == positions[b, i] // block_size
      earlier = {s for s in steps[b][same] if 0 <= s < steps[b, i]}
      ranks[b, i] = len(earlier)
  return ranks


def test_commit_ranks_count_distinct_earlier_steps_of_the_block():
  rs = np.random.RandomState(1)
  positions = np.broadcast_to(np.arange(12) + 2, (3, 12))
  # Steps with gaps (an idle row) and repeats (several commits per step).
  steps = rs.choice([-1, 0, 2, 3, 3, 5, 8, 9], size=(3, 12)).astype(np.int32)
  got = scoring.commit_ranks(jnp.asarray(steps), jnp.asarray(positions), 4)
  np.testing.assert_array_equal(got, _brute_force_ranks(steps, positions, 4))


def test_missing_commit_steps_raise():
  prompts, prompt_mask = _prompts()
  with pytest.raises(ValueError, match="commit_step is required"):
    scoring.prepare_trajectory_batch(
        prompts,
        prompt_mask,
        np.zeros((4, NEW_TOKENS), np.int32),
        None,
        mask_token_id=MASK,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, s: (t, s[:, :-1]), "shape of completion_tokens"),
        (lambda t, s: (t, s.astype(np.float32)), "integer dtype"),
        (lambda t, s: (np.full_like(t, MASK), np.zeros_like(s)), "mask token"),
        (lambda t, s: (t, s - 2), ">= -1"),
    ],
)
def test_malformed_trajectories_raise(change, message):
  prompts, prompt_mask = _prompts()
  tokens = np.full((4, NEW_TOKENS), 5, np.int32)
  steps = np.zeros((4, NEW_TOKENS), np.int32)
  tokens, steps = change(tokens, steps)
  with pytest.raises((ValueError, TypeError), match=message):
    scoring.prepare_trajectory_batch(
        prompts, prompt_mask, tokens, steps, mask_token_id=MASK
    )


def test_too_small_step_bound_raises():
  result = _rollout("greedy-threshold-same-position")
  prompts, prompt_mask = _prompts()
  batch = scoring.prepare_trajectory_batch(
      prompts,
      prompt_mask,
      result.trace_tokens,
      result.trace_commit_step,
      mask_token_id=MASK,
  )
  logits_fn = scoring.make_trajectory_logits_fn(
      block_size=BLOCK, mask_token_id=MASK, max_steps_per_block=1
  )
  with pytest.raises(ValueError, match="max_steps_per_block"):
    logits_fn(_model(), batch.model_inputs)


def test_rank_logits_through_splash_equal_dense():
  """The scorer's one two-stream call on Splash (interpret mode) == dense.

  Prompts 16 wide and 48 new tokens: rows of 64, two-stream 128 (a tile).
  """
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top

  model = _model()
  rs = np.random.RandomState(1)
  lengths = np.array([16, 9, 12, 5])
  mask = np.arange(16)[None, :] >= 16 - lengths[:, None]
  prompts = np.where(mask, rs.randint(4, VOCAB, size=(4, 16)), 0).astype(
      np.int32)
  config = CONFIGS["greedy-threshold-same-position"]
  result = cached.generate(model, prompts, lengths, config, max_new_tokens=48)
  batch = scoring.prepare_trajectory_batch(
      prompts, mask, result.trace_tokens, result.trace_commit_step,
      mask_token_id=MASK)
  kwargs = dict(block_size=BLOCK, mask_token_id=MASK)
  # One compiled program (op by op: ~100 programs).
  want, want_ranks = nnx.jit(scoring.make_rank_logits_fn(**kwargs))(
      model, batch.model_inputs)
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  splash = scoring.make_rank_logits_fn(
      **kwargs, attention=config_lib.AttentionConfig("splash"))
  with mesh:
    got, ranks = jax.jit(lambda m: splash(model, m))(batch.model_inputs)
  np.testing.assert_array_equal(ranks, want_ranks)
  committed = np.asarray(result.trace_commit_step) >= 0
  err = np.abs(np.asarray(got) - np.asarray(want))[:, committed]
  assert err.max() <= 1e-4, err.max()
