"""`rollout.cached_loop`'s lockstep mode: rows start their blocks together.

Greedy outputs equal the default loop's for schedules that put rows out of
phase (partial first blocks, thresholds, sub-blocks, EOS); the fused 2W
calls drop to about one per block round (counted at run time); sampling
stays a valid trace; and bad values are refused before any compute.
"""

import collections

import generations
import jax
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import cached_loop
from tunix_blockdiff.rollout import window_attention

VOCAB, MASK = 64, 63


def _counting_calls(monkeypatch):
  """Counts the driver's model calls by window width, as they run."""
  widths = collections.Counter()
  inner = window_attention.window_call

  def window_call(model, tokens, *args, **kwargs):
    width = tokens.shape[1]
    jax.debug.callback(lambda: widths.update([width]))
    return inner(model, tokens, *args, **kwargs)

  monkeypatch.setattr(cached_loop.window_attention, "window_call",
                      window_call)
  return widths


@pytest.mark.parametrize(
    "block, schedule",
    [
        (4, dict(steps_per_block=4)),  # partial blocks finish early
        (4, dict(threshold=0.2, alignment="shifted")),
        (8, dict(threshold=0.3, sub_block_size=4, eos_token_id=5)),
    ],
)
def test_lockstep_gives_the_default_greedy_generation(block, schedule,
                                                      monkeypatch):
  model = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  rng = np.random.default_rng(block)
  lengths = np.array([11, 1, 6, 9])
  prompts = rng.integers(0, MASK, size=(4, 11))
  config = config_lib.DenoiseConfig(block_size=block, mask_token_id=MASK,
                                    **schedule)
  runs, fused = [], []
  for lockstep in (False, True):
    widths = _counting_calls(monkeypatch)
    runs.append(cached.generate(model, prompts, lengths, config,
                                max_new_tokens=21, lockstep=lockstep))
    jax.effects_barrier()
    prefill_width = 11 // block * block  # the prompt's whole blocks
    fused.append(widths[2 * block] - (prefill_width == 2 * block))
    # Every step's call is counted, and the prefill's.
    assert sum(widths.values()) == int(runs[-1].num_steps) + 1
  generations.assert_same_generation(runs[1], runs[0], same_num_steps=False)
  default_steps, lockstep_steps = (int(r.num_steps) for r in runs)
  # Held steps are program steps that no row counts as its own.
  assert lockstep_steps >= default_steps
  # Lockstep: the first step, then one fused call per later block round.
  rounds = max(-(-(n % block + 21) // block) for n in lengths)
  assert fused[1] <= rounds < fused[0], fused


def test_lockstep_sampling_is_a_trace_of_each_rows_own_steps():
  """Each row commits at its own steps 0, 1, ... with none skipped."""
  model = tiny_models.tiny_qwen3(VOCAB, random_mlp=True)
  lengths = np.array([3, 8, 5])
  prompts = np.random.default_rng(0).integers(0, MASK, size=(3, 8))
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK,
                                    threshold=0.3, temperature=1.0)
  out = cached.generate(model, prompts, lengths, config, max_new_tokens=12,
                        rng=jax.random.key(1), lockstep=True)
  steps = np.asarray(out.trace_commit_step)
  for row in steps:
    assert set(row.tolist()) == set(range(row.max() + 1))
  assert int(out.num_steps) >= steps.max() + 1


def test_lockstep_is_refused_when_not_a_bool_or_without_the_cache():
  model = tiny_models.tiny_qwen3(VOCAB)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK)
  args = (model, np.ones((1, 4), int), np.array([4]), config)
  with pytest.raises(TypeError, match="lockstep must be a bool"):
    cached.generate(*args, max_new_tokens=4, lockstep=1)
  with pytest.raises(ValueError, match="lockstep=True .* use_cache=True"):
    cached.generate(*args, max_new_tokens=4, lockstep=True, use_cache=False)
