"""Run outputs of the `tunix-blockdiff` jobs: output dir, summary, figures.

`prepare_output_dir` saves the resolved recipe, `write_summary` writes
`summary.json` and `plot_training_figure` the training figure. Re-exported
by `tunix_blockdiff.runs.common`.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Any, Mapping, Sequence

from flax import nnx
import jax
import numpy as np
import omegaconf
import orbax.checkpoint as ocp
from tunix.sft import hooks
from tunix.sft import metrics_logger as metrics_lib

from tunix_blockdiff import distributed
from tunix_blockdiff import trainer as trainer_lib

RECIPE_FILE = "recipe.yaml"
SUMMARY_FILE = "summary.json"


def prepare_output_dir(cfg: omegaconf.DictConfig) -> pathlib.Path:
  """Creates `cfg.output_dir` and saves the resolved recipe in it."""
  out = pathlib.Path(cfg.output_dir).expanduser().resolve()
  out.mkdir(parents=True, exist_ok=True)
  if distributed.is_main_process():
    omegaconf.OmegaConf.save(cfg, out / RECIPE_FILE)
  return out


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.generic, jax.Array, np.ndarray)):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def write_summary(
    out: pathlib.Path, summary: Mapping[str, Any]
) -> pathlib.Path:
  """Writes `summary.json` (NumPy/JAX scalars become numbers; process 0)."""
  path = pathlib.Path(out) / SUMMARY_FILE
  if not distributed.is_main_process():
    return path
  # Atomically: a run whose summary is whole is finished (`finished_summary`).
  tmp = path.with_suffix(".tmp")
  tmp.write_text(
      json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n"
  )
  tmp.replace(path)
  return path


REQUESTED_RECIPE_KEY = "requested_recipe"


def _requested(cfg: omegaconf.DictConfig) -> Any:
  return _jsonable(omegaconf.OmegaConf.to_container(cfg, resolve=True))


def mark_finished(cfg: omegaconf.DictConfig) -> None:
  """Adds the recipe as it was requested to the run's `summary.json`.

  Jobs resolve some keys while they run (a prompt width sized from the
  rows, say), so the summary's `recipe` is not what the command asked for;
  this key is, and `finished_summary` compares a relaunch against it.

  Args:
    cfg: The recipe as loaded, before the job ran (a copy of it).
  """
  path = pathlib.Path(cfg.output_dir).expanduser() / SUMMARY_FILE
  if not distributed.is_main_process() or not path.is_file():
    return
  summary = json.loads(path.read_text())
  summary[REQUESTED_RECIPE_KEY] = _requested(cfg)
  write_summary(path.parent, summary)


def finished_summary(cfg: omegaconf.DictConfig) -> dict[str, Any] | None:
  """The summary of a finished run of this very recipe in its output_dir.

  A job writes `summary.json` last, and `mark_finished` adds the recipe as
  requested; when both are there and that recipe equals `cfg`, relaunching
  the same command has nothing left to do (a changed recipe, e.g. more
  steps, resumes instead).

  Returns:
    The summary, or None (no finished run, or another recipe's).
  """
  path = pathlib.Path(cfg.output_dir).expanduser() / SUMMARY_FILE
  if not path.is_file():
    return None
  try:
    summary = json.loads(path.read_text())
  except json.JSONDecodeError:
    return None
  if (not isinstance(summary, dict)
      or summary.get(REQUESTED_RECIPE_KEY) != _requested(cfg)):
    return None
  return summary


class Stopwatch:
  """Wall-clock seconds since construction."""

  def __init__(self):
    self._start = time.perf_counter()

  def __call__(self) -> float:
    return time.perf_counter() - self._start


# Figures.


class ProgressLines(hooks.TrainingHooks):
  """Prints a progress line every `every` steps.

  Tunix's tqdm bar only draws on a terminal; in logs and CI this keeps the
  progress visible.
  """

  def __init__(self, every: int, max_steps: int):
    self.every, self.max_steps = max(1, every), max_steps
    self._clock = Stopwatch()

  def on_train_step_end(self, train_ctx, train_step, train_loss):
    if train_step % self.every == 0 or train_step == self.max_steps:
      print(
          f"step {train_step}/{self.max_steps}  loss {float(train_loss):.4f}"
          f"  {self._clock():.0f}s",
          file=sys.stderr,
          flush=True,
      )

  def on_train_start(self, train_ctx):
    pass

  def on_train_end(self, train_ctx):
    pass

  def on_train_step_start(self, train_ctx):
    pass

  def on_eval_step_start(self, train_ctx):
    pass

  def on_eval_step_end(self, train_ctx, eval_loss):
    pass


def show_progress(trainer, every: int, max_steps: int, out) -> None:
  """Progress lines in logs, and a note when a job resumes (process 0).

  Tunix's tqdm bar draws on a terminal; elsewhere (logs, CI) `trainer` gets
  a `ProgressLines` hook. A trainer that restored a checkpoint says so.

  Args:
    trainer: A Tunix trainer (sft, or an rl/opd cluster's actor trainer).
    every: Steps between progress lines.
    max_steps: The run's optimizer steps.
    out: The job's output_dir (named in the resume note).
  """
  if not distributed.is_main_process():
    return
  if not sys.stderr.isatty():
    trainer.with_training_hooks(ProgressLines(every, max_steps))
  if trainer.train_steps:
    print(
        f"resuming from the checkpoint of step {trainer.train_steps} in {out}",
        file=sys.stderr,
    )


def plot_training_figure(
    path: pathlib.Path,
    *,
    train_loss: Sequence[float],
    eval_steps: Sequence[int] = (),
    eval_loss: Sequence[float] = (),
    sweep: Sequence[Mapping[str, float]] = (),
    title: str = "",
) -> pathlib.Path:
  """Loss curves (left) and exact match vs tokens per step (right).

  Args:
    path: PNG file to write.
    train_loss: Train loss per optimizer step (steps 1..n).
    eval_steps: Steps at which eval loss was measured.
    eval_loss: Eval loss at those steps.
    sweep: Rows with `threshold`, `tokens_per_step`, `exact_match`.
    title: Figure title.

  Returns:
    `path` (written by process 0 only).
  """
  if not distributed.is_main_process():
    return pathlib.Path(path)
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_sweep) = plt.subplots(1, 2, figsize=(11, 4))
  steps = np.arange(1, len(train_loss) + 1)
  ax_loss.plot(steps, train_loss, lw=1, label="train (token mean)")
  if len(eval_steps):
    ax_loss.plot(eval_steps, eval_loss, "o-", label="eval (token mean)")
  ax_loss.set_xlabel("optimizer step")
  ax_loss.set_ylabel("block-diffusion loss")
  ax_loss.set_yscale("log")
  ax_loss.legend()
  ax_loss.grid(alpha=0.3)
  if sweep:
    tps = [row["tokens_per_step"] for row in sweep]
    em = [row["exact_match"] for row in sweep]
    ax_sweep.plot(tps, em, "o-")
    for i, row in enumerate(sweep):
      # Alternate label heights: neighbouring thresholds often overlap.
      ax_sweep.annotate(
          f"{row['threshold']:g}",
          (row["tokens_per_step"], row["exact_match"]),
          textcoords="offset points",
          xytext=(3, 6 if i % 2 else -12),
          fontsize=8,
      )
  ax_sweep.set_xlabel("committed tokens per model call")
  ax_sweep.set_ylabel("exact match")
  ax_sweep.set_ylim(-0.02, 1.02)
  ax_sweep.set_title("threshold sweep (labels: threshold)", fontsize=9)
  ax_sweep.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return pathlib.Path(path)



def make_training_config(
    cfg, out: pathlib.Path | None
) -> trainer_lib.TrainingConfig:
  """Tunix `TrainingConfig` from the recipe's `training` section."""
  training = cfg.training
  checkpoint_dir = None
  options = None
  logging_options = None
  if out is not None:
    checkpoint_dir = str(out / "checkpoints")
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        # Every n steps (and on preemption); not Orbax's default extra save
        # of the very first step.
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(
                int(training.checkpoint_every_n_steps)
            ),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        max_to_keep=int(training.max_checkpoints),
    )
    logging_options = metrics_lib.MetricsLoggerOptions(
        log_dir=str(out / "tensorboard"), flush_every_n_steps=50
    )
  return trainer_lib.TrainingConfig(
      eval_every_n_steps=int(training.eval_every_n_steps),
      max_steps=int(training.max_steps),
      gradient_accumulation_steps=int(training.gradient_accumulation_steps),
      checkpoint_root_directory=checkpoint_dir,
      checkpointing_options=options,
      metrics_logging_options=logging_options,
      pbar_description="block-diffusion SFT",
  )


def num_params(model, kind=nnx.Param) -> int:
  """Parameters of `model` of variable type `kind` (LoRA is an nnx.Param)."""
  return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, kind))))


def metric_history(trainer, name: str, mode: str) -> np.ndarray:
  """A trainer's logged history of metric `name` in `mode` (float64)."""
  logger = trainer.metrics_logger
  if not logger.metric_exists(trainer.metrics_prefix, name, mode):
    return np.zeros((0,))
  return np.asarray(
      logger.get_metric_history(trainer.metrics_prefix, name, mode), np.float64
  )


def eval_loss(trainer, batches) -> float:
  """Token-weighted eval loss over `batches` with the trainer's eval step."""
  _, eval_step = trainer.jit_train_and_eval_step()
  metrics = []
  for batch in batches:
    _, out = eval_step(batch)
    metrics.append(out.primary_loss)
  return trainer_lib.weighted_mean(metrics)

__all__ = [
    "RECIPE_FILE",
    "ProgressLines",
    "SUMMARY_FILE",
    "finished_summary",
    "mark_finished",
    "Stopwatch",
    "eval_loss",
    "make_training_config",
    "metric_history",
    "num_params",
    "plot_training_figure",
    "prepare_output_dir",
    "show_progress",
    "write_summary",
]
