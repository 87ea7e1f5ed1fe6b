"""`rl` and `opd` on 2 processes x 2 CPU devices (gloo) vs one process.

Rollouts, scores and teacher logits shard their prompts over `fsdp` (4) and
are gathered on every process; the training examples are global arrays. A
short run of each job under `tunix-blockdiff launch` must give the
single-process run's completions and metrics. The two-process rl run is
killed with SIGKILL after its step-1 checkpoint and relaunched: the resumed
run must still equal one uninterrupted process. (2 x 2 devices is the layout
on which OPD's held-out divergence, then eager per-op dispatch, waited on
gloo forever: every program a job runs over the mesh must be one jitted
program issued in the same order on every process.)
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import kill_resume
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.jobs import launch
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.jobs import rl_policy

TINY_MODEL = {
    "num_layers": 1,
    "embed_dim": 16,
    "hidden_dim": 32,
    "num_heads": 2,
    "head_dim": 8,
    "num_kv_heads": 1,
}
# A reward that differs between rollouts (an untrained policy's exact match
# is 0 everywhere, which would give GRPO no gradient to compare).
# With BD_BLOCK_AFTER=N set, the call after N completions waits for the
# step-1 checkpoint and its job state under BD_BLOCK_DIR, then blocks.
REWARD = """
import os, pathlib, time
SEEN = [0]

def distinct(prompts, completions, **kwargs):
  after = os.environ.get("BD_BLOCK_AFTER")
  if after and SEEN[0] >= int(after):
    root = pathlib.Path(os.environ["BD_BLOCK_DIR"])
    while not ((root / "actor" / "1").is_dir()
               and (root / "job_state" / "1.json").is_file()):
      time.sleep(0.1)
    (root / f"BLOCKED{os.getpid()}").write_text("")
    time.sleep(3600)
  SEEN[0] += len(completions)
  return [len(set(c)) / 4.0 for c in completions]
"""
# Completions rewarded before step 2: the held-out evaluation (6 sampled +
# 6 greedy) and step 1's 2 x 4 rollouts.
BEFORE_STEP_2 = 12 + 8
SHORT = [
    "eval.num_prompts=6",
    "eval.batch_size=6",
    "rollout.max_tokens_to_generate=4",
    "rollout.max_prompt_length=10",
    "mesh.fsdp=4",
]
RL = [
    "grpo.steps=2",
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "grpo.micro_batch_prompts=1",
    "eval.samples_per_prompt=1",
    "reward=bd_many_processes_reward:distinct",
    "grpo.checkpoint_every_n_steps=1",
]
OPD = [
    *[f"teacher.{k}={v}" for k, v in TINY_MODEL.items()],
    "teacher.steps=3",
    "teacher.warmup_steps=1",
    "teacher.batch_size=8",
    "teacher.num_train=32",
    "opd.steps=2",
    "opd.prompts_per_step=2",
    "opd.micro_batch_prompts=1",
    "opd.divergence=jsd",
]


@pytest.fixture(name="policy")
def _policy(untrained_policy):
  """conftest's untrained tiny policy (an SFT output_dir)."""
  return untrained_policy


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  (tmp_path / "bd_many_processes_reward.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH",  # for launched processes
                     kill_resume.python_path_first(tmp_path))


@pytest.mark.parametrize(
    "job,section,args", [("rl", "init", RL), ("opd", "student", OPD)]
)
def test_two_processes_equal_one(
    job, section, args, policy, reward_module, tmp_path, capsys
):
  del reward_module
  run = [job, f"{section}.checkpoint={policy}", *SHORT, *args]
  assert jax.device_count() == 8
  assert cli.main([*run, f"output_dir={tmp_path / 'one'}"]) == 0
  two = tmp_path / "two"
  if job == "rl":
    _kill_two_processes_after_step_1(run, two)
    assert rl_checkpoints.latest_step(two) == 1
  code = launch.launch(
      [*run, f"output_dir={two}"],
      processes=2,
      devices_per_process=2,
  )
  log = capsys.readouterr().out
  assert code == 0, log[-3000:]
  one = kill_resume.summary(tmp_path / "one")
  two = kill_resume.summary(tmp_path / "two")
  kill_resume.assert_same_summary(two, one)
  # The same greedy completions (tokens), and training moved the policy.
  assert len(one["greedy_samples_end"]) == 6
  assert one["optimizer_steps"] == 2
  # Outputs from process 0 only.
  assert "[p0] wrote" in log and "[p1] wrote" not in log
  assert (tmp_path / "two" / f"{job}.png").is_file()


def _kill_two_processes_after_step_1(run, out):
  """Launches 2 processes, SIGKILLs them (and the launcher) after step 1."""
  env = dict(
      os.environ,
      BD_BLOCK_AFTER=str(BEFORE_STEP_2),
      BD_BLOCK_DIR=str(out / "checkpoints"),
  )
  launcher = subprocess.Popen(
      [
          sys.executable, "-m", "tunix_blockdiff.cli", "launch",
          "--processes", "2", "--devices-per-process", "2", "--",
          *run, f"output_dir={out}",
      ],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )
  deadline = time.time() + 600
  while len(list((out / "checkpoints").glob("BLOCKED*"))) < 2:
    assert launcher.poll() is None, "rl exited before the step-1 checkpoint"
    assert time.time() < deadline, "no step-1 checkpoint in 600 s"
    time.sleep(0.2)
  for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
      cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
      continue
    if f"output_dir={out}".encode() in cmdline:
      os.kill(int(pid), signal.SIGKILL)
  launcher.wait()


def test_rl_mesh_rules():
  assert dict(rl_common.rl_mesh(None).shape) == {"fsdp": 1, "sp": 1, "tp": 1}
  assert rl_common.rl_mesh({"fsdp": 4, "tp": 2}).devices.size == 8
  with pytest.raises(Exception, match="context parallelism"):
    rl_common.rl_mesh({"fsdp": 2, "sp": 4})
  with pytest.raises(Exception, match="16 devices"):
    rl_common.rl_mesh({"fsdp": 16})


def test_a_model_that_does_not_divide_over_tp_is_refused(policy):
  mesh = rl_common.rl_mesh({"fsdp": 4, "tp": 2})
  with pytest.raises(ValueError, match=r"k_proj.*mesh.tp=2.*not a multiple"):
    rl_policy.load_sft_policy(policy, mesh)  # 1 KV head over tp=2
