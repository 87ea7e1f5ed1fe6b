"""End-to-end test of `tunix-blockdiff rl` with a tiny recipe."""

import json
import sys
import textwrap

import omegaconf
import pytest

from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import rl

# A few SFT steps of a 1-layer model: the point is the plumbing (SFT warm
# start through the SFT job's API, RLCluster, GRPO, evaluation, outputs).
TINY_SFT = [
    "task.kwargs.min_digits=2",
    "task.kwargs.max_digits=3",
    "task.num_train=64",
    "task.num_eval=8",
    "data.seq_len=14",
    "data.batch_size=8",
    "model.num_layers=1",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.num_heads=2",
    "model.head_dim=8",
    "model.num_kv_heads=1",
    "diffusion.block_size=4",
    "training.max_steps=2",
    "training.warmup_steps=1",
    "training.eval_every_n_steps=1000",
    "training.checkpoint_every_n_steps=2",
    "eval.thresholds=[0.9]",
    "eval.batch_size=8",
]


def test_rl_command_writes_a_valid_summary_and_figure(tmp_path):
  cfg = omegaconf.OmegaConf.load(common.recipe_path("rl_tiny.yaml"))
  cfg.output_dir = str(tmp_path / "run")
  cfg.init.sft_overrides = TINY_SFT
  recipe = tmp_path / "rl.yaml"
  omegaconf.OmegaConf.save(cfg, recipe)
  code = rl.main([
      str(recipe),
      "grpo.steps=2",
      "grpo.prompts_per_step=2",
      "grpo.num_generations=2",
      "grpo.micro_batch_prompts=1",
      "eval.num_prompts=4",
      "eval.samples_per_prompt=1",
      "eval.batch_size=4",
      "rollout.max_tokens_to_generate=4",
      "rollout.max_prompt_length=10",
  ])
  assert code == 0
  out = tmp_path / "run"
  summary = json.loads((out / "summary.json").read_text())
  for key in (
      "reward_start",
      "reward_end",
      "greedy_exact_match_start",
      "greedy_exact_match_end",
  ):
    assert 0.0 <= summary[key] <= 1.0
  assert summary["steps"] == 2 and summary["optimizer_steps"] == 2
  assert summary["scoring_attention"] == "dense"  # auto off a TPU
  assert summary["seconds"] > 0 and summary["rollouts"] == 8
  # 8 rollouts of at most 4 tokens; per micro-batch a prefill and >= 1 step.
  assert 8 <= summary["rollout_tokens"] <= 32
  assert summary["rollout_model_calls"] >= 2 * 2
  assert summary["rollout_row_calls"] == 2 * summary["rollout_model_calls"]
  assert 0.0 <= summary["train_groups_with_signal"] <= 1.0
  assert len(summary["train_step_rewards"]) == 2
  assert summary["sft"]["train_steps"] == 2
  assert (out / "rl.png").stat().st_size > 0
  assert (out / "sft" / "checkpoints").is_dir()


USER_REWARD = textwrap.dedent("""
    CALLS = []

    def digits_in_place(prompts, completions, answer, **kwargs):
      CALLS.append({"answer": list(answer), **{k: list(v) if k != "mode" else v
                                               for k, v in kwargs.items()}})
      return [
          sum(x == y for x, y in zip(c, a)) / max(len(a), 1)
          for c, a in zip(completions, answer)
      ]
""")


def test_rl_with_user_reward_and_dataset_prompts(tmp_path, monkeypatch):
  (tmp_path / "user_reward_e2e.py").write_text(USER_REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  rows = [
      {"prompt": f"rev {n}>", "answer": str(n)[::-1], "level": len(str(n))}
      for n in (12, 345, 67, 890, 11, 234)
  ]
  rows += [{"prompt": "rev 1234567890>", "answer": "0", "level": 10}]  # Long.
  train = tmp_path / "prompts.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = omegaconf.OmegaConf.load(common.recipe_path("rl_tiny.yaml"))
  cfg.output_dir = str(tmp_path / "run")
  cfg.init.sft_overrides = TINY_SFT
  recipe = tmp_path / "rl.yaml"
  omegaconf.OmegaConf.save(cfg, recipe)
  code = rl.main([
      str(recipe),
      "reward=user_reward_e2e:digits_in_place",
      f"dataset.train={train}",
      "grpo.steps=2",
      "grpo.prompts_per_step=2",
      "grpo.num_generations=2",
      "grpo.micro_batch_prompts=1",
      "eval.num_prompts=2",
      "eval.samples_per_prompt=1",
      "eval.batch_size=4",
      "rollout.max_tokens_to_generate=4",
      "rollout.max_prompt_length=10",
  ])
  assert code == 0
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["reward_fn"] == "user_reward_e2e:digits_in_place"
  assert summary["prompts_source"] == str(train)
  assert summary["skipped_prompt_rows"] == 1
  assert len(summary["train_step_rewards"]) == 2
  calls = sys.modules["user_reward_e2e"].CALLS
  train_calls = [c for c in calls if c["mode"] == "train"]
  assert {c["mode"] for c in calls} == {"train", "eval"}
  # 2 steps x 2 prompts x 2 generations (Tunix calls per micro-batch).
  assert sum(len(c["answer"]) for c in train_calls) == 8
  by_answer = {r["answer"]: r["level"] for r in rows}
  for call in calls:  # Columns reach the reward, one value per completion.
    assert [by_answer[a] for a in call["answer"]] == call["level"]


@pytest.mark.parametrize(
    "override, match",
    [
        ("reward=no_such_module_xyz:fn", "not found"),
        ("reward=json:no_such_fn", "no attribute"),
        ("reward=json", "package.module:function"),
    ],
)
def test_rl_rejects_a_bad_reward_before_the_warm_start(
    tmp_path, override, match
):
  with pytest.raises(ValueError, match=match):
    rl.main([f"output_dir={tmp_path / 'run'}", override])
  assert not (tmp_path / "run" / "sft").exists()
