"""`tools/generation_case.py`: the tools' one `generate` case."""

import argparse
import pathlib

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _args(load_tool, *argv, cache_phases=1):
  parser = argparse.ArgumentParser()
  load_tool("generation_case").add_arguments(parser, cache_phases)
  return parser.parse_args(list(argv))


def test_arguments_default_to_the_benchmark_case_and_the_tools_phases(
    load_tool):
  args = _args(load_tool)
  assert (args.model, args.batch, args.prompt_width, args.new_tokens,
          args.schedule, args.cache_phases, args.lockstep,
          args.fused_head) == ("qwen3_0p6b", 32, 64, 256, "b16s4", 1, False,
                               False)
  assert _args(load_tool, cache_phases=4).cache_phases == 4
  assert _args(load_tool, "--lockstep", "--fused-head").fused_head


def test_build_gives_the_schedules_config_and_the_benchmarks_prompts(
    load_tool, monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import generation  # pylint: disable=g-import-not-at-top

  case_lib = load_tool("generation_case")
  args = _args(load_tool, "--model", "tiny", "--batch", "3",
               "--prompt-width", "8", "--schedule", "b4t0.9")
  case = case_lib.build(args, generation)
  assert case.vocab == 512 and case.config.mask_token_id == 511
  assert case.config.block_size == 4 and case.config.threshold == 0.9
  tokens, lengths = generation.prompts(3, 8, 512, seed=3)
  np.testing.assert_array_equal(case.tokens, tokens)
  np.testing.assert_array_equal(case.lengths, lengths)
  with pytest.raises(ValueError, match="--schedule: one of"):
    case_lib.build(_args(load_tool, "--schedule", "b8s2"), generation)
