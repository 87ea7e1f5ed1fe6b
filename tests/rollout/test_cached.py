"""Tests for exact block-KV-cached generation (DESIGN.md 5.4, 5.5)."""

import functools
import importlib.util
import pathlib
import sys

import compilations
from flax import nnx
import generations
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import cached_state

_spec = importlib.util.spec_from_file_location(
    "rollout_numpy_reference",
    pathlib.Path(__file__).with_name("numpy_reference.py"),
)
ref = sys.modules.get(_spec.name)
if ref is None:
  ref = importlib.util.module_from_spec(_spec)
  sys.modules[_spec.name] = ref
  _spec.loader.exec_module(ref)

VOCAB, MASK = 64, 63
PROMPT_WIDTH, NEW_TOKENS, BLOCK = 11, 13, 4


@functools.lru_cache(maxsize=None)
def _model(name):
  if name == "qwen3":
    return tiny_models.tiny_qwen3(VOCAB, seed=0)
  return tiny_models.tiny_llama3(VOCAB, seed=0)


def _prompts(lengths, seed=0):
  """Left-padded prompts; the padding holds junk tokens that must not matter."""
  rs = np.random.RandomState(seed)
  return rs.randint(0, MASK, size=(len(lengths), PROMPT_WIDTH)), np.array(
      lengths
  )


# (model, config, prompt lengths). Prompt lengths mix a full-width prompt, a
# multiple of the block, lengths that end mid-block and (same_position only)
# an empty prompt; 13 new tokens give every row a partial final block. EOS
# ids are tokens these tiny models emit often, so EOS really triggers (the
# tests check it does).
CASES = {
    "qwen3-threshold-eos": (
        "qwen3",
        config_lib.DenoiseConfig(
            block_size=BLOCK,
            mask_token_id=MASK,
            threshold=0.1,
            eos_token_id=25,
            pad_token_id=0,
        ),
        [11, 0, 8, 5],
    ),
    "qwen3-static-sampled-shifted": (
        "qwen3",
        config_lib.DenoiseConfig(
            block_size=BLOCK,
            mask_token_id=MASK,
            steps_per_block=2,
            temperature=1.0,
            top_k=10,
            alignment="shifted",
        ),
        [11, 3, 8, 1],
    ),
    "llama3-threshold-eos-shifted": (
        "llama3",
        config_lib.DenoiseConfig(
            block_size=BLOCK,
            mask_token_id=MASK,
            threshold=0.05,
            eos_token_id=13,
            alignment="shifted",
        ),
        [11, 3, 8, 5],
    ),
    "llama3-static": (
        "llama3",
        config_lib.DenoiseConfig(
            block_size=BLOCK, mask_token_id=MASK, steps_per_block=3
        ),
        [4, 9, 2, 11],
    ),
}


@functools.lru_cache(maxsize=None)
def _generated(case, use_cache):
  name, config, lengths = CASES[case]
  prompts, lengths = _prompts(lengths)
  return cached.generate(
      _model(name),
      prompts,
      lengths,
      config,
      max_new_tokens=NEW_TOKENS,
      rng=jax.random.key(3),
      use_cache=use_cache,
  )


def _assert_cached_equals_cacheless(case, fast):
  """Rows with a prompt match exactly; empty-prompt rows only in shape.

  An empty prompt's first block is all masks with no context: every slot has
  the same inputs and attends to the same values, so all its slots' logits
  are equal in exact arithmetic and float rounding alone picks the slot a
  threshold step commits first. Two programs (cache and no cache) may round
  that tie differently; the rows after it then diverge legitimately.
  """
  slow = _generated(case, False)
  rows = np.asarray(CASES[case][2]) > 0
  for name in ("tokens", "commit_step", "trace_tokens", "trace_commit_step"):
    np.testing.assert_array_equal(
        np.asarray(getattr(fast, name))[rows],
        np.asarray(getattr(slow, name))[rows],
        err_msg=name,
    )
  if rows.all():
    assert int(fast.num_steps) == int(slow.num_steps)
  for name in ("logprobs", "trace_logprobs"):
    np.testing.assert_allclose(
        np.asarray(getattr(fast, name))[rows],
        np.asarray(getattr(slow, name))[rows],
        atol=1e-4,
        err_msg=name,
    )
  # Every row committed all of its slots (or stopped at EOS); no mask token out.
  tokens, steps = np.asarray(fast.tokens), np.asarray(fast.commit_step)
  assert not np.any(tokens == MASK)
  config = CASES[case][1]
  if config.eos_token_id is None:
    assert np.all(steps >= 0)
  else:
    padded = steps < 0
    assert padded.any(), "EOS never triggered: pick another eos_token_id"
    for b in range(tokens.shape[0]):
      if padded[b].any():
        first = np.argmax(tokens[b] == config.eos_token_id)
        assert (
            np.all(padded[b, first + 1 :]) and not padded[b, : first + 1].any()
        )
        np.testing.assert_array_equal(
            tokens[b, first + 1 :], config.pad_token_id
        )


