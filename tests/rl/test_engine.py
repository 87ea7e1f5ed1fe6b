"""Tests for BlockDiffusionRollout, the Tunix rollout engine."""

import dataclasses
import functools

from flax import nnx
import jax
import numpy as np
import pytest
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from tunix_blockdiff import tasks
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rl import engine as engine_lib

TOKENIZER = tasks.CharTokenizer()
PROMPTS = ["rev 123>", "rev 98>", "sort 5521>"]
ROLLOUT_CONFIG = base_rollout.RolloutConfig(
    max_tokens_to_generate=6,
    max_prompt_length=12,
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    seed=None,
)


@functools.lru_cache(maxsize=None)
def _engine():
  model = tiny_models.tiny_qwen3(TOKENIZER.vocab_size, seed=5, num_layers=1)
  return engine_lib.BlockDiffusionRollout(
      rollout_actor=model,
      tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
      rollout_config=ROLLOUT_CONFIG,
      block_size=4,
      threshold=0.3,
  )


@functools.lru_cache(maxsize=None)
def _output():
  return _engine().generate(PROMPTS, ROLLOUT_CONFIG)


@pytest.mark.parametrize(
    "factory",
    [
        engine_lib.BlockDiffusionRollout,
        functools.partial(engine_lib.BlockDiffusionRollout, block_size=2),
    ],
)
def test_constructs_like_rlcluster_does(factory):
  model = _engine().model()
  engine = factory(
      rollout_actor=model,
      tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
      mesh=None,
      rollout_config=ROLLOUT_CONFIG,
  )
  assert isinstance(engine, base_rollout.BaseRollout)
  expected_block = getattr(factory, "keywords", {}).get("block_size", 4)
  assert engine.score_config.block_size == expected_block
  assert engine.model() is model
  # Mask id from the tokenizer; EOS and pad from it too.
  assert engine.score_config.mask_token_id == TOKENIZER.mask_id()
  assert engine.eos_id() == TOKENIZER.eos_id() and engine.pad_id() == 0


def test_generate_returns_completions_cut_at_eos_and_the_trace():
  output = _output()
  config = _engine().score_config
  assert isinstance(output, engine_lib.BlockDiffusionRolloutOutput)
  assert output.left_padded_prompt_tokens.shape == (3, 12)
  assert output.trace_tokens.shape == output.commit_steps.shape == (3, 6)
  # Prompts: BOS then the characters, left padded.
  first = output.left_padded_prompt_tokens[0]
  expected = [TOKENIZER.bos_id()] + TOKENIZER.encode(PROMPTS[0])
  assert first[-len(expected) :].tolist() == expected
  assert np.all(first[: -len(expected)] == TOKENIZER.pad_id())
  for b in range(3):
    tokens, steps = output.trace_tokens[b], output.commit_steps[b]
    eos = np.flatnonzero((tokens == config.eos_token_id) & (steps >= 0))
    end = int(eos[0]) if eos.size else 6
    assert output.tokens[b].tolist() == tokens[:end].tolist()
    assert np.all(steps[:end] >= 0)
    assert output.text[b] == TOKENIZER.decode(tokens[:end].tolist())
    np.testing.assert_allclose(
        output.logprobs[b], output.trace_logprobs[b][:end]
    )
    assert np.all(output.logprobs[b] <= 0)


