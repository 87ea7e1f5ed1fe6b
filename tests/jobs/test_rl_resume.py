"""rl checkpoints: SIGKILL after a checkpoint, relaunch, same end as one run.

The killed run is a `tunix-blockdiff rl` process whose reward function
blocks once the rollouts after step 2 begin (and the checkpoint of step 2
is committed); it is killed there and the same command is run again on the
same output_dir. Its final policy and summary must equal an uninterrupted
run's. A resume that redid a step, restarted the prompts or redrew the
rollout noise would give other training rewards and other parameters.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.jobs import rl_checkpoints
from tunix_blockdiff.jobs import rl_common

# Rewards that differ between rollouts; with BD_BLOCK_AFTER=N set, the call
# after N completions waits for BD_BLOCK_DIR to hold the step-2 checkpoint
# and its job state, then blocks forever (the test kills the process).
REWARD = """
import os, pathlib, time
SEEN = [0]

def distinct(prompts, completions, **kwargs):
  after = os.environ.get("BD_BLOCK_AFTER")
  if after and SEEN[0] >= int(after):
    root = pathlib.Path(os.environ["BD_BLOCK_DIR"])
    while not ((root / "actor" / "2").is_dir()
               and (root / "job_state" / "2.json").is_file()):
      time.sleep(0.1)
    (root / "BLOCKED").write_text("")
    time.sleep(3600)
  SEEN[0] += len(completions)
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
# Completions rewarded before step 3's rollouts: the sampled and greedy
# held-out evaluations (4 + 4) and two steps of 2 x 4 rollouts.
BEFORE_STEP_3 = 8 + 2 * 8
TIMES = ("seconds", "rl_seconds", "warm_start_seconds")


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  directory = tmp_path / "reward"
  directory.mkdir()
  (directory / "bd_resume_reward.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(directory))
  return directory


def _summary(directory: pathlib.Path) -> dict:
  summary = json.loads((directory / "summary.json").read_text())
  for key in (*TIMES, "recipe"):
    summary.pop(key)
  return summary


def _params(directory: pathlib.Path) -> dict:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model, _ = rl_common.load_sft_policy(directory)
  return {
      str(path): np.asarray(value)
      for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def _kill_after_step_2(run, out: pathlib.Path, reward_dir: pathlib.Path):
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join([str(reward_dir), os.environ.get("PYTHONPATH", "")]),
      BD_BLOCK_AFTER=str(BEFORE_STEP_3),
      BD_BLOCK_DIR=str(out / "checkpoints"),
      JAX_PLATFORMS="cpu",
  )
  process = subprocess.Popen(
      [sys.executable, "-m", "tunix_blockdiff.cli", *run, f"output_dir={out}"],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
  )
  deadline = time.time() + 600
  while not (out / "checkpoints" / "BLOCKED").is_file():
    if process.poll() is not None:
      pytest.fail(f"rl exited early: {process.stderr.read().decode()[-3000:]}")
    if time.time() > deadline:
      process.kill()
      pytest.fail("rl did not reach the step-2 checkpoint in 600 s")
    time.sleep(0.2)
  process.send_signal(signal.SIGKILL)
  process.wait()
  process.stderr.close()


def test_killed_rl_resumes_exactly_and_its_policy_feeds_opd_and_generate(
    untrained_policy, reward_module, tmp_path, capsys
):
  run = [*RUN, f"init.checkpoint={untrained_policy}"]
  assert cli.main([*run, f"output_dir={tmp_path / 'one'}"]) == 0
  killed = tmp_path / "killed"
  _kill_after_step_2(run, killed, reward_module)
  assert rl_checkpoints.latest_step(killed) == 2
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  log = capsys.readouterr().err  # Progress lines, as sft prints them.
  assert "resuming from the checkpoint of step 2" in log
  assert "step 4/4" in log and "step 2/4" not in log

  one, two = _summary(tmp_path / "one"), _summary(killed)
  assert two["train_step_rewards"] == pytest.approx(
      one["train_step_rewards"], abs=1e-6
  )
  for key, value in one.items():
    if isinstance(value, float):
      assert two[key] == pytest.approx(value, abs=1e-6), key
    else:
      assert two[key] == value, key
  want, got = _params(tmp_path / "one"), _params(killed)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
  # The final policy is a run directory the next stages load: opd on the rl
  # run, then generate and rl on the opd run.
  assert rl_checkpoints.policy_dir(killed) == killed / "policy"
  opd_run = tmp_path / "opd"
  assert cli.main([*OPD, f"student.checkpoint={killed}", f"output_dir={opd_run}"]) == 0
  assert (opd_run / "policy" / "recipe.yaml").is_file()
  assert cli.main(["generate", str(opd_run), "color=false", "max_new_tokens=4"]) == 0
  assert (opd_run / "policy" / "generate.json").is_file()
  model, _ = rl_common.load_sft_policy(opd_run)
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
