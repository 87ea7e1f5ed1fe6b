"""`tools/program_hashes.py`: one stable hash per device program."""

import pytest

ARGS = ["--model", "tiny", "--batch", "2", "--prompt-width", "8",
        "--new-tokens", "8"]


def test_each_program_hashes_the_same_twice_and_differs_from_the_others(
    load_tool, capsys):
  tool = load_tool("program_hashes")
  assert tool.main(ARGS) == 0
  first = capsys.readouterr().out.splitlines()
  assert tool.main(ARGS) == 0
  assert capsys.readouterr().out.splitlines() == first
  names = [line.split()[0] for line in first]
  assert names == ["generate_b16s4", "generate_b4s1", "generate_b4t0.9",
                   "block_causal_mask", "static_mask_matches",
                   "context_parallel_reorder"]
  assert len({line.split()[1] for line in first}) == len(first)


def test_a_staged_loop_is_refused(load_tool, capsys):
  with pytest.raises(SystemExit):
    load_tool("program_hashes").main([*ARGS, "--cache-phases", "2"])
  assert "--cache-phases: 1" in capsys.readouterr().err
