"""`benchmarks/threshold_sweep.py` on the tiny model, so that it cannot rot."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import threshold_sweep as bench  # noqa: E402  pylint: disable=g-import-not-at-top


def test_the_shared_sweep_compiles_once_and_the_other_at_each_threshold(
    tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert bench.main([
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
    bench.main(flags)
  assert message in capsys.readouterr().err
