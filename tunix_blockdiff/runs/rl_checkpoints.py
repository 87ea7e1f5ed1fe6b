"""Checkpoints, exact resume and the final policy of the rl and opd jobs.

Every rl/opd job leaves a model, and a killed one continues where it was:

- **Periodic checkpoints** (`<section>.checkpoint_every_n_steps`, keeping
  `<section>.max_checkpoints`): Tunix's own actor checkpointing
  (`RLTrainingConfig.checkpoint_root_directory`; Orbax writes every
  process's shards) saves the policy parameters (LoRA or full), the
  optimizer state and the step under `output_dir/checkpoints/actor/`.
- **The job's side of the state**, beside each checkpoint in
  `output_dir/checkpoints/job_state/<step>.json` (process 0 writes it,
  atomically, before Orbax commits that step): the rollout engine's call
  counter (its whole RNG state: call i samples with `fold_in(key, i)`), the
  training rewards and rollout cost so far, and the held-out evaluation
  before training (`start.json`). Tunix's learner restores the step and
  fast-forwards the prompt iterator; the job restores the rest, so a run
  killed after a checkpoint ends as an uninterrupted one would.
- **The final policy** in `output_dir/policy/`: the SFT output_dir layout
  (`recipe.yaml` of the policy's model + `checkpoints/<step>/`), which
  `policy_dir` resolves, so `generate RUN`, `rl init.checkpoint=RUN` and
  `opd student.checkpoint=RUN` take an rl/opd run as they take an SFT run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
from typing import Any

import jax
import omegaconf
import orbax.checkpoint as ocp
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common

POLICY_SUBDIR = "policy"
CHECKPOINT_SUBDIR = "checkpoints"
STATE_SUBDIR = "job_state"
START_FILE = "start.json"


def policy_dir(path: str | os.PathLike) -> pathlib.Path:
  """The directory holding a run's policy (`recipe.yaml` + `checkpoints/`).

  An SFT output_dir is its own policy directory; an rl/opd output_dir holds
  its final policy in `policy/`.
  """
  path = pathlib.Path(path).expanduser()
  nested = path / POLICY_SUBDIR
  if (nested / common.RECIPE_FILE).is_file():
    return nested
  return path


def checkpoint_every(algo_cfg, section: str, num_iterations: int = 1):
  """(every n steps or None, max_checkpoints) of an rl/opd recipe section.

  Raises:
    UsageError: n < 1, max_checkpoints < 1, or checkpoints with more than
      one policy update per rollout batch (Tunix's resume fast-forwards its
      prompt iterator by optimizer steps, which would skip prompts).
  """
  every = algo_cfg.get("checkpoint_every_n_steps")
  keep = int(algo_cfg.get("max_checkpoints", 3))
  if keep < 1:
    raise errors.UsageError(f"{section}.max_checkpoints must be >= 1, got {keep}")
  if every is None:
    return None, keep
  every = int(every)
  if every < 1:
    raise errors.UsageError(
        f"{section}.checkpoint_every_n_steps must be >= 1 or null, got {every}"
    )
  if num_iterations != 1:
    raise errors.UsageError(
        f"{section}.checkpoint_every_n_steps needs {section}.num_iterations=1"
        f" (got {num_iterations}): Tunix's resume skips num_iterations times"
        " too many prompts"
    )
  return every, keep


def training_config_kwargs(out: pathlib.Path, every, keep) -> dict[str, Any]:
  """`RLTrainingConfig` keyword arguments of the actor's checkpointing."""
  if every is None:
    return {}
  return {
      "checkpoint_root_directory": str(out / CHECKPOINT_SUBDIR),
      "checkpointing_options": ocp.CheckpointManagerOptions(
          save_interval_steps=every, max_to_keep=keep
      ),
  }


def _state_dir(out: pathlib.Path) -> pathlib.Path:
  return out / CHECKPOINT_SUBDIR / STATE_SUBDIR


def latest_step(out: pathlib.Path) -> int | None:
  """The newest committed actor checkpoint step under `out`, or None."""
  steps = committed_steps(out / CHECKPOINT_SUBDIR / "actor")
  return steps[-1] if steps else None


