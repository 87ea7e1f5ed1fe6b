"""`benchmarks/generation.py` on the tiny model, so that it cannot rot.

The TPU table comes from `--model qwen3_0p6b`; here every program and
column of one small batch runs on CPU, and the floor is checked against a
hand count.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

PATH = (pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
        / "generation.py")


def _module():
  spec = importlib.util.spec_from_file_location("generation_bench", PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look themselves up
  spec.loader.exec_module(module)
  return module


def test_every_program_runs_and_reports_its_columns(tmp_path, capsys):
  bench = _module()
  out = tmp_path / "rows.json"
  assert bench.main(["--model", "tiny", "--batch", "2", "--new-tokens", "8",
                     "--prompt-width", "8", "--repeats", "1",
                     "--raw-calls", "1", "--schedules", "b4s1,b4t0.9",
                     "--cache-phases", "1,2", "--one-program", "0,1",
                     "--json", str(out)]) == 0
  rows = json.loads(out.read_text())
  # One phase is one program already: no "one program" twin of it.
  assert [(r["program"], r["schedule"]) for r in rows] == [
      ("tunix Sampler", "greedy"), ("generate", "b4s1"),
      ("generate, 2 cache phases", "b4s1"),
      ("generate, 2 cache phases, one program", "b4s1"),
      ("generate", "b4t0.9"), ("generate, 2 cache phases", "b4t0.9"),
      ("generate, 2 cache phases, one program", "b4t0.9")]
  sampler, static, phased, whole = rows[:4]
  assert phased["calls"] == static["calls"] == whole["calls"]
  assert sampler["calls"] == 8 and sampler["speedup"] == 1.0
  # Block 4, one step per block: each call commits a block (the prompt's
  # partial block shares its first call with the completion).
  assert 2 <= static["calls"] <= 3
  assert static["tokens_per_call"] == pytest.approx(8 / static["calls"])
  for row in rows:
    assert row["seconds"] > 0 and row["floor_ms"] > 0
  assert static["raw_call_ms_w"] > 0 and static["raw_call_ms_2w"] > 0
  assert static["write_ms"] > 0
  assert "| 2 | generate | b4s1 |" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["0", "1,x"])
def test_bad_cache_phases_are_refused(flag, capsys):
  with pytest.raises(SystemExit):
    _module().main(["--model", "tiny", "--cache-phases", flag])
  assert "--cache-phases" in capsys.readouterr().err


def test_lockstep_and_kernel_rows_are_timed_and_bad_values_refused(
    tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert _module().main(["--model", "tiny", "--batch", "3", "--new-tokens",
                         "8", "--prompt-width", "8", "--repeats", "1",
                         "--raw-calls", "0", "--schedules", "b4t0.9",
                         "--lockstep", "1", "--ragged-cache", "0,1",
                         "--fused-head", "0,1",
                         "--json", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert [r["program"] for r in rows] == [
      "tunix Sampler", "generate, lockstep",
      "generate, lockstep, fused head",
      "generate, lockstep, ragged cache",
      "generate, lockstep, ragged cache, fused head"]
  assert rows[1]["calls"] >= 2 and rows[1]["seconds"] > 0
  # The fused head's rows say how many tokens match their plain twin's.
  assert "agree" not in rows[1] and rows[2]["agree"] == rows[4]["agree"] == 1
  for flag in ("--lockstep", "--ragged-cache", "--fused-head",
               "--one-program"):
    with pytest.raises(SystemExit):
      _module().main(["--model", "tiny", flag, "yes"])
    assert flag in capsys.readouterr().err
  with pytest.raises(SystemExit):
    _module().main(["--model", "tiny", "--one-program", "1"])
  assert "needs a --cache-phases value > 1" in capsys.readouterr().err


def test_the_floor_is_the_larger_of_bytes_and_flops():
  bench = _module()
  sizes = bench.Sizes(params=1000, embed_params=200, param_bytes=2000,
                      kv_bytes_per_token=10, layers=2, heads=2, head_dim=4)
  # Bytes: 2000 + 10 * 50 = 2500 at 1000 B/s = 2.5 s.
  assert sizes.call_floor(tokens=1, logit_tokens=1, kv_tokens=50, rows=1,
                          hbm=1000.0, peak=1e12) == pytest.approx(2.5)
  # FLOPs: 2 * 800 * 8 + 2 * 200 * 4 + 4 * 2 * 2 * 4 * (50 / 2) * 8
  # = 12800 + 1600 + 12800 = 27200 at 1000 FLOP/s.
  assert sizes.call_floor(tokens=8, logit_tokens=4, kv_tokens=50, rows=2,
                          hbm=1e12, peak=1000.0) == pytest.approx(27.2)
  with pytest.raises(SystemExit):
    bench.main(["--schedules", "b3s1"])
