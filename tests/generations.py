"""Checks shared by the generation tests: two runs, the same generation."""

from __future__ import annotations

import numpy as np

# What two runs of one generation must agree on exactly.
FIELDS = ("tokens", "commit_step", "trace_tokens", "trace_commit_step")


def assert_same_generation(got, want, *, same_num_steps: bool = True,
                           logprob_atol: float = 1e-5) -> None:
  """`GenerationResult`s with the same tokens and commit steps.

  Their log-probs agree to `logprob_atol` (the programs may sum in another
  order); `num_steps` too unless `same_num_steps` is False (lockstep's held
  steps are program steps that no row counts).
  """
  for field in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                  np.asarray(getattr(want, field)),
                                  err_msg=field)
  if same_num_steps:
    assert int(got.num_steps) == int(want.num_steps)
  np.testing.assert_allclose(np.asarray(got.logprobs),
                             np.asarray(want.logprobs), atol=logprob_atol)