@functools.lru_cache(maxsize=None)
def _scorer(model_name, alignment):
  """Jitted full-sequence block-causal logits of many canvases at once."""
  model = _model(model_name)

  @jax.jit
  def score(tokens, positions, validity):
    return modeling.block_diffusion_logits(
        model,
        tokens,
        positions,
        block_size=BLOCK,
        alignment=alignment,
        validity=validity,
    )

  return score


def _assert_logprobs_equal_fresh_scoring_of_each_step(case, result):
  name, config, _ = CASES[case]
  _, positions, validity, completion = result.sequence()
  num_steps = int(result.num_steps)
  # Rebuild every step's canvas from the trace and score them in one pass.
  canvases = jnp.concatenate(
      [result.canvas_at(step, MASK) for step in range(num_steps)], axis=0
  )
  tile = lambda x: jnp.tile(x, (num_steps, 1))
  logits = np.asarray(
      _scorer(name, config.alignment)(canvases, tile(positions), tile(validity))
  ).reshape(
      (num_steps,) + result.tokens.shape[:1] + canvases.shape[1:] + (VOCAB,)
  )
  steps = np.asarray(result.trace_commit_step)
  tokens = np.asarray(result.trace_tokens)
  recorded = np.asarray(result.trace_logprobs)
  start = PROMPT_WIDTH
  checked = 0
  for b, n in zip(*np.nonzero(steps >= 0)):
    law, _ = ref.proposal_distribution(
        logits[steps[b, n], b, start + n], config
    )
    np.testing.assert_allclose(recorded[b, n], law[tokens[b, n]], atol=1e-4)
    checked += 1
  assert checked == (steps >= 0).sum() > 0


def _assert_sequence_layout_and_canvas_at(case, result):
  del case
  tokens, positions, validity, completion = map(np.asarray, result.sequence())
  lengths = np.asarray(result.prompt_lengths)
  for b, length in enumerate(lengths):
    pad = PROMPT_WIDTH - length
    assert not validity[b, :pad].any() and validity[b, pad:].all()
    np.testing.assert_array_equal(
        positions[b, pad:], np.arange(length + NEW_TOKENS)
    )
  np.testing.assert_array_equal(tokens[:, PROMPT_WIDTH:], result.tokens)
  assert (
      completion[:, PROMPT_WIDTH:].all()
      and not completion[:, :PROMPT_WIDTH].any()
  )
  first = np.asarray(result.canvas_at(0, MASK))
  np.testing.assert_array_equal(first[:, PROMPT_WIDTH:], MASK)
  last = np.asarray(result.canvas_at(int(result.num_steps), MASK))
  committed = np.asarray(result.trace_commit_step) >= 0
  np.testing.assert_array_equal(
      last[:, PROMPT_WIDTH:][committed],
      np.asarray(result.trace_tokens)[committed],
  )


def _assert_compiled_once_and_takes_new_weights(case, before):
  name, config, lengths = CASES[case]
  model = _model(name)
  prompts, lengths = _prompts(lengths)
  key = (cached.program_config(config), NEW_TOKENS, True, 1, False, False,
         False, False)
  program = cached._PROGRAMS.lookup(nnx.graphdef(model), key)
  # New prompts, same shapes: no retrace.
  other = cached.generate(
      model, prompts[::-1], lengths[::-1], config, max_new_tokens=NEW_TOKENS
  )
  assert program._cache_size() == 1
  assert not np.array_equal(other.tokens, before.tokens)
  # Changed weights are passed in as arguments: new output, still one trace.
  head = model.lm_head.w
  original = head.value
  try:
    head.value = -original
    flipped = cached.generate(
        model, prompts, lengths, config, max_new_tokens=NEW_TOKENS
    )
  finally:
    head.value = original
  assert program._cache_size() == 1
  assert not np.array_equal(flipped.tokens, before.tokens)


