"""`benchmarks/sft_step.py` on a tiny model, so that it cannot rot.

The TPU figures come from `--model qwen3_0p6b --dtype bfloat16 --attention
splash`; here the Splash variant runs in Pallas interpret mode, one round.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import sft_step  # noqa: E402  pylint: disable=g-import-not-at-top


def test_the_splash_variant_reports_every_column(capsys):
  assert sft_step.main([
      "--layers", "1", "--width", "64", "--heads", "2", "--vocab", "256",
      "--length", "128", "--batch", "2", "--rounds", "1",
      "--attention", "splash", "--streams", "single,two_stream"]) == 0
  out = capsys.readouterr().out
  assert "attention splash (tile 128)" in out
  assert "| tokens/s | MFU |" in out
  rows = [line for line in out.splitlines() if line.startswith("| block")]
  assert len(rows) == 2


def test_bad_flags_are_refused():
  with pytest.raises(SystemExit):
    sft_step.main(["--streams", "three_stream"])
  with pytest.raises(SystemExit):
    sft_step.main(["--attention", "splash", "--length", "100"])
