"""opd checkpoints: SIGKILL after a checkpoint, relaunch, same end as one run.

The killed run is a `tunix-blockdiff opd` process in which the checkpoint
manager, once step 2 is committed, blocks forever (`kill_resume.BLOCKER`,
a test-only patch loaded before the CLI); it is killed there and the same command is run again on
the same output_dir, killed again right after its last checkpoint, and
relaunched once more. The resumed run must restore the in-job AR teacher
(not train it again), the student, its optimizer, the rollout RNG and the
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
  kill_resume.kill_after_checkpoint(run, killed, 2, tmp_path)
  assert rl_checkpoints.latest_step(killed) == 2
  assert (killed / "checkpoints" / "teacher").is_dir()
  assert not (killed / "summary.json").exists()
  # Relaunched, and killed again right after its last checkpoint (step 4).
  kill_resume.clear_blocked(killed)
  kill_resume.kill_after_checkpoint(run, killed, 4, tmp_path)
  assert rl_checkpoints.latest_step(killed) == 4
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  assert "resuming from the checkpoint of step 4" in capsys.readouterr().err

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
