"""Tests for the denoising transition program (DESIGN.md 5.3)."""

import functools
import importlib.util
import pathlib
import sys

import hypothesis
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.rollout import denoise as denoise_lib

_spec = importlib.util.spec_from_file_location(
    "rollout_numpy_reference",
    pathlib.Path(__file__).with_name("numpy_reference.py"),
)
ref = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ref  # dataclasses look their module up here
_spec.loader.exec_module(ref)

BATCH, LENGTH, VOCAB = 3, 24, 12
MASK, EOS = VOCAB - 1, 3


def _config(**kwargs):
  return config_lib.DenoiseConfig(mask_token_id=MASK, **kwargs)


# A fixed set of configs (each compiles once): threshold incl. 1.0, static
# schedules, EOS, shifted alignment, top-k/top-p sampling, partial blocks.
CONFIGS = (
    _config(block_size=4, threshold=1.0),
    _config(block_size=3, steps_per_block=2),
    _config(block_size=5, threshold=0.7, eos_token_id=EOS),
    _config(
        block_size=4, steps_per_block=3, eos_token_id=EOS, alignment="shifted"
    ),
    _config(
        block_size=4,
        threshold=0.6,
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        eos_token_id=EOS,
    ),
)
THRESHOLD_ONE, STATIC, GREEDY_EOS, STATIC_SHIFTED, SAMPLED = CONFIGS


def jax_context_logits(params, tokens, positions, validity):
  """JAX twin of `ref.context_logits` (float32)."""
  embed, unembed, freqs, phase = params
  pos = positions.astype(jnp.float32)
  weights = (
      jnp.cos(0.5 * (pos[:, :, None] - pos[:, None, :])) * validity[:, None, :]
  )
  mixed = jnp.einsum("bij,bjd->bid", weights, embed[tokens]) / tokens.shape[1]
  hidden = jnp.tanh(jnp.sin(pos[:, :, None] * freqs + phase) + mixed)
  return ref.make_params(0, VOCAB).scale * hidden @ unembed


def _jax_params(params):
  return tuple(
      jnp.asarray(x)
      for x in (params.embed, params.unembed, params.freqs, params.phase)
  )


@functools.lru_cache(maxsize=None)
def _runner(config):
  """Jitted denoise over the context logits; params and validity are traced."""

  def run(params, canvas, positions, completion, validity, rng):
    def logits_fn(tokens, pos):
      return jax_context_logits(params, tokens, pos, validity)

    return denoise_lib.denoise_with_trace(
        logits_fn, canvas, positions, completion, validity, config, rng
    )

  return jax.jit(run)


def _make_batch(rs, config, lengths, cp):
  """Rows of (valid, prompt, left padding) in logical order, then CP-permuted."""
  canvas = rs.randint(0, VOCAB, size=(BATCH, LENGTH))
  positions = rs.randint(0, LENGTH, size=(BATCH, LENGTH))  # junk where invalid
  completion = np.zeros((BATCH, LENGTH), bool)
  validity = np.zeros((BATCH, LENGTH), bool)
  for b, (num_valid, num_prompt, left) in enumerate(lengths):
    slots = np.arange(left, left + num_valid)
    validity[b, slots] = True
    positions[b, slots] = np.arange(num_valid)
    completion[b, slots[num_prompt:]] = True
  order = context_parallel.load_balance_order(LENGTH, cp)
  return tuple(x[:, order] for x in (canvas, positions, completion, validity))


@st.composite
def _cases(draw):
  config = draw(st.sampled_from(CONFIGS))
  lengths = []
  for _ in range(BATCH):
    num_valid = draw(st.integers(0, LENGTH))
    min_prompt = min(1, num_valid) if config.alignment == "shifted" else 0
    num_prompt = draw(st.integers(min_prompt, num_valid))
    left = draw(st.integers(0, LENGTH - num_valid))
    lengths.append((num_valid, num_prompt, left))
  cp = draw(st.sampled_from([1, 2, 4, 6]))
  seed = draw(st.integers(0, 2**16))
  return config, lengths, cp, seed