def test_another_model_of_the_same_architecture_reuses_the_program():
  """The program is keyed by GraphDef: a new instance of the architecture
  (other weights) traces nothing again; another architecture gets its own,
  and the least recently used programs beyond the bound are dropped."""
  config = config_lib.DenoiseConfig(block_size=BLOCK, mask_token_id=MASK,
                                    steps_per_block=2)
  prompts, lengths = _prompts([11, 5])
  first, second = (tiny_models.tiny_qwen3(VOCAB, seed=s) for s in (7, 8))
  key = (cached.program_config(config), 6, True, 1, False, False, False,
         False)
  a = cached.generate(first, prompts, lengths, config, max_new_tokens=6)
  program = cached._PROGRAMS.lookup(nnx.graphdef(first), key)
  b = cached.generate(second, prompts, lengths, config, max_new_tokens=6)
  assert cached._PROGRAMS.lookup(nnx.graphdef(second), key) is program
  assert program._cache_size() == 1
  assert not np.array_equal(a.logprobs, b.logprobs)  # its own weights
  # Its own output: the same as a program traced for it alone.
  cached._PROGRAMS.clear()
  alone = cached.generate(second, prompts, lengths, config, max_new_tokens=6)
  generations.assert_same_generation(b, alone, logprob_atol=0)
  wider = tiny_models.tiny_qwen3(VOCAB, seed=7, embed_dim=48)
  cached.generate(wider, prompts, lengths, config, max_new_tokens=6)
  assert cached._PROGRAMS.lookup(nnx.graphdef(wider), key) is not (
      cached._PROGRAMS.lookup(nnx.graphdef(second), key))
  # Bounded: after as many newer programs (made, not traced), it is gone.
  for new in range(cached._PROGRAMS.max_programs):
    cached._program(nnx.graphdef(wider), (config, 100 + new) + key[2:])
  assert len(cached._PROGRAMS) == cached._PROGRAMS.max_programs
  assert cached._PROGRAMS.lookup(nnx.graphdef(second), key) is None


# The checks each case's results go through. One test per case keeps every
# compiled program inside one pytest-xdist worker (compiles dominate).
CHECKS = {
    "qwen3-threshold-eos": (
        _assert_cached_equals_cacheless,
        _assert_logprobs_equal_fresh_scoring_of_each_step,
        _assert_sequence_layout_and_canvas_at,
    ),
    "qwen3-static-sampled-shifted": (
        _assert_cached_equals_cacheless,
        _assert_logprobs_equal_fresh_scoring_of_each_step,
    ),
    "llama3-threshold-eos-shifted": (_assert_cached_equals_cacheless,),
    "llama3-static": (
        _assert_cached_equals_cacheless,
        _assert_compiled_once_and_takes_new_weights,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate(case):
  result = _generated(case, True)
  for check in CHECKS[case]:
    check(case, result)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(prompt_tokens=np.zeros((4,), np.int32)),
            ValueError,
            "prompt_tokens must have shape",
        ),
        (
            dict(prompt_tokens=np.zeros((4, 11), np.float32)),
            TypeError,
            "integer dtype",
        ),
        (
            dict(prompt_lengths=np.array([1, 2, 3])),
            ValueError,
            "prompt_lengths must have shape",
        ),
        (
            dict(prompt_lengths=np.array([1, 2, 3, 12])),
            ValueError,
            "prompt_lengths must lie",
        ),
        (
            dict(prompt_lengths=np.array([1, 2, 3, -1])),
            ValueError,
            "prompt_lengths must lie",
        ),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
        (dict(cache_phases=0), ValueError, "cache_phases must be >= 1"),
        (dict(cache_phases=2.0), TypeError, "cache_phases must be an int"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
        (dict(config=dict(block_size=4)), TypeError, "DenoiseConfig"),
        (
            dict(
                config=config_lib.DenoiseConfig(
                    block_size=4, mask_token_id=MASK, temperature=1.0
                )
            ),
            ValueError,
            "rng",
        ),
        (
            dict(
                config=config_lib.DenoiseConfig(
                    block_size=4, mask_token_id=MASK, alignment="shifted"
                ),
                prompt_lengths=np.array([0, 2, 3, 4]),
            ),
            ValueError,
            "shifted",
        ),
    ],
)
def test_generate_validation(kwargs, error, match):
  args = dict(
      prompt_tokens=np.zeros((4, 11), np.int32),
      prompt_lengths=np.array([1, 2, 3, 4]),
      config=config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK),
      max_new_tokens=5,
  )
  args.update(kwargs)
  with pytest.raises(error, match=match):
    cached.generate(
        _model("qwen3"),
        args["prompt_tokens"],
        args["prompt_lengths"],
        args["config"],
        max_new_tokens=args["max_new_tokens"],
        cache_phases=args.get("cache_phases", 1),
    )


def test_phase_extents_cover_the_cache_in_increasing_prefixes():
  assert cached_state.phase_extents(64, 324, 4, 1) == [324]
  assert cached_state.phase_extents(64, 324, 4, 4) == [144, 208, 272, 324]
  assert cached_state.phase_extents(8, 20, 4, 4) == [16, 20]
  assert cached_state.phase_extents(0, 40, 8, 3) == [16, 32, 40]