def _write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
  """Process 0 writes `value` to `path` atomically (tmp file + rename)."""
  if not distributed.is_main_process():
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(value, sort_keys=True))
  os.replace(tmp, path)


def save_start(out: pathlib.Path, value: dict[str, Any]) -> None:
  """The held-out evaluation before training (and the rollout calls after)."""
  _write_json(_state_dir(out) / START_FILE, value)


def start_evaluation(out: pathlib.Path, resume, every: int | None, rollout,
                     evaluate, **extra):
  """The held-out evaluation before training, run once per job.

  Resuming (`resume` from `load_resume`), it is read back from `start.json`
  and the rollout engine's call counter is set back to its value after it.
  Otherwise `evaluate()` runs and, with checkpoints (`every`), is saved with
  that call count and the JSON values in `extra`.
  """
  if resume:
    rollout.calls = int(resume[1]["rollout_calls"])
    return resume[0]["eval"]
  start = evaluate()
  if every:
    save_start(out, {"eval": start, "rollout_calls": rollout.calls, **extra})
  return start


def _remove(path: pathlib.Path) -> None:
  if path.is_dir():
    shutil.rmtree(path, ignore_errors=True)
  else:
    path.unlink(missing_ok=True)


def _sync(name: str) -> None:
  """Every process waits here (several processes), after process 0's work."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    multihost_utils.sync_global_devices(name)


def partial_writes(directory: pathlib.Path) -> list[pathlib.Path]:
  """What a kill during a write leaves in `directory`: Orbax's uncommitted
  `<step>.orbax-checkpoint-tmp*` directories and our `*.tmp` files."""
  if not directory.is_dir():
    return []
  return sorted(p for p in directory.iterdir()
                if ".orbax-checkpoint-tmp" in p.name or p.suffix == ".tmp")


def committed_steps(directory: pathlib.Path) -> list[int]:
  """The committed Orbax checkpoint steps in `directory`, ascending."""
  if not directory.is_dir():
    return []
  manager = ocp.CheckpointManager(str(directory))
  try:
    return sorted(int(s) for s in manager.all_steps())
  finally:
    manager.close()


def reconcile(out: pathlib.Path) -> int | None:
  """Makes a killed run's checkpoints resumable; returns the step to resume.

  The newest actor checkpoint whose job state (`job_state/<step>.json` and
  `start.json`) is complete is kept. Uncommitted writes (a kill during the
  write of a checkpoint or a job state file) and actor checkpoints newer
  than it, which no job state pairs with, are removed, each said in one
  line: Tunix's learner then resumes from that step, and the job from its
  state. With no such pair every actor checkpoint goes and the run starts
  over. Process 0 removes; every process then reads the same directory.

  Returns:
    The step the run resumes from, or None (a fresh start).
  """
  root = out / CHECKPOINT_SUBDIR / "actor"
  state_dir = _state_dir(out)
  checkpoints = out / CHECKPOINT_SUBDIR
  # The actor's, the job state's, an in-job teacher's and its losses'.
  removed = [p for d in (sorted(checkpoints.iterdir())
                         if checkpoints.is_dir() else ())
             if d.is_dir() for p in partial_writes(d)]
  steps = committed_steps(root)
  paired = [s for s in steps if (state_dir / f"{s}.json").is_file()]
  keep = max(paired) if paired and (state_dir / START_FILE).is_file() else None
  removed += [root / str(s) for s in steps if keep is None or s > keep]
  if removed and distributed.is_main_process():
    for path in removed:
      _remove(path)
      print(f"{out}: removed {path.relative_to(out)}, a checkpoint write the"
            " job state does not pair with (a kill during it); resuming from"
            f" {f'step {keep}' if keep is not None else 'the start'}",
            file=sys.stderr, flush=True)
  _sync("tunix_blockdiff_reconcile")
  return keep


def load_resume(out: pathlib.Path) -> tuple[dict, dict] | None:
  """(start, state at the step to resume) of a killed run, or None.

  Reconciles the checkpoints first (`reconcile`): a relaunch always
  resumes, from the newest complete pair of policy checkpoint and job
  state, whatever moment the previous run was killed at.
  """
  step = reconcile(out)
  if step is None:
    return None
  state_dir = _state_dir(out)
  return (json.loads((state_dir / START_FILE).read_text()),
          json.loads((state_dir / f"{step}.json").read_text()))


class StatefulCheckpointManager:
  """A Tunix `CheckpointManager` that writes a state file before each save.

  Replaces `trainer.checkpoint_manager` (everything else is delegated):
  whenever Tunix saves step s (Orbax's decision: every n-th step, the first
  one, the last one), `state_fn()` at s is first written to
  `state_dir/<s>.json` (atomically), so the file of step s exists whenever
  the checkpoint of step s does.
  """

  def __init__(self, inner, state_dir: pathlib.Path, state_fn):
    self._inner = inner
    self._dir = pathlib.Path(state_dir)
    self._state_fn = state_fn

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def _will_save(self, step: int) -> bool:
    manager = getattr(self._inner, "_checkpoint_manager", None)
    return manager is not None and bool(manager.should_save(step))

  def _write(self, step: int) -> None:
    _write_json(self._dir / f"{step}.json",
                {"step": step, **self._state_fn()})

  def save(self, step: int, *args, force: bool = False, **kwargs) -> bool:
    written = force or self._will_save(int(step))
    if written:
      self._write(int(step))
    saved = self._inner.save(step, *args, force=force, **kwargs)
    if saved and not written:
      # Orbax changed its mind between the two questions (an async save
      # finished in between): the state follows; a kill before it leaves
      # an unpaired checkpoint, which `reconcile` removes.
      self._write(int(step))
    return saved


def track_state(trainer, out: pathlib.Path, every: int | None, state_fn):
  """Makes `trainer` (the cluster's actor trainer) save the job state too.

  Args:
    trainer: `cluster.actor_trainer`.
    out: The job's output_dir.
    every: `checkpoint_every_n_steps` (None: no checkpoints, no-op).
    state_fn: `() -> dict` of JSON values, the job's state now.
  """
  if every is not None:
    trainer.checkpoint_manager = StatefulCheckpointManager(
        trainer.checkpoint_manager, _state_dir(out), state_fn
    )


def save_policy(out: pathlib.Path, model, policy_cfg, step: int) -> pathlib.Path:
  """Writes the trained policy to `out/policy/` (the SFT output_dir layout).

  Every process takes part in the Orbax save; process 0 writes the recipe,
  last, so a `policy/recipe.yaml` always has its checkpoint.
  """
  directory = out / POLICY_SUBDIR
  step = max(int(step), 1)
  # A kill during an earlier write of the policy left it uncommitted.
  if distributed.is_main_process():
    for path in partial_writes(directory / CHECKPOINT_SUBDIR):
      _remove(path)
  _sync("tunix_blockdiff_save_policy")
  # A relaunch that resumed at the last step (killed after that checkpoint)
  # trains nothing and saves the same step again: rewrite it.
  existing = ocp.CheckpointManager(str(directory / CHECKPOINT_SUBDIR))
  if step in existing.all_steps():
    existing.delete(step)
  existing.close()
  manager = checkpoint_lib.CheckpointManager(str(directory / CHECKPOINT_SUBDIR))
  manager.save(
      step,
      model,
      save_only_lora_params=common.lora_enabled(policy_cfg.get("lora")),
      force=True,
  )
  manager.close()
  if distributed.is_main_process():
    omegaconf.OmegaConf.save(policy_cfg, directory / common.RECIPE_FILE)
  return directory


def add_costs(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
  """Counter-wise sum of two rollout cost dicts."""
  return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in {*a, *b}}


__all__ = [
    "CHECKPOINT_SUBDIR",
    "POLICY_SUBDIR",
    "StatefulCheckpointManager",
    "add_costs",
    "checkpoint_every",
    "latest_step",
    "committed_steps",
    "load_resume",
    "partial_writes",
    "reconcile",
    "policy_dir",
    "save_policy",
    "start_evaluation",
    "save_start",
    "track_state",
    "training_config_kwargs",
]
