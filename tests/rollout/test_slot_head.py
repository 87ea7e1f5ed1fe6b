"""`rollout.slot_head`: the head and proposals on the eligible slots only.

Its proposals equal `transition.propose` on the whole window's logits at
every eligible slot (greedy and sampled, any eligibility pattern), the other
slots get token 0 and log-prob -inf, the head runs on one of the static
counts of slots (the fewest that hold every row's eligible ones), and a bad
mask is refused.
"""

import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.rollout import slot_head
from tunix_blockdiff.rollout import transition

VOCAB, DIM = 13, 6


# Jitted once per (config, shapes), as the driver runs them; hypothesis
# examples that share a config reuse the compiled programs. The head is
# `hidden @ weight`.
@functools.partial(jax.jit, static_argnums=2)
def _whole_window(hidden, weight, config, noise=None, carry=None):
  """`transition.propose` on every slot's logits (shifted: carry first)."""
  logits = hidden @ weight
  if carry is not None:
    logits = jnp.concatenate([carry[:, None], logits], axis=1)
  return transition.propose(logits, config, noise)


@functools.partial(jax.jit, static_argnums=3)
def _eligible_only(hidden, weight, eligible, config, noise=None, carry=None):
  return slot_head.propose_eligible(lambda h: h @ weight, hidden, eligible,
                                    config, noise, carry=carry)


@pytest.mark.parametrize("width, want", [(1, (1,)), (3, (1, 2, 3)),
                                         (4, (1, 2, 3, 4)),
                                         (16, (4, 8, 12, 16)),
                                         (6, (2, 3, 5, 6))])
def test_sizes_are_the_window_s_quarters_rounded_up(width, want):
  assert slot_head.sizes(width) == want


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.sampled_from([4, 8]),
       temperature=st.sampled_from([0.0, 0.8]), density=st.floats(0, 1))
def test_eligible_slots_get_the_whole_window_s_proposals(seed, width,
                                                          temperature,
                                                          density):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(3, width, DIM)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(DIM, VOCAB)), jnp.float32)
  eligible = jnp.asarray(rng.random((3, width)) < density)
  config = config_lib.DenoiseConfig(mask_token_id=VOCAB - 1, block_size=width,
                                    temperature=temperature)
  noise = None
  if temperature:
    noise = jax.random.gumbel(jax.random.key(seed), (3, width, VOCAB))
  want_p, want_lp = _whole_window(hidden, weight, config, noise)
  got_p, got_lp = _eligible_only(hidden, weight, eligible, config, noise)
  e = np.asarray(eligible)
  np.testing.assert_array_equal(np.asarray(got_p)[e], np.asarray(want_p)[e])
  np.testing.assert_allclose(np.asarray(got_lp)[e], np.asarray(want_lp)[e],
                             rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(got_p)[~e] == 0)
  assert np.all(np.asarray(got_lp)[~e] == -np.inf)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), width=st.sampled_from([1, 4, 8]),
       density=st.floats(0, 1))
def test_shifted_slots_read_the_previous_slot_s_logits_or_the_carry(
    seed, width, density):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(3, width - 1, DIM)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(DIM, VOCAB)), jnp.bfloat16)
  carry = jnp.asarray(rng.normal(size=(3, VOCAB)), jnp.float32)
  eligible = jnp.asarray(rng.random((3, width)) < density)
  config = config_lib.DenoiseConfig(mask_token_id=VOCAB - 1, block_size=width,
                                    alignment="shifted")
  # The cached loop's shifted logits: the carry, then slots 0..W-2's.
  want_p, want_lp = _whole_window(hidden, weight, config, carry=carry)
  got_p, got_lp = _eligible_only(hidden, weight, eligible, config,
                                 carry=carry)
  e = np.asarray(eligible)
  np.testing.assert_array_equal(np.asarray(got_p)[e], np.asarray(want_p)[e])
  np.testing.assert_array_equal(np.asarray(got_lp)[e], np.asarray(want_lp)[e])


def test_the_head_runs_on_the_fewest_static_slots_that_hold_every_row():
  counts = []
  head = lambda h: (counts.append(h.shape[1]),
                    jnp.zeros(h.shape[:2] + (VOCAB,)))[1]
  config = config_lib.DenoiseConfig(mask_token_id=VOCAB - 1, block_size=16)
  eligible = jnp.zeros((2, 16), bool).at[0, 3:8].set(True)  # 5 of 16
  jaxpr = jax.make_jaxpr(lambda h, e: slot_head.propose_eligible(
      head, h, e, config))(jnp.zeros((2, 16, DIM)), eligible)
  assert counts == [4, 8, 12, 16]  # one branch per static count
  conds = [q for q in jaxpr.jaxpr.eqns if q.primitive.name == "cond"]
  assert len(conds) == 1 and len(conds[0].params["branches"]) == 4
  # The branch taken: a head whose proposal is the number of slots it ran
  # on. 5 eligible slots (the most in any row) take the 8-slot branch; 4
  # take the 4-slot one, none the smallest.
  by_count = lambda h: jax.nn.one_hot(jnp.full(h.shape[:2], h.shape[1]),
                                      32) * 10.0
  wide = config_lib.DenoiseConfig(mask_token_id=31, block_size=16)
  run = jax.jit(lambda e: slot_head.propose_eligible(
      by_count, jnp.zeros((2, 16, DIM)), e, wide)[0])
  for eligible, want in [(eligible, 8), (eligible.at[0, 7].set(False), 4),
                         (eligible.at[1, :13].set(True), 16)]:
    proposal = np.asarray(run(eligible))
    e = np.asarray(eligible)
    assert np.all(proposal[e] == want), (want, proposal[e])
  assert np.all(np.asarray(run(jnp.zeros((2, 16), bool))) == 0)


def test_an_eligible_mask_of_the_wrong_shape_is_refused():
  config = config_lib.DenoiseConfig(mask_token_id=VOCAB - 1, block_size=4)
  with pytest.raises(ValueError, match=r"eligible must be \[2, 4\]"):
    slot_head.propose_eligible(lambda h: h, jnp.zeros((2, 4, DIM)),
                               jnp.ones((2, 3), bool), config)
