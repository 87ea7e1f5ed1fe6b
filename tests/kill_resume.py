"""Kill-and-resume helpers of the rl and opd job tests.

A job is launched in a subprocess with a test-only patch (`BLOCKER`,
imported before the CLI) that stops it at a chosen point (`BD_BLOCK_AT`):
after a checkpoint is committed, or in the middle of a write (an Orbax
checkpoint written but not committed, a job state or summary file half
written). There every process writes `BLOCKED<pid>` into `BD_BLOCK_MARKS`
and sleeps; the test SIGKILLs it and runs the same command again on the
same output_dir; the resumed run must end as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Sequence

from flax import nnx
import numpy as np
import pytest

BLOCKER = """
import os, pathlib, time
from orbax.checkpoint._src.path import atomicity
from tunix_blockdiff.runs import common, rl_checkpoints

POINT, _, STEP = os.environ["BD_BLOCK_AT"].partition(":")
MARKS = pathlib.Path(os.environ["BD_BLOCK_MARKS"])


def block():
  MARKS.mkdir(parents=True, exist_ok=True)
  (MARKS / f"BLOCKED{os.getpid()}").write_text("")
  time.sleep(3600)


_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def finalize(self, *args, **kwargs):
  # Every file of the checkpoint is written to its temporary directory;
  # Orbax has not renamed it to the step's directory yet: a kill now is a
  # kill during the write.
  final = pathlib.Path(str(self._final_path))
  where = {"actor": "actor", "teacher": "teacher",
           "policy": "policy"}.get(POINT)
  parent = final.parent.name if POINT != "policy" else final.parent.parent.name
  if where == parent and (not STEP or final.name == STEP):
    block()
  return await _finalize(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = finalize
_write_json = rl_checkpoints._write_json


def write_json(path, value):
  if POINT == "state" and path.name == f"{STEP}.json":
    # The earlier checkpoints' asynchronous commits finish first: the kill
    # is during this file's write only.
    actor = path.parent.parent / "actor"
    deadline = time.time() + 120
    while time.time() < deadline and any(
        ".orbax-checkpoint-tmp" in p.name for p in actor.glob("*")):
      time.sleep(0.1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text('{"step": ')  # half written
    block()
  return _write_json(path, value)


rl_checkpoints._write_json = write_json
_write_summary = common.write_summary


def write_summary(out, summary):
  if POINT == "summary":
    (pathlib.Path(out) / "summary.tmp").write_text('{"rewards": ')
    block()
  return _write_summary(out, summary)


common.write_summary = write_summary
_save = rl_checkpoints.StatefulCheckpointManager.save


def save(self, step, *args, **kwargs):
  saved = _save(self, step, *args, **kwargs)
  if POINT == "committed" and int(step) == int(STEP):
    self._inner._checkpoint_manager.wait_until_finished()
    block()
  return saved


rl_checkpoints.StatefulCheckpointManager.save = save
"""
_MAIN = (
    "import sys, bd_blocker; from tunix_blockdiff import cli;"
    " sys.exit(cli.main(sys.argv[1:]))"
)


def python_path_first(*directories) -> str:
  """PYTHONPATH for a launched process: `directories`, then the current one."""
  return os.pathsep.join(
      [*map(str, directories), *filter(None, [os.environ.get("PYTHONPATH")])])


def kill_at(
    point: str,
    argv: Sequence[str],
    out: pathlib.Path,
    tmp_path: pathlib.Path,
    python_path: Sequence[str] = (),
    timeout_s: float = 600,
) -> None:
  """Runs `tunix-blockdiff ARGV output_dir=OUT`, SIGKILLs it at `point`.

  `point` is where `BLOCKER` stops the run: `committed:S` (after the
  checkpoint of step S is committed), `actor:S`, `teacher:S` (Orbax has
  written that checkpoint but not committed it), `state:S` (the job state
  file of step S is half written), `policy` (the final policy, written but
  not committed) or `summary` (half written).
  """
  blocker_dir = tmp_path / "blocker"
  blocker_dir.mkdir(exist_ok=True)
  (blocker_dir / "bd_blocker.py").write_text(BLOCKER)
  marks = tmp_path / "marks"
  for mark in marks.glob("BLOCKED*"):
    mark.unlink()
  env = dict(
      os.environ,
      PYTHONPATH=python_path_first(blocker_dir, *python_path),
      BD_BLOCK_AT=point,
      BD_BLOCK_MARKS=str(marks),
      JAX_PLATFORMS="cpu",
  )
  process = subprocess.Popen(
      [sys.executable, "-c", _MAIN, *argv, f"output_dir={out}"],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
  )
  deadline = time.time() + timeout_s
  while not list(marks.glob("BLOCKED*")):
    if process.poll() is not None:
      pytest.fail(f"{argv[0]} exited before {point}:"
                  f" {process.stderr.read().decode()[-3000:]}")
    if time.time() > deadline:
      process.kill()
      pytest.fail(f"{argv[0]} did not reach {point} in {timeout_s:.0f} s")
    time.sleep(0.2)
  process.send_signal(signal.SIGKILL)
  process.wait()
  process.stderr.close()


def files(out: pathlib.Path) -> dict[str, tuple[int, int]]:
  """(size, mtime_ns) of every file under `out`, by relative path."""
  return {
      str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
      for p in sorted(out.rglob("*")) if p.is_file()
  }


def assert_relaunch_changes_nothing(argv: Sequence[str], out: pathlib.Path,
                                    capsys) -> None:
  """Relaunching a finished run: exit 0, says so, writes no file."""
  from tunix_blockdiff import cli  # pylint: disable=g-import-not-at-top

  before = files(out)
  capsys.readouterr()
  assert cli.main([*argv, f"output_dir={out}"]) == 0
  captured = capsys.readouterr()
  assert "already holds a finished" in captured.err
  assert "wrote" in captured.out
  assert files(out) == before


def summary(directory: pathlib.Path, drop: Sequence[str] = ()) -> dict:
  """`summary.json` without its wall-clock times, the recipe and `drop`."""
  values = json.loads((directory / "summary.json").read_text())
  for key in list(values):
    if key.endswith("seconds") or key.endswith("recipe") or key in drop:
      values.pop(key)
  return values


def assert_same_summary(got: dict, want: dict, rtol: float = 1e-5) -> None:
  """Equal keys; floats (and float lists) within rtol, the rest equal."""
  assert got.keys() == want.keys()
  for key, value in want.items():
    if isinstance(value, float) or (
        isinstance(value, list) and value and isinstance(value[0], float)
    ):
      assert got[key] == pytest.approx(value, rel=rtol, abs=1e-7), key
    else:
      assert got[key] == value, key


def params(model: nnx.Module) -> dict[str, np.ndarray]:
  """A model's parameters by path, as NumPy arrays."""
  return {
      str(path): np.asarray(value)
      for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def assert_same_params(got: dict, want: dict) -> None:
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
