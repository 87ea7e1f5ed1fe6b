"""`rollout.transition.propose` against the distribution it documents.

`propose` computes the log-softmax without storing it (so that XLA fuses it
into the argmax); its proposals and log-probs must equal, to the bit, the
argmax and the gathered entry of `proposal_log_probs`, which the RL scorers
use to re-score trajectories.
"""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import transition


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.0, 0.7]),
       top_k=st.sampled_from([None, 3]), ties=st.booleans())
def test_propose_is_the_argmax_of_proposal_log_probs(seed, temperature, top_k,
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
  propose = jax.jit(lambda x, n: transition.propose(x, config, n))
  proposal, log_prob = propose(logits, noise)
  # Both jitted, as the driver and the scorers run them (XLA may rewrite the
  # temperature's division, the same way in both).
  log_probs = jax.jit(
      lambda x: transition.proposal_log_probs(x, config))(logits)
  scores = log_probs if noise is None else log_probs + noise
  np.testing.assert_array_equal(proposal, jnp.argmax(scores, axis=-1))
  want = jnp.take_along_axis(log_probs, proposal[..., None], axis=-1)[..., 0]
  np.testing.assert_array_equal(log_prob, want)
  assert not np.any(np.asarray(proposal) == vocab - 1)
