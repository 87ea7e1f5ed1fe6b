"""opd checkpoints: SIGKILL after a checkpoint, relaunch, same end as one run.

The killed run is a `tunix-blockdiff opd` process in which the checkpoint
manager, once step 2 is committed, blocks forever (a test-only patch loaded
before the CLI); it is killed there and the same command is run again on
the same output_dir. The resumed run must restore the in-job AR teacher
(not train it again), the student, its optimizer, the rollout RNG and the
divergence history, and end with an uninterrupted run's summary and
student.
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

BLOCKER = """
import pathlib, time
from tunix_blockdiff.jobs import rl_checkpoints

_save = rl_checkpoints.StatefulCheckpointManager.save

def save(self, step, *args, **kwargs):
  saved = _save(self, step, *args, **kwargs)
  if int(step) == 2:
    self._inner._checkpoint_manager.wait_until_finished()
    (self._dir.parent / "BLOCKED").write_text("")
    time.sleep(3600)
  return saved

rl_checkpoints.StatefulCheckpointManager.save = save
"""
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
TIMES = ("seconds", "opd_seconds", "teacher_seconds")


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


def _kill_after_step_2(run, out: pathlib.Path, tmp_path: pathlib.Path):
  (tmp_path / "bd_blocker.py").write_text(BLOCKER)
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(
          [str(tmp_path), os.environ.get("PYTHONPATH", "")]
      ),
      JAX_PLATFORMS="cpu",
  )
  code = (
      "import sys, bd_blocker; from tunix_blockdiff import cli;"
      " sys.exit(cli.main(sys.argv[1:]))"
  )
  process = subprocess.Popen(
      [sys.executable, "-c", code, *run, f"output_dir={out}"],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
  )
  deadline = time.time() + 600
  while not (out / "checkpoints" / "BLOCKED").is_file():
    if process.poll() is not None:
      pytest.fail(f"opd exited early: {process.stderr.read().decode()[-3000:]}")
    if time.time() > deadline:
      process.kill()
      pytest.fail("opd did not reach the step-2 checkpoint in 600 s")
    time.sleep(0.2)
  process.send_signal(signal.SIGKILL)
  process.wait()
  process.stderr.close()


def test_killed_opd_resumes_to_the_uninterrupted_result(
    untrained_policy, tmp_path
):
  run = [*RUN, f"student.checkpoint={untrained_policy}"]
  assert cli.main([*run, f"output_dir={tmp_path / 'one'}"]) == 0
  killed = tmp_path / "killed"
  _kill_after_step_2(run, killed, tmp_path)
  assert rl_checkpoints.latest_step(killed) == 2
  assert (killed / "checkpoints" / "teacher").is_dir()
  assert not (killed / "summary.json").exists()
  assert cli.main([*run, f"output_dir={killed}"]) == 0

  one, two = _summary(tmp_path / "one"), _summary(killed)
  assert len(one["train_divergence"]) == 4
  assert two["train_divergence"] == pytest.approx(
      one["train_divergence"], rel=1e-5
  )
  for key, value in one.items():
    if isinstance(value, float):
      assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    elif key != "train_divergence":
      assert two[key] == value, key
  want, got = _params(tmp_path / "one"), _params(killed)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
