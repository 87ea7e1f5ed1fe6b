"""The default recipe still learns a task it has never seen (a guard).

`benchmarks/default_recipe.py` measures the default `sft` on held-out tasks
(`benchmarks/recipe_tasks.py`) at full length; here one of them runs for
150 steps through the README's command, and a loose exact-match bar fails
if the default recipe stops learning (as the drawn feed-forward layers made
it do: issue 39).
"""

import importlib.util
import json
import pathlib
import sys

from tunix_blockdiff import cli

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name):
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def test_tasks_are_written_with_eval_rows_held_out(tmp_path):
  tasks = _module("recipe_tasks")
  for name in tasks.TASKS:
    train, evals = tasks.write_task(name, tmp_path, num_train=200,
                                    num_eval=20, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    held = [json.loads(line) for line in evals.read_text().splitlines()]
    assert len(rows) == 200 and len(held) == 20
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in rows}
    for row in rows + held:
      assert 5 <= len(row["completion"]) <= 11, (name, row)
      # Prompt (+ BOS) and completion (+ EOS) fit the recipe's 32 slots.
      assert len(row["prompt"]) + len(row["completion"]) + 2 <= 32
  sample = json.loads(
      (tmp_path / "increment" / "eval.jsonl").read_text().splitlines()[0])
  assert int(sample["completion"]) == int(sample["prompt"][4:-1]) + 1


def test_the_default_recipe_learns_a_task_it_has_never_seen(tmp_path):
  tasks = _module("recipe_tasks")
  train, evals = tasks.write_task("shift", tmp_path, num_train=8000,
                                  num_eval=64, seed=0)
  out = tmp_path / "run"
  assert cli.main([
      "sft", f"dataset.train={train}", f"dataset.eval={evals}",
      "training.max_steps=150", "training.eval_every_n_steps=150",
      "training.checkpoint_every_n_steps=150", "eval.thresholds=[0.9]",
      f"output_dir={out}",
  ]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["train_steps"] == 150
  assert summary["eval_exact_match"] >= 0.5, summary["eval_exact_match"]
  assert summary["tokens_per_step"] >= 2.0, summary["tokens_per_step"]