@functools.lru_cache(maxsize=None)
def _noise_table(block_size):
  """Jitted: the documented per-step Gumbel noise for steps 0..LENGTH."""

  def table(rng):
    return jax.vmap(
        lambda step: jax.random.gumbel(
            jax.random.fold_in(rng, step), (BATCH, block_size, VOCAB)
        )
    )(jnp.arange(LENGTH + 1))

  return jax.jit(table)


def _noise_of(rng, config):
  table = np.asarray(_noise_table(config.block_size)(rng))
  return lambda step: table[step]


@given(_cases())
def test_matches_numpy_reference(case):
  config, lengths, cp, seed = case
  rs = np.random.RandomState(seed)
  canvas, positions, completion, validity = _make_batch(rs, config, lengths, cp)
  params = ref.make_params(seed, VOCAB)
  rng = jax.random.key(seed)
  result, _ = _runner(config)(
      _jax_params(params), canvas, positions, completion, validity, rng
  )
  expected = ref.reference_denoise(
      lambda tokens: ref.context_logits(params, tokens, positions, validity),
      canvas,
      positions,
      completion,
      validity,
      config,
      noise_of=_noise_of(rng, config),
  )
  # float32 vs float64 may disagree only at near-ties; skip those inputs.
  hypothesis.assume(expected["margin"] > 1e-4)
  np.testing.assert_array_equal(result.tokens, expected["tokens"])
  np.testing.assert_array_equal(result.commit_step, expected["commit_step"])
  assert int(result.num_steps) == expected["num_steps"]
  np.testing.assert_allclose(result.logprobs, expected["logprobs"], atol=1e-4)
  assert (
      result.tokens.dtype == jnp.int32 and result.commit_step.dtype == jnp.int32
  )
  assert (
      result.logprobs.dtype == jnp.float32
      and result.num_steps.dtype == jnp.int32
  )


def _random_case(config, seed=0, cp=1, lengths=None):
  lengths = lengths or [(20, 5, 2), (24, 1, 0), (11, 4, 13)]
  rs = np.random.RandomState(seed)
  canvas, positions, completion, validity = _make_batch(rs, config, lengths, cp)
  params = _jax_params(ref.make_params(seed, VOCAB))
  return params, canvas, positions, completion, validity


def test_threshold_one_commits_one_slot_per_step():
  config = THRESHOLD_ONE
  params, canvas, positions, completion, validity = _random_case(config)
  result, _ = _runner(config)(
      params, canvas, positions, completion, validity, jax.random.key(0)
  )
  steps = np.asarray(result.commit_step)
  for b in range(BATCH):
    row = steps[b][completion[b]]
    # Every slot of the row committed at its own step, steps 0..n-1.
    np.testing.assert_array_equal(np.sort(row), np.arange(completion[b].sum()))
  assert int(result.num_steps) == completion.sum(axis=1).max()


