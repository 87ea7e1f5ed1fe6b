"""`benchmarks/stage_compile.py` on the tiny model, so that it cannot rot."""

import importlib.util
import pathlib
import re
import sys

import pytest

PATH = (pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
        / "stage_compile.py")


def _module():
  sys.path.insert(0, str(PATH.parent))
  spec = importlib.util.spec_from_file_location("stage_compile_bench", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_both_ways_compile_every_stage(capsys):
  bench = _module()
  assert bench.main(["--model", "tiny", "--batch", "2", "--new-tokens", "32",
                     "--prompt-width", "8", "--cache-phases", "2"]) == 0
  printed = capsys.readouterr().out
  # 8 prompt slots + 32 new in blocks of 4 fill two phases (the cache is
  # whole chunks of 16 slots): the prefill, two phases and the result.
  for mode in ("threads", "in turn"):
    assert re.search(rf"^{mode}: 4 programs lowered in [\d.]+ s, compiled in",
                     printed, re.M), printed
  assert "each init " in printed and ", phase 1 " in printed
  assert re.search(r"compiling in threads took [\d.]+x the time in turn",
                   printed), printed


@pytest.mark.parametrize("flag, value, message", [
    ("--cache-phases", "1", "--cache-phases: >= 2"),
    ("--layers", "-1", "--layers: >= 0"),
])
def test_bad_flags_are_refused(flag, value, message, capsys):
  with pytest.raises(SystemExit):
    _module().main([flag, value])
  assert message in capsys.readouterr().err
