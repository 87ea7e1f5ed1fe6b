"""End-to-end test of `tunix-blockdiff rl` with a tiny recipe."""

import json

import omegaconf

from tunix_blockdiff.jobs import common
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
  assert summary["seconds"] > 0 and summary["rollouts"] == 8
  assert len(summary["train_step_rewards"]) == 2
  assert summary["sft"]["train_steps"] == 2
  assert (out / "rl.png").stat().st_size > 0
  assert (out / "sft" / "checkpoints").is_dir()
