"""DiffusionGemma rl's held-out figures: means, standard errors, the gain."""

import numpy as np
import pytest

from tunix_blockdiff.kinds.diffusion_gemma import evaluation as dg_evaluation


def test_reward_gain_reports_paired_standard_errors():
  got = dg_evaluation.reward_gain([0.0, 1.0, 0.0, 1.0],
                                  [1.0, 1.0, 0.0, 1.0])
  assert got["reward_start"] == 0.5 and got["reward_end"] == 0.75
  assert got["reward_gain"] == 0.25
  # Per-prompt differences [1, 0, 0, 0]: sample std 0.5, over sqrt(4).
  assert got["reward_gain_se"] == pytest.approx(0.25)
  assert got["reward_start_se"] == pytest.approx(np.std([0, 1, 0, 1], ddof=1)
                                                 / 2)
  assert np.isnan(dg_evaluation.reward_gain([1.0], [0.0])
                  ["reward_gain_se"])
