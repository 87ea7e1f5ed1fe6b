"""`benchmarks/cache_kernel.py`: the kernel's row against XLA's, checked."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import cache_kernel as bench  # noqa: E402  pylint: disable=g-import-not-at-top


def test_a_tiny_run_times_and_checks_the_kernel(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert bench.main(["--batch", "8", "--layers", "1", "--kv-heads", "2",
                     "--q-heads", "4", "--head-dim", "8", "--slots", "32",
                     "--written", "20", "--max-shift", "4", "--chunks",
                     "48,16", "--repeats", "1", "--json", str(out)]) == 0
  rows = json.loads(out.read_text())
  # 48 does not divide the 32 slots: skipped.
  assert [r["program"] for r in rows] == ["xla", "kernel c16 r8"]
  assert all(r["ms"] > 0 for r in rows)
  assert all(r["err"] < 0.05 for r in rows[1:])  # bf16 probabilities
  assert rows[0]["floor_ms"] < rows[0]["all_slots_ms"]
  assert "| 32 | kernel c16 r8 |" in capsys.readouterr().out
