"""Rows from jsonl, parquet and save_to_disk files, by random access."""

import json

import pytest

from tunix_blockdiff import errors
from tunix_blockdiff.data import sources

ROWS = [{"prompt": f"p{i}", "completion": f"c{i}" * (i + 1)} for i in range(7)]


def _write_jsonl(path, rows, blank_every=3):
  lines = []
  for i, row in enumerate(rows):
    if i and i % blank_every == 0:
      lines.append("   ")  # Blank lines are skipped, line numbers kept.
    lines.append(json.dumps(row))
  path.write_text("\n".join(lines))  # No final newline.
  return path


def _write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
  return path


def _write_hf_disk(path, rows):
  import datasets

  datasets.Dataset.from_list(rows).save_to_disk(str(path))
  return path


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_jsonl_offsets_survive_any_chunking(tmp_path, monkeypatch, chunk):
  monkeypatch.setattr(sources, "_CHUNK", chunk)
  path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
  source = sources.JsonlSource(str(path))
  assert len(source) == len(ROWS)
  assert [source[i][1] for i in range(len(source))] == ROWS
  # Rows 3 and 6 follow blank lines: their line numbers count them.
  assert source[0][0] == f"{path}:1"
  assert source[3][0] == f"{path}:5"
  assert source[6][0] == f"{path}:9"
  # Random access in any order.
  assert source[5][1] == ROWS[5] and source[1][1] == ROWS[1]


def test_every_format_reads_the_same_rows(tmp_path):
  paths = {
      "jsonl": _write_jsonl(tmp_path / "a.jsonl", ROWS),
      "parquet": _write_parquet(tmp_path / "a.parquet", ROWS),
      "hf_disk": _write_hf_disk(tmp_path / "saved", ROWS),
  }
  for name, path in paths.items():
    assert sources.detect_format(str(path)) == name
    rows = list(sources.read_rows(str(path)))
    assert [row for _, row in rows] == ROWS, name
  assert [loc for loc, _ in sources.read_rows(str(paths["parquet"]))][-1] == (
      f"{paths['parquet']}:7"
  )


def test_globs_concatenate_files_in_sorted_order(tmp_path):
  _write_jsonl(tmp_path / "b.jsonl", ROWS[3:])
  _write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
  source = sources.open_source(str(tmp_path / "*.jsonl"))
  assert len(source) == len(ROWS)
  assert [source[i][1] for i in range(len(source))] == ROWS
  assert source[3][0] == f"{tmp_path / 'b.jsonl'}:1"
  with pytest.raises(IndexError):
    source[len(ROWS)]


def test_errors_name_the_file_and_what_is_allowed(tmp_path):
  with pytest.raises(errors.UsageError, match="does not exist"):
    sources.open_source(str(tmp_path / "missing.jsonl"))
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(errors.UsageError, match="cannot tell the format"):
    sources.open_source(str(tmp_path / "x.csv"))
  with pytest.raises(errors.UsageError, match="dataset.format must be one of"):
    sources.open_source(str(tmp_path / "x.csv"), format="csv")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n{not json\n')
  source = sources.open_source(str(bad))
  with pytest.raises(sources.RowError, match=rf"{bad}:2: not valid JSON"):
    source[1]


def test_a_format_that_contradicts_the_content_is_one_line(tmp_path):
  jsonl = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
  parquet = _write_parquet(tmp_path / "rows.parquet", ROWS)
  assert sources.sniff_format(str(jsonl)) == "jsonl"
  assert sources.sniff_format(str(parquet)) == "parquet"
  assert sources.sniff_format(str(tmp_path)) == "hf_disk"
  for path, forced, found in [
      (jsonl, "parquet", "jsonl"),
      (parquet, "jsonl", "parquet"),
  ]:
    with pytest.raises(errors.UsageError) as e:
      sources.open_source(str(path), format=forced)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: dataset.format is {forced!r}")
    assert f"looks like {found}" in message
  with pytest.raises(errors.UsageError, match="looks like jsonl"):
    sources.open_source(str(jsonl), format="hf_disk")
  # Content that shows no format: still one line.
  text = tmp_path / "notes.parquet"
  text.write_text("hello\n")
  with pytest.raises(errors.UsageError, match="not a readable parquet file"):
    sources.open_source(str(text))
  with pytest.raises(errors.UsageError, match="is a directory written by"):
    sources.open_source(str(text), format="hf_disk")


def test_sft_with_a_contradicting_format_exits_2_naming_the_file(
    tmp_path, capsys
):
  from tunix_blockdiff import cli  # pylint: disable=g-import-not-at-top

  train = _write_jsonl(
      tmp_path / "train.jsonl", [{"prompt": "rev 1>", "completion": "1"}]
  )
  code = cli.main([
      "sft", f"output_dir={tmp_path / 'run'}", f"dataset.train={train}",
      "dataset.format=parquet",
  ])
  err = capsys.readouterr().err
  assert code == 2
  assert err.count("\n") == 1 and "Traceback" not in err
  assert str(train) in err and "looks like jsonl" in err
