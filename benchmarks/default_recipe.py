"""The default `sft` recipe on held-out tasks, as a user's first run.

For every task of `recipe_tasks.py` it writes the task's jsonl files and
runs exactly the README's command on them,

    tunix-blockdiff sft dataset.train=train.jsonl dataset.eval=eval.jsonl

(plus `output_dir` and any extra `key=value` overrides given here), one
task after another, and prints a table of exact match and tokens per model
call at the recipe's threshold (0.9), the train seconds and the whole job's
seconds. `summary.json` in `--out` holds the rows.

    python benchmarks/default_recipe.py --out runs/default_recipe
    python benchmarks/default_recipe.py --out /tmp/r training.learning_rate=0.002

Targets (issue 39): exact match >= 0.95 and >= 3 tokens per call on every
task, in about 2-3 minutes each on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import recipe_tasks  # pylint: disable=g-import-not-at-top,wrong-import-position


def run_task(
    name: str, out: pathlib.Path, overrides: list[str], *, num_train: int,
    num_eval: int, seed: int
) -> dict:
  """Writes the task's files, runs `sft` on them, returns its table row."""
  train, evals = recipe_tasks.write_task(
      name, out / "data", num_train=num_train, num_eval=num_eval, seed=seed
  )
  run_dir = out / name
  command = [
      sys.executable, "-m", "tunix_blockdiff.cli", "sft",
      f"dataset.train={train}", f"dataset.eval={evals}",
      f"output_dir={run_dir}", *overrides,
  ]
  start = time.perf_counter()
  subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
  wall = time.perf_counter() - start
  summary = json.loads((run_dir / "summary.json").read_text())
  return {
      "task": name,
      "exact_match": summary["eval_exact_match"],
      "tokens_per_call": summary["tokens_per_step"],
      "threshold": summary["threshold"],
      "final_train_loss": summary["final_train_loss"],
      "train_seconds": summary["train_seconds"],
      "job_seconds": summary["seconds"],
      "wall_seconds": wall,
      "sweep": summary["threshold_sweep"],
  }


def format_table(rows: list[dict]) -> str:
  lines = [
      "| task | exact match | tokens per call | train s | job s |",
      "|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['task']} | {r['exact_match']:.3f} |"
        f" {r['tokens_per_call']:.2f} | {r['train_seconds']:.0f} |"
        f" {r['job_seconds']:.0f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--tasks", default=",".join(recipe_tasks.TASKS))
  parser.add_argument("--train", type=int, default=40_000)
  parser.add_argument("--eval", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("overrides", nargs="*", help="key=value for sft")
  args = parser.parse_args(argv)
  rows = []
  for name in args.tasks.split(","):
    if name not in recipe_tasks.TASKS:
      parser.error(
          f"--tasks: {name!r} is not one of {sorted(recipe_tasks.TASKS)}"
      )
  for name in args.tasks.split(","):
    rows.append(
        run_task(
            name, args.out, args.overrides, num_train=args.train,
            num_eval=args.eval, seed=args.seed,
        )
    )
    print(
        f"{name}: exact match {rows[-1]['exact_match']:.3f} at"
        f" {rows[-1]['tokens_per_call']:.2f} tokens per call,"
        f" {rows[-1]['job_seconds']:.0f} s",
        flush=True,
    )
  (args.out / "summary.json").write_text(
      json.dumps({"overrides": args.overrides, "rows": rows}, indent=1)
  )
  print(format_table(rows))


if __name__ == "__main__":
  main()
