"""`benchmarks/head_kernel.py`: the kernel's rows against XLA's, checked."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import head_kernel as bench  # noqa: E402  pylint: disable=g-import-not-at-top


def test_a_tiny_run_times_and_checks_the_kernel(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert bench.main(["--rows", "24", "--vocab", "700", "--width", "64",
                     "--mask-id", "5", "--tiles", "128,256", "--repeats",
                     "1", "--json", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert [r["program"] for r in rows] == ["xla", "kernel t128",
                                          "kernel t256"]
  assert all(r["ms"] > 0 for r in rows)
  # Random float32-accumulated logits: no near-ties at this size.
  assert all(r["same"] == 1.0 and r["err"] < 1e-4 for r in rows)
  assert "| 24 | kernel t256 |" in capsys.readouterr().out


def test_a_mask_id_outside_the_vocabulary_is_refused(capsys):
  with pytest.raises(SystemExit):
    bench.main(["--vocab", "700", "--mask-id", "700"])
  assert "--mask-id must lie in [0, 700)" in capsys.readouterr().err
