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
from typing import Any

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
  root = out / CHECKPOINT_SUBDIR / "actor"
  if not root.is_dir():
    return None
  manager = ocp.CheckpointManager(str(root))
  try:
    return manager.latest_step()
  finally:
    manager.close()


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


def load_resume(out: pathlib.Path) -> tuple[dict, dict] | None:
  """(start, state at the latest checkpoint) of a run to resume, or None.

  Raises:
    UsageError: a checkpoint without the job state that goes with it (the
      run cannot be continued exactly).
  """
  step = latest_step(out)
  if step is None:
    return None
  start = _state_dir(out) / START_FILE
  state = _state_dir(out) / f"{step}.json"
  for path in (start, state):
    if not path.is_file():
      raise errors.UsageError(
          f"{out / CHECKPOINT_SUBDIR} has checkpoint step {step} but no"
          f" {path.name}: it cannot be resumed exactly; remove"
          f" {out / CHECKPOINT_SUBDIR} to start over"
      )
  return json.loads(start.read_text()), json.loads(state.read_text())


class StatefulCheckpointManager:
  """Tunix's actor `CheckpointManager`, writing the job state before saves.

  Replaces `trainer.checkpoint_manager` (everything else is delegated):
  before Tunix saves optimizer step s (every n-th step, and the last), the
  job's state at s is written, so the file of step s exists whenever the
  checkpoint of step s does.
  """

  def __init__(self, inner, out: pathlib.Path, every: int, state_fn):
    self._inner = inner
    self._dir = _state_dir(out)
    self._every = every
    self._state_fn = state_fn

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def save(self, step: int, *args, force: bool = False, **kwargs) -> bool:
    if force or int(step) % self._every == 0:
      _write_json(
          self._dir / f"{int(step)}.json",
          {"step": int(step), **self._state_fn()},
      )
    return self._inner.save(step, *args, force=force, **kwargs)


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
        trainer.checkpoint_manager, out, every, state_fn
    )


def save_policy(out: pathlib.Path, model, policy_cfg, step: int) -> pathlib.Path:
  """Writes the trained policy to `out/policy/` (the SFT output_dir layout).

  Every process takes part in the Orbax save; process 0 writes the recipe,
  last, so a `policy/recipe.yaml` always has its checkpoint.
  """
  directory = out / POLICY_SUBDIR
  step = max(int(step), 1)
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
    "load_resume",
    "policy_dir",
    "save_policy",
    "start_evaluation",
    "save_start",
    "track_state",
    "training_config_kwargs",
]
