"""`benchmarks/profile_generation.py`: a traced call summarised per op.

On CPU the ops are the host's XLA thunks; the summary must account for the
traced call's op time once (no loop counted over its body) and rank it.
"""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import profile_generation  # noqa: E402  pylint: disable=g-import-not-at-top


def test_summarise_groups_by_name_and_ranks_by_time():
  ops = [dict(name="a", shape="", ns=1e6), dict(name="b", shape="", ns=3e6),
         dict(name="a", shape="", ns=2e6, hlo_category="x")]
  rows = profile_generation.summarise(ops)
  assert [(r["name"], r["count"]) for r in rows] == [("a", 2), ("b", 1)]
  assert rows[0]["ms"] == pytest.approx(3.0)
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)


def test_a_tiny_run_profiles_its_call(tmp_path, capsys):
  out = tmp_path / "ops.json"
  assert profile_generation.main(
      ["--batch", "2", "--new-tokens", "8", "--prompt-width", "8",
       "--cache-phases", "2", "--lockstep", "--ragged-cache",
       "--json", str(out),
       "--trace-dir", str(tmp_path / "trace")]) == 0
  report = json.loads(out.read_text())
  assert report["calls"] >= 2 and report["total_ms"] > 0
  assert report["ops"] and not any(
      op["name"].startswith("while") for op in report["ops"])
  printed = capsys.readouterr().out
  assert "| op | result |" in printed
  assert "cache_phases 2 lockstep ragged_cache:" in printed
  for bad in (["--batch", "0"], ["--cache-phases", "0"]):
    with pytest.raises(SystemExit):
      profile_generation.main(bad)
  assert "--cache-phases" in capsys.readouterr().err


def test_a_tpu_event_name_is_split_into_op_and_result():
  name, shape = profile_generation._split_hlo(  # pylint: disable=protected-access
      "%fusion.7 = bf16[128,8,3072]{2,1,0:T(8,128)(2,1)} fusion(bf16[1024]"
      "{0} %p), kind=kOutput")
  assert (name, shape) == ("fusion.7", "bf16[128,8,3072]")
  assert profile_generation._split_hlo("dot.3") == ("dot.3", "")  # pylint: disable=protected-access


def test_loops_conditionals_and_calls_are_not_counted_over_their_bodies():
  for name in ("while.4", "cond.20", "conditional.1", "call.2"):
    assert profile_generation.is_container(name), name
  for name in ("concatenate.3", "convert_element_type", "fusion.7",
               "custom-call.1"):
    assert not profile_generation.is_container(name), name
