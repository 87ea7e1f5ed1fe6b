"""tools/bad_inputs.py: its cases' files, and two cases run end to end."""


def test_two_cases_are_refused_in_one_line(load_tool, capsys):
  tool = load_tool("bad_inputs")
  cases = [tool.CASES.index("sft training.max_steps=-5"),
           tool.CASES.index("rl dataset.train={d}/prompts_bad_later.jsonl"
                            " dataset.bad_rows=error")]
  assert tool.main(["--only", *map(str, cases)]) == 0
  out = capsys.readouterr().out
  assert "2 of 2 refused in one line" in out
  assert "training.max_steps must be an int >= 1" in out
  assert "prompts_bad_later.jsonl:2: bad prompt row" in out
