"""End-to-end test of `tunix-blockdiff opd` with a tiny recipe."""

import json

import omegaconf

from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import opd

# The AR teacher's size (the student is conftest's `untrained_policy`).
TINY_MODEL = {
    "num_layers": 1,
    "embed_dim": 16,
    "hidden_dim": 32,
    "num_heads": 2,
    "head_dim": 8,
    "num_kv_heads": 1,
}


def test_opd_command_writes_a_valid_summary_and_figure(
    untrained_policy, tmp_path
):
  student_dir = untrained_policy
  cfg = omegaconf.OmegaConf.load(common.recipe_path("opd_tiny.yaml"))
  cfg.output_dir = str(tmp_path / "run")
  recipe = tmp_path / "opd.yaml"
  omegaconf.OmegaConf.save(cfg, recipe)
  code = opd.main([
      str(recipe),
      f"student.checkpoint={student_dir}",
      *[f"teacher.{k}={v}" for k, v in TINY_MODEL.items()],
      "teacher.steps=3",
      "teacher.warmup_steps=1",
      "teacher.batch_size=8",
      "teacher.num_train=32",
      "opd.steps=2",
      "opd.prompts_per_step=2",
      "opd.micro_batch_prompts=1",
      "opd.divergence=jsd",
      "eval.num_prompts=4",
      "eval.batch_size=4",
      "rollout.max_tokens_to_generate=4",
      "rollout.max_prompt_length=10",
  ])
  assert code == 0
  out = tmp_path / "run"
  summary = json.loads((out / "summary.json").read_text())
  for key in (
      "student_exact_match_start",
      "student_exact_match_end",
      "teacher_exact_match",
  ):
    assert 0.0 <= summary[key] <= 1.0
  assert summary["divergence_start"] > 0 and summary["divergence_end"] > 0
  assert summary["divergence"] == "jsd" and summary["estimator"] == "full"
  assert summary["scoring_attention"] == "dense"  # auto off a TPU
  assert summary["steps"] == 2 and summary["optimizer_steps"] == 2
  assert summary["seconds"] > 0
  assert (out / "opd.png").stat().st_size > 0
