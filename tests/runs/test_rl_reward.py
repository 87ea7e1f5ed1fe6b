"""User reward functions of the rl/opd jobs (`runs.rl_reward`)."""

import textwrap

import omegaconf
import pytest

from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.runs import rl_reward

REWARDS_MODULE = textwrap.dedent("""
    NOT_A_FUNCTION = 3

    def with_answer(prompts, completions, answer, mode, **kwargs):
      return [float(c == a) for c, a in zip(completions, answer)]

    def too_narrow(prompts, completions):
      return [0.0] * len(prompts)

    class Scorer:
      @staticmethod
      def score(prompts, completions, **kwargs):
        return [1.0] * len(prompts)
""")


@pytest.fixture(name="rewards_module")
def _rewards_module(tmp_path, monkeypatch):
  (tmp_path / "user_rewards_rl_data.py").write_text(REWARDS_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  return "user_rewards_rl_data"


def test_load_reward_fn_returns_the_named_function(rewards_module):
  fn = rl_reward.load_reward_fn(f"{rewards_module}:with_answer", ["answer"])
  assert fn(prompts=["p"], completions=["a"], answer=["a"], mode="train") == [
      1.0
  ]
  scorer = rl_reward.load_reward_fn(f"{rewards_module}:Scorer.score", ["tag"])
  assert scorer(prompts=["p", "q"], completions=["", ""]) == [1.0, 1.0]


@pytest.mark.parametrize(
    "spec, error, match",
    [
        ("no_colon", ValueError, "package.module:function"),
        ("a:b:c", ValueError, "package.module:function"),
        ("", ValueError, "package.module:function"),
        ("no_such_pkg_xyz.rewards:fn", ValueError, "not found"),
        ("{m}:missing", ValueError, "no attribute 'missing'"),
        ("{m}:NOT_A_FUNCTION", ValueError, "not a function"),
        ("{m}:too_narrow", ValueError, "cannot take Tunix's reward call"),
    ],
)
def test_load_reward_fn_rejects_bad_specs(rewards_module, spec, error, match):
  with pytest.raises(error, match=match):
    rl_reward.load_reward_fn(spec.format(m=rewards_module), ["answer"])


def test_recipe_reward_defaults_to_exact_match_and_needs_answers():
  prompts = rl_data.PromptSet(
      train=[{"prompt": "p"}],
      held_out=[{"prompt": "p"}],
      source="x",
      columns=(),
  )
  cfg = omegaconf.OmegaConf.create({"reward": None})
  with pytest.raises(ValueError, match="needs an answer column"):
    rl_reward.recipe_reward(cfg, prompts)
  exact = rl_reward.exact_match_reward()
  assert exact(prompts=["a", "b"], completions=["12", "3"], answer=[12, 4]) == [
      1.0,
      0.0,
  ]
