"""Prompt rows of the rl/opd jobs (`runs.rl_data`): tasks and dataset files."""

import json

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import tasks
from tunix_blockdiff.runs import prompt_files
from tunix_blockdiff.runs import rl_data


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _no_check(prompt):
  del prompt


def test_dataset_rows_are_renamed_validated_and_split(tmp_path, capsys):
  train = _write_jsonl(
      tmp_path / "train.jsonl",
      [{"q": f"rev {i}>", "a": str(i), "tag": i % 2} for i in range(10)]
      + [{"q": "", "a": "0", "tag": 0}, {"a": "1", "tag": 1}],
  )
  cfg = omegaconf.OmegaConf.create(
      {"train": str(train), "fields": {"prompt": "q", "answer": "a"}}
  )
  prompts = rl_data.dataset_prompts(
      cfg,
      num_train=20,
      num_held_out=3,
      need_answer=True,
      validate_prompt=_no_check,
  )
  assert prompts.skipped_rows == 2
  assert "train.jsonl:11" in capsys.readouterr().err
  assert prompts.columns == ("answer", "tag")
  assert len(prompts.held_out) == 3 and len(prompts.train) == 20
  held = {r["prompt"] for r in prompts.held_out}
  trained = {r["prompt"] for r in prompts.train}
  assert not held & trained and len(held | trained) == 10
  assert all(r["answer"] == r["prompt"][4:-1] for r in prompts.train)


def test_dataset_eval_file_and_bad_rows_error(tmp_path):
  train = _write_jsonl(
      tmp_path / "train.jsonl",
      [{"prompt": "rev 1>", "answer": "1"}, {"prompt": "rev 12345678>"}],
  )
  held = _write_jsonl(
      tmp_path / "eval.jsonl", [{"prompt": "rev 9>", "answer": "9"}] * 4
  )

  def short(prompt):
    if len(prompt) > 8:
      raise ValueError("too long")

  cfg = {"train": str(train), "eval": str(held), "num_eval": 2}
  prompts = rl_data.dataset_prompts(
      omegaconf.OmegaConf.create(cfg),
      num_train=3,
      num_held_out=8,
      need_answer=True,
      validate_prompt=short,
  )
  assert [r["prompt"] for r in prompts.held_out] == ["rev 9>"] * 2
  assert [r["prompt"] for r in prompts.train] == ["rev 1>"] * 3
  with pytest.raises(ValueError, match=r"train.jsonl:2: bad prompt row"):
    rl_data.dataset_prompts(
        omegaconf.OmegaConf.create({**cfg, "bad_rows": "error"}),
        num_train=3,
        num_held_out=8,
        need_answer=True,
        validate_prompt=short,
    )


@pytest.mark.parametrize(
    "section, match",
    [
        ({"train": "x.jsonl", "trian": 1}, "unknown dataset keys"),
        ({"eval": "x.jsonl"}, "dataset.train must name"),
        ({"train": "x.jsonl", "fields": {"promt": "q"}}, "dataset.fields"),
        ({"train": "x.jsonl", "bad_rows": "drop"}, "bad_rows"),
    ],
)
def test_dataset_section_errors(section, match):
  with pytest.raises(ValueError, match=match):
    prompt_files.check_dataset_section(omegaconf.OmegaConf.create(section))


def test_missing_files_and_too_few_rows_are_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    rl_data.dataset_prompts(
        omegaconf.OmegaConf.create({"train": str(tmp_path / "none.jsonl")}),
        num_train=1,
        num_held_out=1,
        need_answer=True,
        validate_prompt=_no_check,
    )
  train = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "b"}])
  with pytest.raises(ValueError, match="held out"):
    rl_data.dataset_prompts(
        omegaconf.OmegaConf.create({"train": str(train)}),
        num_train=1,
        num_held_out=1,
        need_answer=True,
        validate_prompt=_no_check,
    )


def test_prompt_validator_counts_bos():
  validate = rl_data.prompt_validator(tasks.CharTokenizer(), 5)
  validate("rev ")  # 4 characters + BOS
  with pytest.raises(ValueError, match="max_prompt_length=5"):
    validate("rev 1")
  with pytest.raises(ValueError, match="not in the alphabet"):
    validate("REV")


def _prompt_set(train, held_out):
  return rl_data.PromptSet(
      train=[{"prompt": p, "answer": ""} for p in train],
      held_out=[{"prompt": p, "answer": ""} for p in held_out],
      source="test",
      columns=("answer",),
  )


def test_prompt_width_is_sized_from_the_rows_when_null(capsys):
  cfg = omegaconf.OmegaConf.create({"rollout": {"max_prompt_length": None}})
  prompts = _prompt_set(["rev 1>", "rev 12345>"], ["rev 123>"])
  limit, counts = rl_data.size_prompts(
      cfg, tasks.CharTokenizer(), prompts, job="rl"
  )
  assert limit == 11  # "rev 12345>" + BOS
  assert counts == {
      "max_prompt_length": 11,
      "longest_prompt": 11,
      "truncated_train": 0,
      "truncated_held_out": 0,
  }
  assert capsys.readouterr().err == ""
  # null also lets the dataset validator accept any length.
  rl_data.prompt_validator(tasks.CharTokenizer(), None)("rev " + "1" * 50)


def test_a_set_prompt_width_counts_truncations_and_says_so_once(capsys):
  cfg = omegaconf.OmegaConf.create({"rollout": {"max_prompt_length": 8}})
  prompts = _prompt_set(
      ["rev 1>", "rev 12345>", "rev 123456>"], ["rev 1234>", "rev 2>"]
  )
  limit, counts = rl_data.size_prompts(
      cfg, tasks.CharTokenizer(), prompts, job="opd"
  )
  assert limit == 8
  assert counts["truncated_train"] == 2 and counts["truncated_held_out"] == 1
  assert counts["longest_prompt"] == 12
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert err.startswith("opd: 2 of 3 training and 1 of 2 held-out prompts")
  assert "rollout.max_prompt_length=8" in err
  cfg.rollout.max_prompt_length = 0
  with pytest.raises(ValueError, match=">= 1 or null"):
    rl_data.size_prompts(cfg, tasks.CharTokenizer(), prompts, job="opd")


def test_prompt_batches_keep_one_value_per_row():
  rows = [
      {"prompt": f"p{i}", "answer": str(i), "meta": {"id": i}} for i in range(5)
  ]
  batches = list(rl_data.prompt_batches(rows, 2))
  assert len(batches) == 2  # The partial last batch is dropped.
  assert list(batches[1]["prompts"]) == ["p2", "p3"]
  assert batches[1]["meta"].dtype == object
  repeated = np.repeat(batches[1]["meta"], 3, axis=0)
  assert [m["id"] for m in repeated] == [2, 2, 2, 3, 3, 3]


@settings(max_examples=30, deadline=None)
@given(
    num_rows=st.integers(1, 7), num=st.integers(0, 30), seed=st.integers(0, 9)
)
def test_cycle_rows_passes_over_every_row_each_epoch(num_rows, num, seed):
  rows = [{"prompt": str(i)} for i in range(num_rows)]
  out = rl_data.cycle_rows(rows, num, seed)
  assert len(out) == num
  for start in range(0, num - num_rows + 1, num_rows):
    epoch = sorted(int(r["prompt"]) for r in out[start : start + num_rows])
    assert epoch == list(range(num_rows))
  assert out == rl_data.cycle_rows(rows, num, seed)
