"""`tunix-blockdiff sft dataset.train=... dataset.eval=...`: the user's files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import sft_data

SMALL = [
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.hidden_dim=64",
    "model.num_heads=2",
    "model.head_dim=16",
    "model.num_kv_heads=1",
    "data.seq_len=16",
    "data.batch_size=4",
    "training.max_steps=2",
    "training.eval_every_n_steps=2",
    "eval.batch_size=4",
    "eval.thresholds=[0.9]",
]


def _pairs(n, seed):
  rows = []
  for i in range(n):
    digits = f"{(seed * 7919 + i * 104729) % 100000:05d}"
    rows.append({"prompt": digits, "completion": digits[::-1]})
  return rows


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_sft_trains_and_evaluates_on_jsonl_files(tmp_path, capsys):
  train = _jsonl(
      tmp_path / "train.jsonl",
      _pairs(16, 0) + [{"prompt": "1", "completion": ""}],  # one bad row
  )
  evals = _jsonl(tmp_path / "eval.jsonl", _pairs(4, 1))
  out = tmp_path / "run"
  argv = [
      f"dataset.train={train}",
      f"dataset.eval={evals}",
      f"output_dir={out}",
  ]
  assert cli.main(["sft", *argv, *SMALL]) == 0
  captured = capsys.readouterr()
  summary = json.loads((out / "summary.json").read_text())
  assert summary["train_steps"] == 2
  assert summary["train_examples"] == 16 and summary["eval_examples"] == 4
  assert summary["bad_rows"]["train"]["skipped"] == 1
  assert summary["bad_rows"]["train"]["first_skipped"] == [
      f"{train}:17: field 'completion' is empty"
  ]
  assert "1 bad rows skipped" in captured.err
  assert 0.0 <= summary["eval_edit_similarity"] <= 1.0
  assert 0.0 <= summary["eval_exact_match"] <= 1.0
  assert summary["tokens_per_step"] > 0
  assert summary["eval_loss"] > 0
  # Printed samples: prompt, reference, generation (coloured when a TTY).
  assert "reference:  " + _pairs(4, 1)[0]["completion"] in captured.out
  assert "generation: " in captured.out
  # `generate RUN_DIR` takes its prompts from the run's eval file.
  assert cli.main(["generate", str(out), "png=" + str(tmp_path / "t.png")]) == 0
  generated = json.loads((out / "generate.json").read_text())
  assert generated["prompts"] == [r["prompt"] for r in _pairs(4, 1)]
  assert generated["answers"] == [r["completion"] for r in _pairs(4, 1)]


def test_a_dataset_without_eval_trains_only(tmp_path):
  table = pa.Table.from_pylist(
      [{"text": r["prompt"] * 2} for r in _pairs(8, 2)]
  )
  pq.write_table(table, tmp_path / "train.parquet")
  cfg = common.load_recipe([
      f"dataset.train={tmp_path / '*.parquet'}",
      f"output_dir={tmp_path / 'run'}",
      *SMALL,
      "training.max_steps=1",
  ])
  from tunix_blockdiff.jobs import sft

  summary = sft.run(cfg)
  assert summary["train_steps"] == 1 and summary["train_examples"] == 8
  assert summary["eval_loss"] is None and summary["eval_exact_match"] is None
  assert "eval" not in summary["bad_rows"]


@pytest.mark.parametrize(
    "block, message",
    [
        ({"train": None}, "dataset.train is required"),
        ({"train": "x", "bad_rows": "drop"}, "bad_rows must be one of"),
        ({"train": "x", "format": "csv"}, "format must be one of"),
        ({"train": "x", "fields": {"promt": "q"}}, "did you mean 'prompt'"),
        ({"train": "x", "num_eval": 0}, "num_eval must be an int >= 1"),
        ("x.jsonl", "dataset must be a mapping"),
    ],
)
def test_dataset_settings_errors(block, message):
  with pytest.raises(errors.UsageError, match=message):
    sft_data.dataset_settings(block)


def test_edit_similarity_and_exact_match_of_user_data():
  pairs = [("p", "abcd"), ("q", "xy")]
  assert sft_data.mean_edit_similarity(["abce", " xy\n"], pairs) == 0.875
  assert sft_data.ExactMatch().check("p", " 12 \n", "12")
  assert not sft_data.ExactMatch().check("p", "1", "12")
