"""`benchmarks/sft_step.py` on a tiny model, so that it cannot rot.

The TPU figures come from `--model qwen3_0p6b --dtype bfloat16 --attention
splash`; here the Splash variant runs in Pallas interpret mode, one round.
"""

import argparse
import pathlib
import sys

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from tunix_blockdiff.attention import masks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import _sft_programs  # noqa: E402  pylint: disable=g-import-not-at-top
import _step_cost  # noqa: E402  pylint: disable=g-import-not-at-top
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


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    blocks=st.integers(1, 6), block=st.sampled_from([1, 2, 4, 8]),
    stream=st.sampled_from([None, "single", "clean_prefix", "two_stream"]))
def test_attended_pairs_counts_the_masks_own_pairs(blocks, block, stream):
  length = blocks * block
  positions = np.arange(length)
  if stream is None:
    mask = masks.block_causal_mask(positions, positions, 1)
  elif stream == "two_stream":
    mask = masks.two_stream_mask(positions, block)
  else:
    mask = masks.block_causal_mask(positions, positions, block)
  assert _step_cost.attended_pairs(stream, length, block) == int(
      np.asarray(mask).sum())


def test_model_flops_are_six_per_parameter_per_token_plus_attention():
  args = sft_step.argparse.Namespace(
      model="tiny", vocab=256, layers=1, width=64, heads=2, dtype="float32",
      tile=None, remat="none", batch=2, length=32, block=4)
  model = sft_step.make_model(args)
  config = model.config
  single = _step_cost.model_gflops(model, args, "single")
  two = _step_cost.model_gflops(model, args, "two_stream")
  attention = 12 * config.num_heads * config.head_dim * 2 * (
      _step_cost.attended_pairs("single", 32, 4))
  # The two-stream step runs twice the tokens and twice the pairs, but its
  # output head only on the L noised slots.
  head = 6 * config.vocab_size * config.embed_dim * 2 * 32 / 1e9
  assert two == pytest.approx(2 * single - head)
  assert single > attention / 1e9


def test_sequential_mode_prints_each_row_with_its_peak(capsys):
  assert sft_step.main([
      "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "128",
      "--length", "32", "--batch", "1", "--rounds", "1", "--block", "4",
      "--streams", "single", "--sequential"]) == 0
  out = capsys.readouterr().out
  assert "one at a time" in out and "peak GiB |" in out
  assert len([l for l in out.splitlines() if l.startswith("| ")]) == 3


def test_a_program_that_does_not_fit_gets_an_out_of_memory_row():
  args = sft_step.argparse.Namespace(sequential=True)
  row = sft_step._row(args, "block diffusion, single", {"oom": True}, None)
  assert row.startswith("| block diffusion, single | out of memory |")
  assert row.count("|") == 11


def test_micro_batches_split_the_batch_into_accumulated_calls(capsys):
  args = argparse.Namespace(batch=6, micro_batch=2)
  seen = []
  step = _sft_programs.accumulated(
      lambda b: seen.append(b["tokens"].tolist()) or len(seen), args)
  assert step({"tokens": np.arange(6)}) == 3  # the last call's output
  assert seen == [[0, 1], [2, 3], [4, 5]]
  assert _sft_programs.training_config(args).gradient_accumulation_steps == 3
  args.micro_batch = None
  assert _sft_programs.training_config(
      args).gradient_accumulation_steps is None
  assert sft_step.main([
      "--layers", "1", "--width", "64", "--heads", "2", "--vocab", "256",
      "--length", "64", "--batch", "4", "--micro-batch", "2", "--rounds",
      "1", "--streams", "two_stream"]) == 0
  out = capsys.readouterr().out
  assert "batch 4 x 64 tokens (2 a call)" in out
  assert len([line for line in out.splitlines()
              if line.startswith("| block diffusion, two_stream")]) == 1
  with pytest.raises(SystemExit):
    sft_step.main(["--batch", "4", "--micro-batch", "3"])
  assert "--micro-batch must be >= 1 and divide --batch 4" in (
      capsys.readouterr().err)
