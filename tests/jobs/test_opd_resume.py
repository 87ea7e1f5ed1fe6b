"""opd checkpoints: SIGKILL during a write, relaunch, same end as one run.

The killed run is a `tunix-blockdiff opd` process stopped by a test-only
patch (`kill_resume.BLOCKER`, loaded before the CLI) while Orbax writes the
in-job AR teacher's last checkpoint, then, relaunched, while it writes the
student's step-4 checkpoint; it is SIGKILLed at each and the same command is
run again on the same output_dir. The resumed run must restore the teacher
(and its loss history), the student, its optimizer, the rollout RNG and the
divergence history, and end with an uninterrupted run's summary and
student.
"""

import kill_resume
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.jobs import rl_policy

RUN = [
    "opd",
    "teacher.num_layers=1",
    "teacher.embed_dim=16",
    "teacher.hidden_dim=32",
    "teacher.num_heads=2",
    "teacher.head_dim=8",
    "teacher.num_kv_heads=1",
    "teacher.steps=3",
    "teacher.warmup_steps=1",
    "teacher.batch_size=8",
    "teacher.num_train=16",
    "opd.steps=4",
    "opd.prompts_per_step=2",
    "opd.micro_batch_prompts=1",
    "opd.checkpoint_every_n_steps=2",
    "eval.num_prompts=4",
    "eval.batch_size=4",
    "rollout.max_tokens_to_generate=4",
    "rollout.max_prompt_length=10",
]


def _params(directory):
  return kill_resume.params(rl_policy.load_sft_policy(directory)[0])


def test_killed_opd_resumes_to_the_uninterrupted_result(
    untrained_policy, tmp_path, capsys
):
  run = [*RUN, f"student.checkpoint={untrained_policy}"]
  assert cli.main([*run, f"output_dir={tmp_path / 'one'}"]) == 0
  killed = tmp_path / "killed"
  checkpoints = killed / "checkpoints"
  # Killed while Orbax wrote the in-job teacher's last checkpoint (step 3):
  # the relaunch restores its step-1 checkpoint and trains it to the end,
  # with the loss history of an uninterrupted teacher.
  kill_resume.kill_at("teacher:3", run, killed, tmp_path)
  assert rl_checkpoints.committed_steps(checkpoints / "teacher") == [1]
  assert rl_checkpoints.partial_writes(checkpoints / "teacher")
  # Relaunched, killed while the student's step-4 checkpoint was written.
  kill_resume.kill_at("actor:4", run, killed, tmp_path)
  assert rl_checkpoints.committed_steps(checkpoints / "actor")[-1] == 2
  assert rl_checkpoints.partial_writes(checkpoints / "actor")
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  assert "resuming from the checkpoint of step 2" in capsys.readouterr().err

  one = kill_resume.summary(tmp_path / "one")
  two = kill_resume.summary(killed)
  assert len(one["train_divergence"]) == 4
  assert two["train_divergence"] == pytest.approx(
      one["train_divergence"], rel=1e-5
  )
  for key, value in one.items():
    if isinstance(value, float):
      assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    elif key != "train_divergence":
      assert two[key] == value, key
  kill_resume.assert_same_params(_params(killed), _params(tmp_path / "one"))
  # Relaunching the finished run changes nothing; with its summary gone
  # (killed after the policy was saved) it rewrites the same policy step.
  kill_resume.assert_relaunch_changes_nothing(run, killed, capsys)
  (killed / "summary.json").unlink()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  kill_resume.assert_same_summary(kill_resume.summary(killed), two, rtol=1e-6)
  kill_resume.assert_same_params(_params(killed), _params(tmp_path / "one"))
