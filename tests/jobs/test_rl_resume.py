"""rl checkpoints: SIGKILL during each kind of write, relaunch, same end.

One run is SIGKILLed four times, each time in the middle of a write: the
job state of step 2 (half written), the policy and optimizer checkpoint of
step 4 (written by Orbax, not committed), the final policy, the summary.
Each relaunch resumes from the newest checkpoint whose job state is
complete, and the last one ends as an uninterrupted run. A relaunch of the
finished run is a no-op, and one whose summary is missing rewrites the
same policy step.

The killed run is a `tunix-blockdiff rl` process stopped at each point by
a test-only patch (`kill_resume.BLOCKER`). Its final policy and summary
must equal an uninterrupted run's.
A resume that redid a step, restarted the prompts or redrew the rollout
noise would give other training rewards and other parameters.
"""

import functools

import kill_resume
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.jobs import rl_policy

# Rewards that differ between rollouts (an untrained policy's exact match is
# 0 everywhere, which would give GRPO no gradient to compare).
REWARD = """
def distinct(prompts, completions, **kwargs):
  return [len(set(c)) / 4.0 for c in completions]
"""
RUN = [
    "rl",
    "eval.num_prompts=4",
    "eval.batch_size=4",
    "eval.samples_per_prompt=1",
    "rollout.max_tokens_to_generate=4",
    "rollout.max_prompt_length=10",
    "grpo.steps=4",
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "grpo.micro_batch_prompts=1",
    "grpo.checkpoint_every_n_steps=2",
    "reward=bd_resume_reward:distinct",
]
OPD = [
    "opd",
    "teacher.num_layers=1",
    "teacher.embed_dim=16",
    "teacher.hidden_dim=32",
    "teacher.num_heads=2",
    "teacher.head_dim=8",
    "teacher.num_kv_heads=1",
    "teacher.steps=2",
    "teacher.warmup_steps=1",
    "teacher.batch_size=8",
    "teacher.num_train=16",
    "opd.steps=1",
    "opd.prompts_per_step=2",
    "opd.micro_batch_prompts=2",
    "eval.num_prompts=2",
    "eval.batch_size=2",
    "rollout.max_tokens_to_generate=4",
    "rollout.max_prompt_length=10",
]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  directory = tmp_path / "reward"
  directory.mkdir()
  (directory / "bd_resume_reward.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(directory))
  return directory


def _params(directory):
  return kill_resume.params(rl_policy.load_sft_policy(directory)[0])


def test_killed_rl_resumes_exactly_and_its_policy_feeds_opd_and_generate(
    untrained_policy, reward_module, tmp_path, capsys
):
  run = [*RUN, f"init.checkpoint={untrained_policy}"]
  assert cli.main([*run, f"output_dir={tmp_path / 'one'}"]) == 0
  killed = tmp_path / "killed"
  checkpoints = killed / "checkpoints"
  kill = functools.partial(kill_resume.kill_at, argv=run, out=killed,
                           tmp_path=tmp_path, python_path=[reward_module])
  # Killed while the job state of step 2 was half written: Orbax's first
  # checkpoint (step 1) has its state too, and the run resumes from it.
  kill("state:2")
  assert rl_checkpoints.committed_steps(checkpoints / "actor") == [1]
  assert (checkpoints / "job_state" / "1.json").is_file()
  assert (checkpoints / "job_state" / "2.tmp").is_file()
  # Relaunched, killed while Orbax wrote the checkpoint of step 4 (written,
  # not committed): its job state is there, the checkpoint is not.
  kill("actor:4")
  assert rl_checkpoints.committed_steps(checkpoints / "actor") == [1, 2]
  assert rl_checkpoints.partial_writes(checkpoints / "actor")
  assert (checkpoints / "job_state" / "4.json").is_file()
  # Relaunched (from step 2), killed while writing the final policy, then
  # (from step 4) while writing the summary.
  kill("policy")
  assert rl_checkpoints.committed_steps(checkpoints / "actor") == [1, 2, 4]
  assert rl_checkpoints.partial_writes(killed / "policy" / "checkpoints")
  kill("summary")
  assert (killed / "summary.tmp").is_file()
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  log = capsys.readouterr().err  # Progress lines, as sft prints them.
  assert "resuming from the checkpoint of step 4" in log
  assert "step 3/4" not in log and "step 4/4" not in log
  assert not rl_checkpoints.partial_writes(killed / "policy" / "checkpoints")

  one = kill_resume.summary(tmp_path / "one")
  two = kill_resume.summary(killed)
  assert two["train_step_rewards"] == pytest.approx(
      one["train_step_rewards"], abs=1e-6
  )
  for key, value in one.items():
    if isinstance(value, float):
      assert two[key] == pytest.approx(value, abs=1e-6), key
    else:
      assert two[key] == value, key
  kill_resume.assert_same_params(_params(killed), _params(tmp_path / "one"))
  # Relaunching the finished run changes nothing; and with its summary gone
  # (killed after the policy was saved) it rewrites the same policy step.
  kill_resume.assert_relaunch_changes_nothing(run, killed, capsys)
  (killed / "summary.json").unlink()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  kill_resume.assert_same_summary(kill_resume.summary(killed), one, rtol=1e-6)
  kill_resume.assert_same_params(_params(killed), _params(tmp_path / "one"))
  # The final policy is a run directory the next stages load: opd on the rl
  # run, then generate and rl on the opd run.
  assert rl_checkpoints.policy_dir(killed) == killed / "policy"
  opd_run = tmp_path / "opd"
  assert cli.main([*OPD, f"student.checkpoint={killed}", f"output_dir={opd_run}"]) == 0
  assert (opd_run / "policy" / "recipe.yaml").is_file()
  assert cli.main(["generate", str(opd_run), "color=false", "max_new_tokens=4"]) == 0
  assert (opd_run / "policy" / "generate.json").is_file()
  model, _ = rl_policy.load_sft_policy(opd_run)
  assert model is not None


def test_checkpoint_settings_are_checked(untrained_policy, tmp_path):
  base = ["rl", f"init.checkpoint={untrained_policy}", f"output_dir={tmp_path}"]
  assert cli.main([*base, "grpo.checkpoint_every_n_steps=0"]) == 2
  assert cli.main([*base, "grpo.max_checkpoints=0"]) == 2
  assert (
      cli.main(
          [*base, "grpo.checkpoint_every_n_steps=2", "grpo.num_iterations=2"]
      )
      == 2
  )
