"""`rollout.transition.propose` against the distribution it documents.

`propose` computes the log-softmax without storing it (so that XLA fuses it
into its reductions); its log-probs must equal, to the bit, the gathered
entry of `proposal_log_probs`, which the RL scorers use to re-score
trajectories, and its proposals the argmax of the logits (greedy) or of the
Gumbel-perturbed log-probs (sampling).
"""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import transition

# Jitted once per (config, shapes), as the driver runs them; examples that
# share a config reuse the compiled programs.
_propose = jax.jit(transition.propose, static_argnums=1)
_proposal_log_probs = jax.jit(transition.proposal_log_probs, static_argnums=1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.0, 0.7]),
       top_k=st.sampled_from([None, 3]), ties=st.booleans())
def test_propose_is_the_documented_argmax_scored_by_proposal_log_probs(seed, temperature, top_k,
                                                     ties):
  vocab = 11
  key = jax.random.key(seed)
  logits = 4 * jax.random.normal(key, (2, 5, vocab))
  if ties:  # coarse logits: many exact ties for the lowest-id rule
    logits = jnp.round(logits)
  config = config_lib.DenoiseConfig(
      mask_token_id=vocab - 1, block_size=4, temperature=temperature,
      top_k=top_k if temperature else None)
  noise = None
  if temperature:
    noise = jax.random.gumbel(jax.random.key(seed + 1), logits.shape)
  proposal, log_prob = _propose(logits, config, noise)
  # Both jitted, as the driver and the scorers run them (XLA may rewrite the
  # temperature's division, the same way in both).
  log_probs = _proposal_log_probs(logits, config)
  if noise is None:
    # Greedy: the argmax of the logits, the mask token's removed.
    np.testing.assert_array_equal(
        proposal, jnp.argmax(logits.at[..., vocab - 1].set(-jnp.inf), -1))
  else:
    np.testing.assert_array_equal(proposal,
                                  jnp.argmax(log_probs + noise, axis=-1))
  want = jnp.take_along_axis(log_probs, proposal[..., None], axis=-1)[..., 0]
  np.testing.assert_array_equal(log_prob, want)
  assert not np.any(np.asarray(proposal) == vocab - 1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), sub=st.sampled_from([1, 2, 4]),
       threshold=st.floats(0.05, 1.0))
def test_sub_blocks_commit_only_in_the_first_sub_block_with_masked_slots(
    seed, sub, threshold):
  rng = np.random.default_rng(seed)
  batch, width = 3, 8
  config = config_lib.DenoiseConfig(block_size=width, mask_token_id=0,
                                    threshold=threshold, sub_block_size=sub)
  eligible = rng.random((batch, width)) < 0.6
  confidence = rng.random((batch, width)).astype(np.float32)
  positions = np.broadcast_to(np.arange(width) + 2 * width, (batch, width))
  commit = np.asarray(transition.select_commits(
      jnp.asarray(confidence), jnp.asarray(eligible), jnp.asarray(positions),
      jnp.zeros((batch,), jnp.int32), config))
  for row in range(batch):
    if not eligible[row].any():
      assert not commit[row].any()
      continue
    first = (np.flatnonzero(eligible[row])[0]) // sub
    active = eligible[row] & (np.arange(width) // sub == first)
    # A subset of the active sub-block's eligible slots, never empty; the
    # threshold rule inside it.
    assert commit[row].any() and not (commit[row] & ~active).any()
    above = active & (confidence[row] > threshold)
    if above.any():
      np.testing.assert_array_equal(commit[row], above)
    else:
      best = np.flatnonzero(active)[np.argmax(confidence[row][active])]
      assert commit[row].sum() == 1 and commit[row][best]


def test_sub_blocks_must_divide_the_block_and_take_the_threshold_rule():
  import pytest  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match="sub_block_size .* must divide"):
    config_lib.DenoiseConfig(block_size=8, mask_token_id=0, sub_block_size=3)
  with pytest.raises(ValueError, match="steps_per_block to None"):
    config_lib.DenoiseConfig(block_size=8, mask_token_id=0, sub_block_size=4,
                             steps_per_block=2)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.0, 0.7]))
def test_propose_reads_bf16_logits_as_their_float32_values(seed, temperature):
  """The cached driver hands a bf16 model's logits over uncast."""
  vocab = 37
  logits = (4 * jax.random.normal(jax.random.key(seed), (2, 4, vocab))
            ).astype(jnp.bfloat16)
  config = config_lib.DenoiseConfig(mask_token_id=0, block_size=4,
                                    temperature=temperature)
  noise = None
  if temperature:
    noise = jax.random.gumbel(jax.random.key(seed + 1), logits.shape)
  got = _propose(logits, config, noise)
  want = _propose(logits.astype(jnp.float32), config, noise)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_unfiltered_propose_removes_the_mask_token_without_an_update():
  """An update of the mask token's entry makes XLA store the float32 logits.

  On the TPU that update wrote a float32 copy of a bf16 model's [B, W, V]
  logits for every pass to read; a select fuses into the passes instead.
  With a top-k filter the filtered logits are stored anyway (a sort).
  """
  logits = jnp.zeros((2, 4, 37), jnp.bfloat16)
  noise = jnp.zeros((2, 4, 37), jnp.float32)

  def program(**kwargs):
    config = config_lib.DenoiseConfig(mask_token_id=3, block_size=4, **kwargs)
    return jax.jit(lambda x, n: transition.propose(x, config, n)).lower(
        logits, noise).as_text()

  for kwargs in ({}, {"temperature": 0.7}):
    text = program(**kwargs)
    assert "scatter" not in text and "dynamic_update_slice" not in text
  assert "sort" in program(temperature=0.7, top_k=5)
