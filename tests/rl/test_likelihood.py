"""The exact likelihood is the sampler's: brute force, enumeration, chi-square.

* One step, brute force: every joint proposal of a window is pushed through
  `denoise.select_commits` itself; the probability of each outcome (committed
  set and tokens) equals the closed form of `rl.selection` (ties included).
* Whole rollouts: thousands of identical prompts in one `generate` call
  (rows draw independently); the empirical frequency of every distinct
  trajectory (tokens and commit steps) matches exp(trajectory_logprob)
  (chi-square), for threshold, forced-progress and static schedules, with
  temperature, top-k and top-p; the probabilities of all trajectories sum to
  1; the committed-only product fails the same test.
"""

import collections
import functools
import itertools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import tunix_blockdiff as tbd
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rl import likelihood
from tunix_blockdiff.rl import selection
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import denoise as denoise_lib

VOCAB, MASK, EOS = 8, 7, 1
BLOCK = 3
ROWS = 4000
PROMPT = np.array([2, 3, 4], np.int32)  # the completion is one block
MIN_EXPECTED = 5.0  # chi-square cells expected below this are pooled

CONFIGS = {
    # Threshold decoding with EOS: multi-commit and forced steps both
    # common, and rows that stop early (never-committed slots after EOS).
    "threshold-topp-eos": config_lib.DenoiseConfig(
        block_size=BLOCK,
        mask_token_id=MASK,
        threshold=0.3,
        temperature=0.7,
        top_p=0.9,
        eos_token_id=EOS,
    ),
    # Nothing ever clears threshold 1: every step is forced progress.
    "forced-topk": config_lib.DenoiseConfig(
        block_size=BLOCK,
        mask_token_id=MASK,
        threshold=1.0,
        temperature=0.8,
        top_k=4,
    ),
    # Fast-dLLM v2's sub-blocks: blocks of 4 in two sub-blocks of 2 (the
    # prompt ends inside the first block, so its one completion slot is a
    # partial sub-block); only the first sub-block with masked slots takes
    # part in a step.
    "sub-blocks-threshold": config_lib.DenoiseConfig(
        block_size=4,
        mask_token_id=MASK,
        threshold=0.3,
        temperature=0.8,
        sub_block_size=2,
    ),
    # Static schedule: 2 slots, then 1.
    "static-topk-topp": config_lib.DenoiseConfig(
        block_size=BLOCK,
        mask_token_id=MASK,
        steps_per_block=2,
        temperature=0.7,
        top_k=5,
        top_p=0.8,
    ),
}


@functools.lru_cache(maxsize=None)
def _model():
  return tiny_models.tiny_qwen3(
      VOCAB,
      seed=1,
      num_layers=1,
      embed_dim=16,
      hidden_dim=32,
      num_heads=2,
      head_dim=8,
      num_kv_heads=1,
  )


# Configs whose every trajectory `_all_trajectories` enumerates (one block of
# BLOCK slots) but which the frequency test does not take: sub-blocks of one
# slot commit the first masked slot at every step (exact likelihood =
# committed-only, so that test's control cannot fail).
SUM_ONLY = {
    "sub-blocks-of-1": config_lib.DenoiseConfig(
        block_size=BLOCK, mask_token_id=MASK, threshold=0.4,
        temperature=0.8, sub_block_size=1),
}


@functools.lru_cache(maxsize=None)
def _rollouts(name: str) -> cached.GenerationResult:
  return tbd.generate(
      _model(),
      np.tile(PROMPT, (ROWS, 1)),
      np.full((ROWS,), PROMPT.size, np.int32),
      CONFIGS[name],
      max_new_tokens=CONFIGS[name].block_size,
      rng=jax.random.key(0),
      use_cache=False,
  )


@functools.lru_cache(maxsize=None)
def _logprobs(name: str, kind: str) -> np.ndarray:
  return np.asarray(
      tbd.trajectory_logprob(
          _model(), _rollouts(name), CONFIGS[name], likelihood=kind
      )
  )


