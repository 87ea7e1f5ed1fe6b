"""Cached `generate` == cacheless for the families test_cached.py leaves out.

test_cached.py covers Qwen3 and Llama3 in depth; here Qwen2 (q/k/v biases)
and Gemma3 (sliding-window and global layers, query and embedding scaling,
tied head, no `init_cache`) run the same comparison, and Gemma3's window
limit of the cached driver is checked at its exact boundary.
"""

import functools

import jax
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import kv_cache

VOCAB, MASK = 64, 63
PROMPT_WIDTH, NEW_TOKENS, BLOCK = 7, 9, 4
# Logical rows T = ceil((7 + 9) / 4) * 4 = 16; the cached calls span T + W.
EXACT_WINDOW = 16 + BLOCK


@functools.lru_cache(maxsize=None)
def _model(family, window=EXACT_WINDOW, num_layers=6):
  if family == "gemma3":
    # 6 layers: five sliding-window layers and one global layer.
    return tiny_models.tiny_gemma3(
        VOCAB, sliding_window_size=window, num_layers=num_layers
    )
  return tiny_models.tiny_qwen2(VOCAB, num_layers=1)


CONFIGS = {
    "threshold": config_lib.DenoiseConfig(
        block_size=BLOCK, mask_token_id=MASK, threshold=0.1
    ),
    "static-shifted-sampled": config_lib.DenoiseConfig(
        block_size=BLOCK,
        mask_token_id=MASK,
        steps_per_block=2,
        alignment="shifted",
        temperature=1.0,
        top_k=8,
    ),
}


def _generate(model, config, use_cache, lengths=(7, 2, 4)):
  prompts = np.random.RandomState(0).randint(0, MASK, (len(lengths), 7))
  return cached.generate(
      model,
      prompts,
      np.array(lengths),
      config,
      max_new_tokens=NEW_TOKENS,
      rng=jax.random.key(1),
      use_cache=use_cache,
  )


@pytest.mark.parametrize(
    "family, config_name",
    [
        ("qwen2", "threshold"),
        ("gemma3", "static-shifted-sampled"),
    ],
)
def test_cached_equals_cacheless(family, config_name):
  model, config = _model(family), CONFIGS[config_name]
  fast = _generate(model, config, True)
  slow = _generate(model, config, False)
  for name in ("tokens", "commit_step", "trace_tokens", "trace_commit_step"):
    np.testing.assert_array_equal(
        getattr(fast, name), getattr(slow, name), err_msg=name
    )
  assert int(fast.num_steps) == int(slow.num_steps)
  np.testing.assert_allclose(fast.logprobs, slow.logprobs, atol=1e-4)
  assert np.all(np.asarray(fast.commit_step) >= 0)
  # Multi-step blocks: the comparison covers more than one call per block.
  assert int(fast.num_steps) > NEW_TOKENS // BLOCK + 1


def test_gemma3_window_shorter_than_the_cached_span_is_refused():
  config = CONFIGS["threshold"]
  with pytest.raises(
      ValueError, match=r"spans 20 slots.*sliding window \(19\)"
  ):
    _generate(_model("gemma3", EXACT_WINDOW - 1, 1), config, True)
  # The cacheless path applies the (physical = logical) window itself, and
  # the window really acts there: a 3-slot window changes the tokens.
  narrow = _model("gemma3", 3, 1)
  with pytest.raises(ValueError, match="sliding window"):
    _generate(narrow, config, True)
  narrow_tokens = _generate(narrow, config, False).tokens
  wide_tokens = _generate(_model("gemma3", 64, 1), config, False).tokens
  assert np.any(np.asarray(narrow_tokens) != np.asarray(wide_tokens))


def test_gemma3_one_slot_blocks_take_the_decode_window_path():
  """Block size 1: Tunix's Gemma3 builds its window from the mask instead."""
  config = config_lib.DenoiseConfig(block_size=1, mask_token_id=MASK)
  model = _model("gemma3", 16 + 1, 1)  # T = 16 rows plus one block
  fast = _generate(model, config, True)
  slow = _generate(model, config, False)
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  np.testing.assert_array_equal(fast.commit_step, slow.commit_step)
  with pytest.raises(ValueError, match="sliding window"):
    _generate(_model("gemma3", 16, 1), config, True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama3", "gemma3"])
def test_init_cache_layout(family):
  model = getattr(tiny_models, f"tiny_{family}")(VOCAB, num_layers=1)
  cache = kv_cache.init_cache(model, 3, 12)
  assert sorted(cache) == ["layer_0"]
  layer = cache["layer_0"]
  assert layer["k"].shape == layer["v"].shape == (3, 12, 2, 8)
  assert layer["end_index"].shape == (3,)
