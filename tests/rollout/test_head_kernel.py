"""`rollout.head_kernel`: greedy proposals without the logits (interpret mode).

`greedy_head` gives `transition.propose`'s greedy proposal and log-prob of
the head's logits for either weight layout, any vocabulary (a tail that no
whole tile covers included), the mask token wherever it lies, and the first
index on ties; `generate(fused_head=True)` gives the default generation
(tied and untied heads, lockstep or not); bad input is refused.
"""

import dataclasses

from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from tunix.models.qwen3 import model as qwen3_lib

import generations
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import head as head_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rollout import cached
from tunix_blockdiff.rollout import head_kernel
from tunix_blockdiff.rollout import transition
from tunix_blockdiff.runs import model_setup

VOCAB, MASK = 48, 47


# Few shapes (each compiles the kernel anew); the values and the mask token
# vary freely.
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([3, 37]),
       vocab=st.sampled_from([128, 517]),
       vocab_major=st.booleans(), bf16=st.booleans(),
       mask=st.integers(0, 127))
def test_greedy_head_is_propose_on_the_head_s_logits(seed, rows, vocab,
                                                     vocab_major, bf16, mask):
  rng = np.random.default_rng(seed)
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  hidden = jnp.asarray(rng.normal(size=(rows, 16)), dtype)
  weight = jnp.asarray(rng.normal(size=(vocab, 16) if vocab_major
                                  else (16, vocab)), dtype)
  logits = hidden @ (weight.T if vocab_major else weight)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=mask)
  # One compiled program (op by op: one per op and drawn shape).
  want, want_lp = jax.jit(lambda x: transition.propose(x, config))(
      logits[None])
  got, got_lp = head_kernel.greedy_head(
      hidden, weight, vocab_major=vocab_major, mask_token_id=mask,
      vocab_tile=128)
  np.testing.assert_array_equal(got, want[0])
  assert got.dtype == jnp.int32 and got_lp.dtype == jnp.float32
  assert not np.any(np.asarray(got) == mask)
  np.testing.assert_allclose(got_lp, want_lp[0], atol=1e-5)


def test_ties_go_to_the_first_index_across_tiles():
  # Every logit equal but the mask token's: the answer is token 0, or 1
  # when 0 is the mask token; the log-prob is -log(V - 1).
  hidden = jnp.ones((3, 8), jnp.float32)
  weight = jnp.ones((300, 8), jnp.float32)
  for mask, first in ((0, 1), (5, 0)):
    got, lp = head_kernel.greedy_head(hidden, weight, vocab_major=True,
                                      mask_token_id=mask, vocab_tile=128)
    np.testing.assert_array_equal(got, [first] * 3)
    np.testing.assert_allclose(lp, -np.log(299.0), rtol=1e-6)
  # Equal maxima in the first tile and in the XLA tail: the first wins.
  weight = weight.at[290].set(2.0).at[10].set(2.0)
  got, _ = head_kernel.greedy_head(hidden, weight, vocab_major=True,
                                   mask_token_id=0, vocab_tile=128)
  np.testing.assert_array_equal(got, [10] * 3)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(vocab_tile=100), ValueError, "vocab_tile must be a positive"),
    (dict(vocab_tile=True), ValueError, "vocab_tile must be a positive"),
    (dict(hidden=jnp.ones((2, 3, 8))), ValueError, "must be 2-D"),
    (dict(hidden=jnp.ones((2, 7))), ValueError, r"hidden must be \[N, 8\]"),
])
def test_bad_kernel_input_is_refused(kwargs, error, message):
  args = dict(hidden=jnp.ones((2, 8)), weight=jnp.ones((256, 8)),
              vocab_major=True, mask_token_id=0)
  args.update(kwargs)
  with pytest.raises(error, match=message):
    head_kernel.greedy_head(**args)


def _tied_qwen3():
  config = dataclasses.replace(tiny_models.qwen3_config(VOCAB),
                               use_tied_embedding=True)
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(4))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("lockstep, schedule", [
    (False, dict(threshold=0.3)),
    (True, dict(steps_per_block=2)),
])
def test_generate_with_the_fused_head_gives_the_default_generation(
    tied, lockstep, schedule):
  model = _tied_qwen3() if tied else tiny_models.tiny_qwen3(
      VOCAB, random_mlp=True)
  rng = np.random.default_rng(5)
  lengths = np.array([9, 1, 6])
  prompts = rng.integers(0, MASK, size=(3, 9))
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK,
                                    **schedule)
  runs = [cached.generate(model, prompts, lengths, config, max_new_tokens=14,
                          lockstep=lockstep, fused_head=fused)
          for fused in (False, True)]
  generations.assert_same_generation(runs[1], runs[0])


def test_fused_head_is_refused_where_it_does_not_apply():
  model = tiny_models.tiny_qwen3(VOCAB)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK)
  args = (model, np.ones((1, 4), int), np.array([4]))
  with pytest.raises(TypeError, match="fused_head must be a bool"):
    cached.generate(*args, config, max_new_tokens=4, fused_head=1)
  with pytest.raises(ValueError, match="fused_head=True .* use_cache=True"):
    cached.generate(*args, config, max_new_tokens=4, fused_head=True,
                    use_cache=False)
  for other in (dict(temperature=0.7), dict(alignment="shifted")):
    with pytest.raises(ValueError, match="fused_head=True needs greedy"):
      cached.generate(*args, dataclasses.replace(config, **other),
                      max_new_tokens=4, fused_head=True,
                      rng=np.asarray([0, 1], np.uint32))


def test_a_lora_head_is_refused_not_dropped():
  base = tiny_models.tiny_qwen3(VOCAB)
  lora = model_setup.traced_lora(
      base, qwix.LoraProvider(module_path=".*lm_head", rank=2, alpha=4.0),
      seed=2)
  config = config_lib.DenoiseConfig(block_size=4, mask_token_id=MASK)
  with pytest.raises(ValueError, match="output head has LoRA weights"):
    cached.generate(lora, np.ones((1, 4), int), np.array([4]), config,
                    max_new_tokens=4, fused_head=True)
  # The plain heads: [D, V] untied, [V, D] tied.
  weight, vocab_major = head_lib.head_weight(head_lib.headless(base))
  assert weight.shape == (32, VOCAB) and not vocab_major
  weight, vocab_major = head_lib.head_weight(head_lib.headless(_tied_qwen3()))
  assert weight.shape == (VOCAB, 32) and vocab_major