def test_cache_phases_give_the_same_rollouts():
  """Fresh engines (the same call counter, so the same noise).

  One phase, three staged, and three in one program (`one_program`).
  """
  outputs = [
      engine_lib.BlockDiffusionRollout(
          rollout_actor=_engine().model(),
          tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
          rollout_config=ROLLOUT_CONFIG, block_size=4, threshold=0.3,
          cache_phases=phases, one_program=one).generate(PROMPTS,
                                                         ROLLOUT_CONFIG)
      for phases, one in ((1, False), (3, False), (3, True))
  ]
  for other in outputs[1:]:
    assert other.text == outputs[0].text
    for a, b in zip(outputs[0].tokens, other.tokens, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(TypeError, match="one_program must be a bool"):
    engine_lib.BlockDiffusionRollout(
        rollout_actor=_engine().model(),
        tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
        rollout_config=ROLLOUT_CONFIG, block_size=4, one_program="yes")


def test_lockstep_rollouts_are_scored_as_their_own_trace():
  """Held steps are no row's own: the scorer reproduces the log-probs.

  (With the cache kernel too: its rounding is within the tolerance.)
  """
  engine = engine_lib.BlockDiffusionRollout(
      rollout_actor=_engine().model(),
      tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
      rollout_config=ROLLOUT_CONFIG, block_size=4, threshold=0.3,
      lockstep=True, ragged_cache=True)
  output = engine.generate(PROMPTS, ROLLOUT_CONFIG)
  logps = engine.get_per_token_logps(
      output.left_padded_prompt_tokens, output.trace_tokens,
      output.commit_steps, likelihood="committed_only")
  assert np.abs(np.asarray(logps) - output.trace_logprobs).max() <= 1e-4
  with pytest.raises(TypeError, match="lockstep must be a bool"):
    engine_lib.BlockDiffusionRollout(
        rollout_actor=_engine().model(),
        tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
        rollout_config=ROLLOUT_CONFIG, block_size=4, lockstep="yes")
  with pytest.raises(ValueError, match="fused_head=True needs the"
                     " same_position alignment"):
    engine_lib.BlockDiffusionRollout(
        rollout_actor=_engine().model(),
        tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
        rollout_config=ROLLOUT_CONFIG, block_size=4, alignment="shifted",
        fused_head=True)


def test_per_token_logps_reproduce_the_rollouts_and_need_commit_steps():
  engine, output = _engine(), _output()
  logps = engine.get_per_token_logps(
      output.left_padded_prompt_tokens,
      output.trace_tokens,
      output.commit_steps,
      likelihood="committed_only",
  )
  assert np.abs(np.asarray(logps) - output.trace_logprobs).max() <= 1e-4
  # The exact likelihood adds the selection terms: never above it.
  exact = engine.get_per_token_logps(
      output.left_padded_prompt_tokens, output.trace_tokens, output.commit_steps
  )
  assert np.all(np.sum(exact, 1) <= np.sum(logps, 1) + 1e-5)
  with pytest.raises(ValueError, match="commit_step is required"):
    engine.get_per_token_logps(
        output.left_padded_prompt_tokens, output.trace_tokens
    )


def test_update_params_loads_new_weights_in_place():
  engine = _engine()
  model = engine.model()
  old = nnx.state(model, nnx.Param)
  new = jax.tree.map(lambda x: x * 0.5, old)
  engine.update_params(new, (nnx.Param,))
  first = jax.tree.leaves(nnx.state(engine.model(), nnx.Param))[0]
  np.testing.assert_allclose(first, jax.tree.leaves(new)[0])
  engine.update_params(old)  # restore for the other tests
  np.testing.assert_allclose(
      jax.tree.leaves(nnx.state(engine.model(), nnx.Param))[0],
      jax.tree.leaves(old)[0],
  )


def test_rollout_config_maps_to_the_denoise_config():
  engine = _engine()
  config = engine.denoise_config(
      dataclasses.replace(ROLLOUT_CONFIG, temperature=0.7, top_k=5, top_p=0.8)
  )
  assert (config.temperature, config.top_k, config.top_p) == (0.7, 5, 0.8)
  # Tunix's "all tokens" spellings and greedy decoding drop the filters.
  assert engine.score_config.top_k is None and engine.score_config.top_p is None
  greedy = engine.denoise_config(
      dataclasses.replace(ROLLOUT_CONFIG, temperature=0.0, top_k=5)
  )
  assert greedy.top_k is None
  with pytest.raises(ValueError, match="one EOS token"):
    engine.denoise_config(
        dataclasses.replace(ROLLOUT_CONFIG, eos_tokens=[2, 5])
    )


def test_record_outputs_collects_generate_calls():
  engine = _engine()
  with engine.record_outputs() as records:
    out = engine.generate(PROMPTS, dataclasses.replace(ROLLOUT_CONFIG, seed=3))
  assert records == [out]
  merged = engine_lib.concat_outputs([_output(), out], pad_id=0)
  assert merged.trace_tokens.shape == (6, 6) and merged.text[3:] == out.text


def test_bad_construction_raises():
  model = _engine().model()
  with pytest.raises(ValueError, match="block_size"):
    engine_lib.BlockDiffusionRollout(model, TOKENIZER, block_size=0)
  with pytest.raises(ValueError, match="cache_phases must be >= 1"):
    engine_lib.BlockDiffusionRollout(model, TOKENIZER, cache_phases=0)
  with pytest.raises(ValueError, match="mask_token_id is required"):

    class NoMask:
      encode, decode = TOKENIZER.encode, TOKENIZER.decode
      bos_id, eos_id, pad_id = (
          TOKENIZER.bos_id,
          TOKENIZER.eos_id,
          TOKENIZER.pad_id,
      )

    engine_lib.BlockDiffusionRollout(model, NoMask(), block_size=4)


def test_long_prompts_are_counted_once_per_call_not_logged_per_prompt(
    caplog,
):
  engine = engine_lib.BlockDiffusionRollout(
      rollout_actor=_engine().model(),
      tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
      rollout_config=ROLLOUT_CONFIG,
      block_size=4,
  )
  with caplog.at_level("WARNING"):
    tokens, lengths = engine.tokenize_prompts(
        ["rev 1234567>", "rev 7654321>", "rev 1>"], 8
    )
    engine.tokenize_prompts(["rev 1234567>"], 8)
  assert tokens.shape == (3, 8) and lengths.tolist() == [8, 8, 7]
  assert engine.truncated_prompts == 3
  warnings = [r for r in caplog.records if "truncated" in r.getMessage()]
  assert len(warnings) == 2
  assert "2 of 3 prompts" in warnings[0].getMessage()


def test_a_static_schedule_samples_several_tokens_per_call():
  """`rollout.steps_per_block=1` (rl/opd recipes): every block in one call.

  The static schedule's exact likelihood (selection included) is tested
  by chi-square in test_likelihood.py; here the recipe key reaches the
  engine and sampled rollouts commit a whole block of 4 per model call,
  where the threshold rule at temperature 1 commits about one.
  """
  import omegaconf  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff.runs import common  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.runs import rl_common  # pylint: disable=g-import-not-at-top

  cfg = common.load_recipe(["rl_tiny.yaml", "rollout.steps_per_block=1"])
  sft_cfg = omegaconf.OmegaConf.create({"diffusion": {
      "block_size": 4, "mask_token_id": TOKENIZER.mask_id(),
      "alignment": "same_position"}})
  factory = rl_common.engine_factory(cfg, sft_cfg)
  assert factory.keywords["steps_per_block"] == 1
  model = tiny_models.tiny_qwen3(TOKENIZER.vocab_size, seed=5, num_layers=1)
  engine = factory(
      rollout_actor=model,
      tokenizer=tokenizer_adapter.TokenizerAdapter(TOKENIZER),
      rollout_config=ROLLOUT_CONFIG)
  output = engine.generate(PROMPTS, ROLLOUT_CONFIG)
  steps = np.asarray(output.commit_steps)
  committed = steps >= 0
  # Each step commits every masked slot of its row's active block.
  per_step = [np.sum(row[c] == s) for row, c in zip(steps, committed)
              for s in np.unique(row[c])]
  assert max(per_step) >= 3 and np.mean(per_step) > 2
  exact = engine.get_per_token_logps(
      output.left_padded_prompt_tokens, output.trace_tokens,
      output.commit_steps)
  assert np.all(np.isfinite(np.asarray(exact)))
