"""Row forms -> token ids; the bad-row policies of `FileExamples`."""

import importlib.util
import json
import pathlib

from hypothesis import given
from hypothesis import strategies as st
import numpy as np
import pytest

from tunix_blockdiff import data as data_lib
from tunix_blockdiff import errors
from tunix_blockdiff import tasks
from tunix_blockdiff.data import rows
from tunix_blockdiff.data import sources

_spec = importlib.util.spec_from_file_location(
    "tests_data_hf_tokenizer",
    pathlib.Path(__file__).with_name("hf_tokenizer.py"),
)
hf_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_tokenizer)

CHAR = tasks.CharTokenizer()


def _jsonl(path, rows_):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
  return str(path)


def test_pair_rows_get_bos_and_eos():
  encoded = rows.encode_row(
      {"prompt": "12", "completion": "21"}, where="f:1", index=0, tokenizer=CHAR
  )
  assert encoded.prompt == [CHAR.bos_id()] + CHAR.encode("12")
  assert encoded.completion == CHAR.encode("21") + [CHAR.eos_id()]
  assert (encoded.prompt_text, encoded.reference) == ("12", "21")


def test_field_names_are_overridable():
  fields = rows.RowFields(prompt="q", completion="a")
  encoded = rows.encode_row(
      {"q": "1", "a": "2"}, where="f:1", index=0, tokenizer=CHAR, fields=fields
  )
  assert encoded.reference == "2"


def test_text_cut_points_are_seeded_and_deterministic():
  row = {"text": "0123456789abcdefghij"}

  def cut(seed, index):
    encoded = rows.encode_row(
        row, where="f:1", index=index, tokenizer=CHAR, seed=seed
    )
    assert encoded.prompt_text + encoded.reference == row["text"]
    assert encoded.prompt_text and encoded.reference
    return len(encoded.prompt_text)

  assert cut(0, 5) == cut(0, 5)
  assert len({cut(0, i) for i in range(20)}) > 3  # differs per row
  assert len({cut(s, 5) for s in range(20)}) > 3  # and per seed


@given(
    st.text(alphabet="0123456789abc ", min_size=2, max_size=30),
    st.integers(0, 2**31 - 1),
    st.integers(0, 10**6),
)
def test_a_text_cut_splits_the_document_inside_it(text, seed, index):
  encoded = rows.encode_row(
      {"text": text}, where="f:1", index=index, tokenizer=CHAR, seed=seed
  )
  assert encoded.prompt_text + encoded.reference == text
  assert encoded.prompt[0] == CHAR.bos_id() and len(encoded.prompt) >= 2
  assert (
      encoded.completion[-1] == CHAR.eos_id() and len(encoded.completion) >= 2
  )


def test_chat_rows_use_the_tokenizers_template(tmp_path):
  from tunix_blockdiff.models import checkpoints

  hf_tokenizer.write_tiny_hf_tokenizer(tmp_path)
  tokenizer = checkpoints.HFTokenizer(tmp_path)
  messages = [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"},
      {"role": "user", "content": "and 3+3?"},
      {"role": "assistant", "content": "6"},
  ]
  encoded = rows.encode_row(
      {"messages": messages}, where="f:1", index=0, tokenizer=tokenizer
  )
  assert encoded.prompt_text == tokenizer.apply_chat_template(messages[:4])
  assert encoded.prompt_text.endswith("<|im_start|>assistant\n")
  assert "4<|im_end|>" in encoded.prompt_text
  assert encoded.reference == "6"
  assert encoded.completion == tokenizer.encode("6") + [tokenizer.eos_id()]
  with pytest.raises(errors.UsageError, match="chat template"):
    rows.encode_row(
        {"messages": messages}, where="f:1", index=0, tokenizer=CHAR
    )
  with pytest.raises(sources.RowError, match="f:1: .*unknown token"):
    rows.encode_row(
        {"prompt": "HELLO", "completion": "x"},
        where="f:1",
        index=0,
        tokenizer=tokenizer,
    )


BAD = [
    ({"prompt": "1"}, "missing field 'completion'"),
    ({"prompt": "1", "completion": ""}, "'completion' is empty"),
    ({"prompt": 1, "completion": "2"}, "'prompt' must be a string, got int"),
    ({"prompt": "1", "completion": "9" * 40}, "longer than seq_len=16"),
    ({"prompt": "1", "completion": "ABC"}, "cannot encode"),
    ({"messages": "hi"}, "must be a list"),
    ({"messages": [{"role": "user", "content": "1"}]}, "no assistant turn"),
    ({"text": "1"}, "at least 2"),
    ([1, 2], "a row must be an object"),
]


def _examples(path, **kwargs):
  return rows.FileExamples(
      sources.open_source(path),
      tokenizer=CHAR,
      seq_len=16,
      vocab_size=CHAR.vocab_size,
      mask_token_id=CHAR.mask_id(),
      **kwargs,
  )


@pytest.mark.parametrize("row, message", BAD)
def test_error_policy_names_file_and_line(tmp_path, row, message):
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1", "completion": "2"}, row])
  with pytest.raises(sources.RowError, match=rf"d.jsonl:2.*{message}"):
    _examples(path, bad_rows="error")


def test_skip_policy_counts_and_keeps_the_rest(tmp_path):
  good = [{"prompt": f"{i}", "completion": f"{i}{i}"} for i in range(4)]
  path = _jsonl(tmp_path / "d.jsonl", good[:2] + [r for r, _ in BAD] + good[2:])
  with open(path, "a") as f:
    f.write("{not json\n")
  examples = _examples(path, bad_rows="skip")
  assert len(examples) == 4
  report = examples.report()
  assert report["rows"] == 5 + len(BAD) and report["skipped"] == len(BAD) + 1
  assert report["first_skipped"][0].startswith(f"{path}:3: ")
  # Example ids are the row indices (stable under skipping).
  assert [examples[i].example_id for i in range(4)] == [0, 1, 11, 12]
  np.testing.assert_array_equal(
      examples[3].completion, CHAR.encode("33") + [CHAR.eos_id()]
  )
  assert examples.encoded(3).reference == "33"
  assert len(_examples(path, limit=3)) == 3


def test_file_examples_feed_sft_batches(tmp_path):
  import tunix_blockdiff as tbd

  path = _jsonl(
      tmp_path / "d.jsonl",
      [{"prompt": f"{i}", "completion": f"{i}{i}"} for i in range(10)],
  )
  examples = _examples(path)
  diffusion = tbd.BlockDiffusionConfig(block_size=4, mask_token_id=3)
  config = data_lib.DataConfig(
      seq_len=16, batch_size=4, vocab_size=CHAR.vocab_size, num_epochs=1
  )
  batches = list(data_lib.SFTBatches(examples, diffusion, config))
  assert len(batches) == 2
  as_list = list(
      data_lib.SFTBatches([examples[i] for i in range(10)], diffusion, config)
  )
  for a, b in zip(batches, as_list):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])


def test_all_rows_bad_is_an_error(tmp_path):
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1"}])
  with pytest.raises(errors.UsageError, match="no usable rows in 1 rows"):
    _examples(path)
