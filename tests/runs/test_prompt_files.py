"""The rl/opd prompt files (`runs.prompt_files`): rows and early checks."""

import json

import pytest

from tunix_blockdiff import errors
from tunix_blockdiff.runs import prompt_files

FIELDS = {"prompt": "q", "answer": "a"}


def test_prompt_row_renames_the_fields_and_keeps_other_columns():
  row = prompt_files.prompt_row({"q": "2+2", "a": "4", "level": 1}, FIELDS)
  assert row == {"prompt": "2+2", "answer": "4", "level": 1}
  assert prompt_files.prompt_row(["not", "an", "object"], FIELDS) == {
      "prompt": None}
  with pytest.raises(errors.UsageError, match="'q' must be a non-empty"):
    prompt_files.check_prompt_row({"prompt": ""}, FIELDS, need_answer=False)
  with pytest.raises(errors.UsageError, match="'a' is missing"):
    prompt_files.check_prompt_row({"prompt": "x"}, FIELDS, need_answer=True)
  prompt_files.check_prompt_row({"prompt": "x"}, FIELDS, need_answer=False)


@pytest.mark.parametrize("bad_rows", ["skip", "error"])
def test_prompt_files_need_a_usable_row_before_anything_runs(tmp_path,
                                                             bad_rows):
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in (
      {"q": ""}, {"q": "fine", "a": "1"})) + "\n")
  section = {"train": str(path), "fields": FIELDS, "bad_rows": bad_rows,
             "format": "auto"}
  if bad_rows == "skip":  # the second row is usable
    prompt_files.check_prompt_files(section, need_answer=True)
  else:  # the first row stops the job, with its file:line
    with pytest.raises(errors.UsageError, match=f"{path}:1: bad prompt row"):
      prompt_files.check_prompt_files(section, need_answer=True)
  path.write_text(json.dumps({"q": "no answer"}) + "\n")
  with pytest.raises(errors.UsageError,
                     match=r"none of the first 1 rows is usable"):
    prompt_files.check_prompt_files({**section, "bad_rows": "skip"},
                                    need_answer=True)
