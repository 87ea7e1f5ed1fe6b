"""`tools/suite_profile.py`: the suite's time summary from its records."""

import json
import pathlib

import pytest


def _record(test, wall, lowered, compiled=()):
  return {"id": test, "wall": wall, "cpu": wall / 2, "children_cpu": 1.0,
          "trace": 0.5, "lower": 0.25, "compile": 0.125,
          "lowerings": sum(n for _, n, _ in lowered), "lowered": lowered,
          "compiled": list(compiled)}


def test_summary_totals_slowest_tests_and_lowering_by_name(
    load_tool, tmp_path):
  rows = {
      "gw0": [_record("a::slow", 9.0, [["jit(run)", 2, 3.0]]),
              _record("a::fast", 1.0, [["jit(add)", 40, 0.5]])],
      "gw1": [_record("b::mid", 4.0, [["jit(run)", 1, 1.5],
                                      ["jit(add)", 10, 0.25]])],
  }
  for worker, records in rows.items():
    (tmp_path / f"{worker}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
  tool = load_tool("suite_profile")
  text = tool.summarize(tmp_path, slowest=2).splitlines()
  assert text[0].startswith("3 tests, 14 s of test time;")
  assert "launched processes' CPU 3 s" in text[0]
  assert "lowering 1 s" in text[0]  # 3 x 0.25 s, rounded
  # The two slowest tests, slowest first; then the names by lowering time.
  assert text[1].split() == ["9.0", "s", "a::slow"]
  assert text[2].split() == ["4.0", "s", "b::mid"]
  assert text[3] == "53 lowerings; the most lowering time, by function:"
  assert text[4].split() == ["4.5", "s", "x3", "jit(run)"]
  assert text[5].split() == ["0.8", "s", "x50", "jit(add)"]


def test_compilation_by_name_and_the_small_programs_share(
    load_tool, tmp_path):
  records = [
      _record("a::big", 9.0, [["jit(run)", 2, 3.0]], [["jit(run)", 4.0]]),
      _record("a::eager", 1.0, [["jit(add)", 40, 0.5]], [["jit(add)", 0.8]]),
      _record("b::eager", 1.0, [["jit(add)", 10, 0.25]], [["jit(add)", 0.2]]),
  ]
  (tmp_path / "gw0.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in records))
  tool = load_tool("suite_profile")
  text = tool.summarize(tmp_path, slowest=2).splitlines()
  start = text.index("the most XLA compilation time, by function:")
  assert text[start + 1].split() == ["4.0", "s", "x2", "jit(run)"]
  assert text[start + 2].split() == ["1.0", "s", "x50", "jit(add)"]
  # jit(add): 50 compilations in 1 s (20 ms each) is small; jit(run) not.
  assert text[start + 3] == ("small programs (< 40 ms a compile): 50"
                             " lowerings, 1 s lowering + 1 s compiling")


def test_an_empty_directory_is_an_error(load_tool, tmp_path):
  with pytest.raises(ValueError, match="no \\*.jsonl records"):
    load_tool("suite_profile").summarize(tmp_path)
