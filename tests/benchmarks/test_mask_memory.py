"""`benchmarks/mask_memory.py` at a tiny size: the orderings it documents."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import mask_memory  # noqa: E402  pylint: disable=g-import-not-at-top


def test_auto_keeps_both_masks_and_static_two_stream_materialises_none(
    capsys):
  rows = mask_memory.main(["--layers", "1", "--width", "32", "--heads", "4",
                           "--length", "256"])
  temp = {(r["stream"], r["mask_mode"]): r["temp_mib"] for r in rows}
  assert len(temp) == len(mask_memory.PROGRAMS)
  # The lax.cond's gradient holds both variants' activations.
  assert temp["single", "auto"] > max(temp["single", "static"],
                                      temp["single", "dynamic"])
  # The lazy two-stream mask is never materialised.
  assert temp["two_stream", "static"] < temp["two_stream", "dynamic"]
  assert "| two_stream | static |" in capsys.readouterr().out
