"""`benchmarks/threshold_sweep.py` on the tiny model, so that it cannot rot."""

import importlib.util
import json
import pathlib
import sys

import pytest

PATH = (pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
        / "threshold_sweep.py")


def _module():
  sys.path.insert(0, str(PATH.parent))
  spec = importlib.util.spec_from_file_location("threshold_sweep_bench", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_shared_sweep_compiles_once_and_the_other_at_each_threshold(
    tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert _module().main([
      "--batch", "2", "--prompt-width", "8", "--new-tokens", "8",
      "--thresholds", "0.02,0.9", "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "2 thresholds in" in printed
  assert "the shared program's sweep took" in printed
  one, shared = json.loads(out.read_text())
  assert (one["mode"], shared["mode"]) == ("one_per_threshold", "shared")
  for row in (one, shared):
    assert [r["threshold"] for r in row["per_threshold"]] == [0.02, 0.9]
  # A compilation (or a read of the persistent cache, which JAX times as
  # one) wherever a program is new; none for the shared sweep's second.
  assert all(r["compiles"] >= 1 for r in one["per_threshold"])
  assert shared["per_threshold"][0]["compiles"] >= 1
  assert shared["per_threshold"][1]["compiles"] == 0
  # The same generations either way: each threshold's steps agree.
  assert ([r["num_steps"] for r in one["per_threshold"]]
          == [r["num_steps"] for r in shared["per_threshold"]])


@pytest.mark.parametrize("flags, message", [
    (["--thresholds", "0.5,1.5"], "--thresholds: comma-separated values"),
    (["--thresholds", "x"], "--thresholds: comma-separated values"),
    (["--batch", "0"], "--batch: >= 1"),
])
def test_bad_flags_are_refused(flags, message, capsys):
  with pytest.raises(SystemExit):
    _module().main(flags)
  assert message in capsys.readouterr().err
