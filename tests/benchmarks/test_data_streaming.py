"""`benchmarks/data_streaming.py` end to end on a few rows, so it cannot rot."""

import importlib.util
import pathlib

PATH = (
    pathlib.Path(__file__).resolve().parents[2]
    / "benchmarks"
    / "data_streaming.py"
)


def test_data_streaming_reports_index_pass_and_memory(capsys):
  spec = importlib.util.spec_from_file_location("bench_data_streaming", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.main(["300"]) == 0
  out = capsys.readouterr().out
  assert "wrote 300 rows" in out
  assert "index: " in out and "validating pass: " in out
  assert "random access" in out