def _chi_square_p(result, logprob) -> float:
  """p-value of trajectory counts against ROWS * exp(logprob), rare pooled."""
  keys = [
      tuple(t) + tuple(s)
      for t, s in zip(
          np.asarray(result.trace_tokens), np.asarray(result.trace_commit_step)
      )
  ]
  counts = collections.Counter(keys)
  first = {}
  for row, key in enumerate(keys):
    first.setdefault(key, row)
  logprob = np.asarray(logprob, np.float64)
  observed = np.array([counts[k] for k in counts], np.float64)
  expected = np.array([ROWS * np.exp(logprob[first[k]]) for k in counts])
  kept = expected >= MIN_EXPECTED
  # The pooled cell: every other trajectory, observed or not.
  observed = np.append(observed[kept], observed[~kept].sum())
  expected = np.append(expected[kept], max(ROWS - expected[kept].sum(), 1e-9))
  statistic = np.sum((observed - expected) ** 2 / expected)
  return float(stats.chi2.sf(statistic, observed.size - 1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trajectory_frequencies_match_the_exact_likelihood(name):
  config = CONFIGS[name]
  result = _rollouts(name)
  steps = np.asarray(result.trace_commit_step)
  counts = np.stack(
      [np.sum(steps == s, axis=1) for s in range(steps.shape[1])], 1)
  multi = np.mean(counts.max(axis=1) >= 2)
  single = np.mean(np.any(counts == 1, axis=1))
  # The schedule under test really happens: threshold decoding has both
  # multi-commit and single-slot (forced) steps; threshold 1 only forced ones.
  if config.threshold == 1.0:
    assert multi == 0.0
  else:
    assert multi > 0.1 and single > 0.1
  p_exact = _chi_square_p(result, _logprobs(name, "exact"))
  p_committed = _chi_square_p(result, _logprobs(name, "committed_only"))
  print(
      f"{name}: chi-square p exact={p_exact:.3g}"
      f" committed_only={p_committed:.3g}"
  )
  assert p_exact > 1e-3
  assert p_committed < 1e-6


def test_eos_rows_stop_early():
  # Rows that commit EOS stop once every slot before it is committed: slots
  # left masked after EOS are eligible at every step the row took.
  steps = np.asarray(_rollouts("threshold-topp-eos").trace_commit_step)
  assert np.mean(np.any(steps < 0, axis=1)) > 0.01


def test_model_and_per_step_logits_fn_scores_agree():
  # The stacked two-stream canvases of the model path are the canvases each
  # step of the sampler saw (rebuilt here with one model call per step),
  # EOS and early stops included.
  name, rows = "threshold-topp-eos", 512
  config = CONFIGS[name]
  result = cached.GenerationResult(
      *(x[:rows] if np.ndim(x) else x for x in _rollouts(name))
  )
  logits_fn = jax.jit(modeling.make_logits_fn(_model(), block_size=BLOCK))
  np.testing.assert_allclose(
      likelihood.trajectory_logprob(logits_fn, result, config),
      _logprobs(name, "exact")[:rows],
      atol=2e-4,
  )
  # Committed-only scores reproduce what the sampler recorded.
  per_token = likelihood.trajectory_per_token_logprob(
      logits_fn, result, config, likelihood="committed_only"
  )
  np.testing.assert_allclose(per_token, result.trace_logprobs, atol=2e-5)
  # Per-token exact log-probs sum to the trajectory's.
  np.testing.assert_allclose(
      np.sum(
          likelihood.trajectory_per_token_logprob(logits_fn, result, config),
          axis=1,
      ),
      _logprobs(name, "exact")[:rows],
      atol=2e-4,
  )


def _all_trajectories():
  """Every (tokens, commit steps) of one block of BLOCK slots, no EOS."""
  orders = set()
  for labels in itertools.product(range(BLOCK), repeat=BLOCK):
    used = sorted(set(labels))
    if used == list(range(len(used))):  # ordered set partitions
      orders.add(labels)
  tokens = [
      t for t in itertools.product(range(VOCAB), repeat=BLOCK) if MASK not in t
  ]
  pairs = [(t, s) for t in tokens for s in sorted(orders)]
  return (
      np.array([p[0] for p in pairs], np.int32),
      np.array([p[1] for p in pairs], np.int32),
  )


@pytest.mark.parametrize(
    "name", ["forced-topk", "static-topk-topp", "sub-blocks-of-1"])
def test_probabilities_of_all_trajectories_sum_to_one(name):
  config = {**CONFIGS, **SUM_ONLY}[name]
  tokens, steps = _all_trajectories()
  rows = tokens.shape[0]
  logps = likelihood.score_trajectories_jit(
      _model(),
      np.tile(PROMPT, (rows, 1)),
      np.ones((rows, PROMPT.size), bool),
      tokens,
      steps,
      config,
  )
  total = float(np.sum(np.exp(np.sum(np.asarray(logps, np.float64), 1))))
  assert total == pytest.approx(1.0, abs=2e-4)


# ---------------------------------------------------------------------------
# One step, brute force over every joint proposal.
# ---------------------------------------------------------------------------

_SMALL_VOCAB = 4  # tokens 0..2 proposable, 3 is the mask
_JOINT = np.array(
    list(itertools.product(range(_SMALL_VOCAB - 1), repeat=3)), np.int32
)

STEP_CONFIGS = {
    # top_k=2 over two equal logits gives confidence exactly 0.5 = tau.
    "threshold-ties-at-tau": config_lib.DenoiseConfig(
        block_size=3, mask_token_id=3, threshold=0.5, temperature=1.0, top_k=2
    ),
    "threshold": config_lib.DenoiseConfig(
        block_size=3, mask_token_id=3, threshold=0.3, temperature=1.0
    ),
    "static-2": config_lib.DenoiseConfig(
        block_size=3, mask_token_id=3, steps_per_block=2, temperature=1.0
    ),
    "sub-blocks-of-1": config_lib.DenoiseConfig(
        block_size=3, mask_token_id=3, threshold=0.3, temperature=1.0,
        sub_block_size=1,
    ),
    "static-3": config_lib.DenoiseConfig(
        block_size=3, mask_token_id=3, steps_per_block=3, temperature=1.0
    ),
}


@functools.lru_cache(maxsize=None)
def _one_step_program(name):
  """(logits [3, 4], block_steps) -> (commit [27, 3], closed form [27])."""
  config = STEP_CONFIGS[name]

  @jax.jit
  def run(logits, block_steps):
    log_probs = denoise_lib.proposal_log_probs(logits, config)
    rows = _JOINT.shape[0]
    confidence = jnp.exp(
        jnp.take_along_axis(log_probs[None], _JOINT[..., None], axis=-1)[..., 0]
    )
    # The sampler's own rule, applied to every joint proposal.
    commit = denoise_lib.select_commits(
        confidence,
        jnp.ones((rows, 3), bool),
        jnp.broadcast_to(jnp.arange(3), (rows, 3)),
        jnp.full((rows,), block_steps, jnp.int32),
        config,
    )
    # Committed slots at canvas 0; the others later (still eligible at 0).
    logps = selection.per_token_log_likelihood(
        jnp.broadcast_to(log_probs, (1, rows, 3, _SMALL_VOCAB)),
        jnp.asarray(_JOINT),
        jnp.where(commit, 0, 1),
        jnp.full((rows, 3), block_steps),
        jnp.broadcast_to(jnp.arange(3), (rows, 3)),
        config,
    )
    joint = jnp.exp(
        jnp.sum(
            jnp.take_along_axis(log_probs[None], _JOINT[..., None], axis=-1)[
                ..., 0
            ],
            axis=1,
        )
    )
    return commit, jnp.exp(jnp.sum(logps, axis=1)), joint

  return run


@pytest.mark.parametrize("name", sorted(STEP_CONFIGS))
@hypothesis.given(
    levels=st.lists(
        st.sampled_from([0.0, 0.0, 0.7, 1.5, -1.0]), min_size=9, max_size=9
    ),
    block_steps=st.integers(0, 2),
    copy_slot=st.booleans(),
)
def test_one_step_closed_form_matches_brute_force(
    name, levels, block_steps, copy_slot
):
  # A few logit levels make ties between slots (and, with top_k=2, with tau)
  # common; `copy_slot` makes two slots identically distributed.
  logits = np.array(levels, np.float32).reshape(3, 3)
  if copy_slot:
    logits[2] = logits[0]
  logits = np.concatenate([logits, np.zeros((3, 1), np.float32)], axis=1)
  commit, closed_form, joint = map(
      np.asarray, _one_step_program(name)(logits, block_steps)
  )
  # Brute force: the probability of each outcome (committed slots and their
  # tokens) is the total probability of the joint proposals leading to it.
  outcome = [tuple(np.where(c, x, -1)) for c, x in zip(commit, _JOINT)]
  total = collections.defaultdict(float)
  for key, weight in zip(outcome, joint.astype(np.float64)):
    total[key] += weight
  np.testing.assert_allclose(
      closed_form, [total[k] for k in outcome], rtol=5e-5, atol=1e-7
  )


def test_bad_arguments_raise():
  result = _rollouts("forced-topk")
  config = CONFIGS["forced-topk"]
  with pytest.raises(ValueError, match="likelihood must be one of"):
    tbd.trajectory_logprob(_model(), result, config, likelihood="biased")
  greedy = config_lib.DenoiseConfig(block_size=BLOCK, mask_token_id=MASK)
  with pytest.raises(ValueError, match="temperature > 0"):
    tbd.trajectory_logprob(_model(), result, greedy)
  with pytest.raises(TypeError, match="DenoiseConfig"):
    tbd.trajectory_logprob(_model(), result, {"block_size": 3})
  with pytest.raises(TypeError, match="GenerationResult"):
    tbd.trajectory_logprob(_model(), {"tokens": 1}, config)
  with pytest.raises(TypeError, match="model_or_logits_fn"):
    tbd.trajectory_logprob(3, result, config)