def test_static_schedule_commits_ceil_left_over_steps_left():
  config = STATIC  # block 3, 2 steps per block
  params, canvas, positions, completion, validity = _random_case(config)
  result, _ = _runner(config)(
      params, canvas, positions, completion, validity, jax.random.key(0)
  )
  steps = np.asarray(result.commit_step)
  for b in range(BATCH):
    for block in np.unique(positions[b][completion[b]] // 3):
      in_block = completion[b] & validity[b] & (positions[b] // 3 == block)
      counts = np.unique(steps[b][in_block], return_counts=True)[1]
      size = in_block.sum()
      # ceil(size / 2) then the rest: never more than 2 steps per block.
      expected = [-(-size // 2), size - -(-size // 2)] if size > 1 else [1]
      np.testing.assert_array_equal(counts, expected)


def test_load_balanced_permutation_is_equivariant():
  config = GREEDY_EOS
  logical = _random_case(config, seed=3, cp=1)
  params = logical[0]
  run = _runner(config)
  base, _ = run(*logical, jax.random.key(0))
  for cp in (2, 4):
    order = context_parallel.load_balance_order(LENGTH, cp)
    permuted = [x[:, order] for x in logical[1:]]
    out, _ = run(params, *permuted, jax.random.key(0))
    for name in ("tokens", "commit_step"):
      np.testing.assert_array_equal(
          getattr(out, name), np.asarray(getattr(base, name))[:, order]
      )
    # The einsum sums in another order: equal up to float32 rounding.
    np.testing.assert_allclose(
        out.logprobs, np.asarray(base.logprobs)[:, order], atol=1e-5
    )
    assert int(out.num_steps) == int(base.num_steps)


def test_jit_and_eager_agree_and_completion_contents_are_ignored():
  config = GREEDY_EOS
  params, canvas, positions, completion, validity = _random_case(config, seed=5)
  jitted, _ = _runner(config)(
      params, canvas, positions, completion, validity, jax.random.key(0)
  )
  scribbled = np.where(completion, EOS, canvas)
  eager = denoise_lib.denoise(
      lambda t, p: jax_context_logits(params, t, p, validity),
      scribbled,
      positions,
      completion,
      validity,
      config,
  )
  for name in ("tokens", "commit_step"):
    np.testing.assert_array_equal(getattr(eager, name), getattr(jitted, name))
  np.testing.assert_allclose(eager.logprobs, jitted.logprobs, atol=1e-6)
  # Prompt and invalid slots come back unchanged.
  np.testing.assert_array_equal(
      np.asarray(jitted.tokens)[~completion], canvas[~completion]
  )
  assert np.all(np.asarray(jitted.commit_step)[~completion] == -1)


def test_ties_commit_the_lowest_logical_position_first():
  # Identical logits everywhere: every eligible slot is equally confident, so
  # forced progress must walk the logical order whatever the physical one.
  config = _config(block_size=4, threshold=0.99)
  logits = jnp.zeros((VOCAB,)).at[2].set(1.0)
  order = context_parallel.load_balance_order(LENGTH, 4)
  positions = np.tile(np.arange(LENGTH), (1, 1))[:, order]
  completion = positions >= 6
  validity = np.ones_like(completion)
  result = denoise_lib.denoise(
      lambda t, p: jnp.broadcast_to(logits, t.shape + (VOCAB,)),
      np.zeros_like(positions),
      positions,
      completion,
      validity,
      config,
  )
  steps = np.asarray(result.commit_step)[0]
  np.testing.assert_array_equal(
      steps[completion[0]], positions[0][completion[0]] - 6
  )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mask_token_is_never_proposed(temperature):
  config = _config(block_size=4, threshold=0.5, temperature=temperature)
  # The mask token dominates every slot; it must still never be committed.
  logits = jnp.zeros((VOCAB,)).at[MASK].set(50.0).at[4].set(1.0)
  positions = np.arange(12)[None]
  completion = positions >= 2
  result = denoise_lib.denoise(
      lambda t, p: jnp.broadcast_to(logits, t.shape + (VOCAB,)),
      np.zeros_like(positions),
      positions,
      completion,
      np.ones_like(completion),
      config,
      rng=jax.random.key(1),
  )
  assert not np.any(np.asarray(result.tokens) == MASK)
  assert np.all(np.asarray(result.commit_step)[completion] >= 0)


def test_eos_stops_the_row_and_pads_after_it():
  config = _config(
      block_size=4, threshold=0.5, eos_token_id=EOS, pad_token_id=7
  )
  eos_at = 9  # logical position of the EOS in row 0 (inside block 2)

  def logits_fn(tokens, positions):
    # Confident token 5 everywhere; row 0 proposes EOS at `eos_at` and two
    # slots after it, which are committed in the same step (same block).
    want = jnp.where(
        (jnp.arange(2)[:, None] == 0)
        & (positions >= eos_at)
        & (positions < eos_at + 2),
        EOS,
        5,
    )
    return 8.0 * jax.nn.one_hot(want, VOCAB)

  positions = np.tile(np.arange(20), (2, 1))
  completion = positions >= 3
  result, trace = jax.jit(
      lambda: denoise_lib.denoise_with_trace(
          logits_fn,
          np.zeros((2, 20), np.int32),
          positions,
          completion,
          np.ones((2, 20), bool),
          config,
      )
  )()
  tokens, steps = np.asarray(result.tokens), np.asarray(result.commit_step)
  # Row 0: EOS kept, everything after it is padding, never committed.
  assert tokens[0, eos_at] == EOS
  np.testing.assert_array_equal(tokens[0, eos_at + 1 :], 7)
  np.testing.assert_array_equal(steps[0, eos_at + 1 :], -1)
  np.testing.assert_array_equal(
      np.asarray(result.logprobs)[0, eos_at + 1 :], 0.0
  )
  # Block [8, 12) commits in one step; the row stops there, row 1 goes on.
  assert steps[0, eos_at] == steps[0, 8] == np.asarray(trace.commit_step)[0, 11]
  assert int(result.num_steps) == steps[1].max() + 1 > steps[0].max() + 1
  # The trace keeps the slot committed after EOS in the EOS block.
  assert np.asarray(trace.tokens)[0, eos_at + 1] == EOS
  assert np.asarray(trace.commit_step)[0, eos_at + 1] == steps[0, eos_at]
  assert np.asarray(trace.tokens)[0, 12] == MASK


def test_sampling_is_deterministic_per_key():
  config = SAMPLED
  params, canvas, positions, completion, validity = _random_case(config, seed=7)
  run = _runner(config)
  first, _ = run(
      params, canvas, positions, completion, validity, jax.random.key(11)
  )
  again, _ = run(
      params, canvas, positions, completion, validity, jax.random.key(11)
  )
  other, _ = run(
      params, canvas, positions, completion, validity, jax.random.key(12)
  )
  for name in ("tokens", "commit_step", "logprobs"):
    np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
  assert not np.array_equal(first.tokens, other.tokens)


@pytest.mark.parametrize("config", [GREEDY_EOS, SAMPLED])
def test_recorded_logprobs_equal_fresh_scoring_of_each_step_canvas(config):
  params, canvas, positions, completion, validity = _random_case(config, seed=9)
  result, trace = _runner(config)(
      params, canvas, positions, completion, validity, jax.random.key(4)
  )
  trace_tokens = np.asarray(trace.tokens)
  trace_steps = np.asarray(trace.commit_step)
  checked = 0
  for step in range(int(result.num_steps)):
    # The step's canvas: tokens committed before it, mask elsewhere.
    committed = completion & (trace_steps >= 0) & (trace_steps < step)
    rebuilt = np.where(
        completion, np.where(committed, trace_tokens, MASK), canvas
    )
    logits = ref.context_logits(
        ref.make_params(9, VOCAB), rebuilt, positions, validity
    )
    for b, i in zip(*np.nonzero(trace_steps == step)):
      law, _ = ref.proposal_distribution(logits[b, i], config)
      np.testing.assert_allclose(
          trace.logprobs[b, i], law[trace_tokens[b, i]], atol=1e-4
      )
      checked += 1
  assert checked == (trace_steps >= 0).sum() > 0
  # The EOS-padded result keeps exactly the trace's log-probs where committed.
  kept = np.asarray(result.commit_step) >= 0
  np.testing.assert_array_equal(
      np.asarray(result.logprobs)[kept], np.asarray(trace.logprobs)[kept]
  )


# ----------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------


def _valid_inputs():
  positions = np.tile(np.arange(8), (2, 1))
  completion = positions >= 3
  return dict(
      canvas=np.zeros((2, 8), np.int32),
      positions=positions,
      completion=completion,
      validity=np.ones((2, 8), bool),
  )


def _call(config=None, rng=None, logits_fn=None, **overrides):
  inputs = _valid_inputs()
  inputs.update(overrides)
  config = config or _config(block_size=4)
  logits_fn = logits_fn or (lambda t, p: jnp.zeros(t.shape + (VOCAB,)))
  return denoise_lib.denoise(logits_fn, config=config, rng=rng, **inputs)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (
            dict(canvas=np.zeros((2, 7), np.int32)),
            ValueError,
            "positions must have the shape",
        ),
        (
            dict(validity=np.ones((2, 9), bool)),
            ValueError,
            "validity must have the shape",
        ),
        (
            dict(canvas=np.zeros((2, 8), np.float32)),
            TypeError,
            "canvas must have an integer",
        ),
        (
            dict(positions=np.zeros((2, 8), np.float32)),
            TypeError,
            "positions must have an integer",
        ),
        (
            dict(completion=np.ones((2, 8), np.int32)),
            TypeError,
            "completion must have dtype bool",
        ),
        (
            dict(validity=np.ones((2, 8), np.int32)),
            TypeError,
            "validity must have dtype bool",
        ),
        (
            dict(canvas=np.zeros((8,), np.int32)),
            ValueError,
            "canvas must have shape",
        ),
        (
            dict(validity=np.tile(np.arange(8) < 6, (2, 1))),
            ValueError,
            "completion slots must be valid",
        ),
        (
            dict(completion=np.tile(np.arange(8) % 2 == 1, (2, 1))),
            ValueError,
            "contiguous suffix",
        ),
        (
            dict(positions=np.tile(np.array([0, 1, 2, 3, 3, 5, 6, 7]), (2, 1))),
            ValueError,
            "distinct",
        ),
        (dict(positions=np.tile(np.arange(8) - 1, (2, 1))), ValueError, ">= 0"),
    ],
)
def test_validation_errors(overrides, error, match):
  with pytest.raises(error, match=match):
    _call(**overrides)


def test_completion_suffix_is_checked_in_logical_not_physical_order():
  # Physically reversed rows are fine: the completion is the logical suffix.
  inputs = _valid_inputs()
  denoise_lib.check_canvas_values(
      inputs["positions"][:, ::-1],
      inputs["completion"][:, ::-1],
      inputs["validity"][:, ::-1],
      _config(block_size=4),
  )
  # A completion at logical 0..2 with the prompt after it is not.
  with pytest.raises(ValueError, match="contiguous suffix"):
    _call(completion=inputs["positions"] < 3)


def test_shifted_needs_logical_position_zero_in_the_prompt():
  shifted = _config(block_size=4, alignment="shifted")
  with pytest.raises(ValueError, match="logical position 0"):
    _call(config=shifted, completion=np.ones((2, 8), bool))
  # Position 0 present only as padding (invalid) does not count either.
  validity = np.tile(np.arange(8) > 0, (2, 1))
  positions = np.tile(np.arange(8), (2, 1))
  with pytest.raises(ValueError, match="logical position 0"):
    _call(
        config=shifted,
        validity=validity,
        positions=positions,
        completion=validity & (positions >= 1),
    )
  inputs = _valid_inputs()  # prompt at logical 0..2: fine
  denoise_lib.check_canvas_values(
      inputs["positions"], inputs["completion"], inputs["validity"], shifted
  )


def test_sampling_requires_a_key_and_config_and_logits_are_checked():
  with pytest.raises(ValueError, match="rng"):
    _call(config=_config(block_size=4, temperature=1.0))
  with pytest.raises(TypeError, match="DenoiseConfig"):
    _call(config=dict(block_size=4))
  with pytest.raises(ValueError, match="shape \\[batch, length, vocab\\]"):
    _call(logits_fn=lambda t, p: jnp.zeros((2, 7, VOCAB)))
  with pytest.raises(ValueError, match="mask_token_id"):
    _call(logits_fn=lambda t, p: jnp.zeros(t.shape + (MASK,)))
  with pytest.raises(TypeError, match="floating"):
    _call(logits_fn=lambda t, p: jnp.zeros(t.shape + (VOCAB,), jnp.int32))


def test_shape_checks_run_at_trace_time_under_jit():
  inputs = _valid_inputs()

  @jax.jit
  def run(canvas, positions, completion, validity):
    return denoise_lib.denoise(
        lambda t, p: jnp.zeros(t.shape + (VOCAB,)),
        canvas,
        positions,
        completion,
        validity,
        _config(block_size=4),
    )

  with pytest.raises(TypeError, match="completion must have dtype bool"):
    run(
        inputs["canvas"],
        inputs["positions"],
        inputs["completion"].astype(np.int32),
        inputs["validity"],
    )