@pytest.mark.parametrize("phases", [2, 5])
def test_cache_phases_give_the_same_generation(phases):
  """Each phase reads a prefix of the cache: the same tokens and steps.

  Rows of mixed prompt lengths under threshold decoding fall out of phase,
  so the phases' extents are crossed at different steps by different rows.
  """
  model = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  rng = np.random.default_rng(phases)
  lengths = np.array([11, 1, 6, 9])
  prompts = rng.integers(0, MASK, size=(4, PROMPT_WIDTH))
  config = config_lib.DenoiseConfig(block_size=BLOCK, mask_token_id=MASK,
                                    threshold=0.2, alignment="shifted",
                                    temperature=1.0)
  run = functools.partial(cached.generate, model, prompts, lengths, config,
                          max_new_tokens=21, rng=jax.random.key(3))
  one_phase = run(cache_phases=1)
  with compilations.counting() as compiles:
    staged = run(cache_phases=phases)
  # Each stage compiled once (in threads, before it runs), none twice.
  stages = cached_state.num_phases(PROMPT_WIDTH, 21, BLOCK, phases) + 2
  assert len(compiles) == stages, compiles
  with compilations.counting() as compiles:
    again = run(cache_phases=phases)
  assert not compiles
  # Shorter key axes sum in another order: log-probs agree to rounding.
  generations.assert_same_generation(staged, one_phase)
  generations.assert_same_generation(again, staged)
  if phases == 2:
    # Every stage in one program: one compilation, the same generation.
    with compilations.counting() as compiles:
      whole = run(cache_phases=phases, one_program=True)
    assert len(compiles) == 1, compiles
    generations.assert_same_generation(whole, staged)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_threshold_sweep_shares_one_program(use_cache):
  """The threshold is an operand: every threshold of a config runs one
  program, each giving what a program built for its constant threshold
  gives (the cacheless loop traced with `config.threshold` as it was)."""
  model = _model("qwen3")
  prompts, lengths = _prompts([11, 3, 8, 5], seed=4)
  rng = jax.random.key(5)
  results = []
  for i, threshold in enumerate([0.02, 0.06, 0.9]):
    config = config_lib.DenoiseConfig(block_size=BLOCK, mask_token_id=MASK,
                                      threshold=threshold, eos_token_id=25)
    with compilations.counting() as compiles:
      got = cached.generate(model, prompts, lengths, config,
                            max_new_tokens=NEW_TOKENS, rng=rng,
                            use_cache=use_cache)
    if i:
      assert not compiles, (threshold, compiles)
    constant = jax.jit(functools.partial(
        cached._cacheless_program,  # pylint: disable=protected-access
        model, jnp.asarray(prompts), jnp.asarray(lengths), rng, config,
        NEW_TOKENS, None))()
    generations.assert_same_generation(got, constant)
    results.append(got)
  # The thresholds act: fewer steps as the threshold falls.
  steps = [int(r.num_steps) for r in results]
  assert steps[0] < steps[1] < steps[2], steps


def test_one_program_is_a_bool_mode_of_the_cached_driver():
  args = (_model("qwen3"), np.zeros((2, 4), np.int32), np.array([1, 4]),
          config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK))
  with pytest.raises(TypeError, match="one_program must be a bool"):
    cached.generate(*args, max_new_tokens=4, cache_phases=2, one_program=1)
  with pytest.raises(ValueError, match="one_program=True .* use_cache=True"):
    cached.generate(*args, max_new_tokens=4, use_cache=False,
                    one_program=True)


@pytest.mark.parametrize(
    "block, prompt_width, new_tokens, schedule",
    [
        (1, 5, 6, dict(threshold=0.05)),
        (3, 2, 9, dict(steps_per_block=2)),  # prompts narrower than a block
        (8, 9, 11, dict(threshold=0.3, alignment="shifted", temperature=1.0,
                        eos_token_id=5)),
        # Fast-dLLM v2's rule: sub-blocks inside the window.
        (8, 6, 13, dict(threshold=0.3, alignment="shifted", temperature=1.0,
                        sub_block_size=2)),
    ],
)
def test_other_block_sizes_match_the_cacheless_program(
    block, prompt_width, new_tokens, schedule):
  """The fused step, the fresh block and the prefill at other widths."""
  model = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  rng = np.random.default_rng(block)
  lengths = rng.integers(1, prompt_width + 1, size=3)
  prompts = rng.integers(0, MASK, size=(3, prompt_width))
  config = config_lib.DenoiseConfig(block_size=block, mask_token_id=MASK,
                                    **schedule)
  runs = [
      cached.generate(model, prompts, lengths, config,
                      max_new_tokens=new_tokens, rng=jax.random.key(block),
                      use_cache=use_cache)
      for use_cache in (True, False)
  ]
  generations.assert_same_generation(runs[0], runs[1], same_num_steps=False)
