"""Arguments shared by the scripts that read a finished `convert_code` run.

`convert_speed.py` and `convert_agreement.py` take the run directory,
`--stages` and `--thresholds`, check them (and their own arguments) before
any compute, and read the run's prompt budget from its `summary.json`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Iterable, Sequence


def comma_floats(text: str) -> tuple[float, ...]:
  """`"0.5,0.7"` -> (0.5, 0.7): an argparse type."""
  return tuple(float(v) for v in text.split(",") if v)


def comma_ints(text: str) -> tuple[int, ...]:
  """`"32,128"` -> (32, 128): an argparse type."""
  return tuple(int(v) for v in text.split(",") if v)


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    stages_help: str,
    thresholds: tuple[float, ...],
) -> None:
  """`run`, `--stages` (comma-separated) and `--thresholds`."""
  parser.add_argument("run", help="a convert_code.py --out directory")
  parser.add_argument("--stages", required=True, help=stages_help)
  parser.add_argument("--thresholds", type=comma_floats, default=thresholds)


def checked_run(
    prog: str,
    args: argparse.Namespace,
    checks: Iterable[tuple[str, bool, str]] = (),
    needed: Sequence[str] = (),
) -> tuple[pathlib.Path, list[str]]:
  """(the run directory, the stage names); `SystemExit` on a broken rule.

  Args:
    prog: The script's name, leading every message.
    args: Parsed arguments of `add_run_arguments` (and the script's own).
    checks: The script's own `(flag, holds, rule)` checks.
    needed: Files or directories of the run besides `summary.json`,
      `sft_eval.jsonl`, `ar_peer` and the stages.
  """
  run = pathlib.Path(args.run).expanduser().resolve()
  stages = [s for s in args.stages.split(",") if s]
  thresholds_ok = bool(args.thresholds) and all(
      0 < t <= 1 for t in args.thresholds
  )
  for name, ok, rule in (
      ("--stages", bool(stages), "non-empty"),
      *checks,
      ("--thresholds", thresholds_ok, "values in (0, 1]"),
  ):
    if not ok:
      raise SystemExit(f"{prog}: {name} must be {rule}")
  paths = ["ar_peer", "sft_eval.jsonl", "summary.json", *needed, *stages]
  missing = [str(run / p) for p in paths if not (run / p).exists()]
  if missing:
    raise SystemExit(f"{prog}: {run} lacks {', '.join(missing)}")
  return run, stages


def prompt_tokens(run: pathlib.Path) -> int:
  """The run's prompt budget: the `Sampler`'s prompt width, less BOS."""
  summary = json.loads((run / "summary.json").read_text())
  return int(summary["sizes"]["prompt_tokens"])
