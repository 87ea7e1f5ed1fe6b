"""`tunix-blockdiff distill-data`: an AR checkpoint's own completions as SFT rows.

Every test uses one tiny random Qwen3 the module writes as a Hugging Face
directory (`hf_export.save_qwen3_hf`) with a tiny character tokenizer that
has a chat template (`tests/data/hf_tokenizer.py`).
"""

import importlib.util
import json
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.generate import sampler as sampler_lib

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.data import prompts as prompts_lib
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.jobs import distill_data
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import tiny as tiny_models

_spec = importlib.util.spec_from_file_location(
    "tests_data_hf_tokenizer",
    pathlib.Path(__file__).parents[1] / "data" / "hf_tokenizer.py",
)
hf_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_tokenizer)

EOS, PAD = 3, 0  # <|im_end|>, <pad> of the tiny tokenizer.
PROMPTS = ["abc", "hello there", "12+34=", "why?", "x"]
MAX_NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("ar_hf")
  vocab = hf_tokenizer.write_tiny_hf_tokenizer(directory)
  model = tiny_models.tiny_qwen3(
      vocab, num_layers=1, embed_dim=16, hidden_dim=32, num_heads=2,
      head_dim=8, num_kv_heads=1,
  )
  rng = np.random.default_rng(0)
  nnx.update(model, jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype),
      nnx.state(model, nnx.Param),
  ))
  hf_export.save_qwen3_hf(
      model, directory, eos_token_id=EOS, pad_token_id=PAD
  )
  return directory


def _write_jsonl(path, rows):
  path.write_text("".join(
      (r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows
  ))
  return path


def _read_jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _direct_greedy(directory, prompts):
  """Tunix `Sampler` called directly: one batch, greedy, cut at EOS."""
  tokenizer = checkpoints.HFTokenizer(directory)
  model = checkpoints.load_hf(directory)
  config = model.config
  cache = lambda size: sampler_lib.CacheConfig(  # noqa: E731
      cache_size=size, num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
  )
  width = max(
      len(sampler_lib.Sampler(model, tokenizer, cache(1)).tokenize(p))
      for p in prompts
  )
  sampler = sampler_lib.Sampler(model, tokenizer, cache(width + MAX_NEW))
  out = sampler(
      list(prompts), max_generation_steps=MAX_NEW, max_prompt_length=width,
      temperature=0.0, eos_tokens=[EOS],
  )
  rows = []
  for prompt, tokens in zip(prompts, out.tokens):
    ids = [int(t) for t in tokens]
    ids = ids[: ids.index(EOS)] if EOS in ids else ids
    if tokenizer.decode(ids):
      rows.append({"prompt": prompt, "completion": tokenizer.decode(ids)})
  return rows


def test_greedy_rows_reproduce_tunix_sampler_and_load_as_sft_rows(
    checkpoint, tmp_path, capsys
):
  prompts = _write_jsonl(
      tmp_path / "prompts.jsonl",
      [{"prompt": p, "completion": "ignored"} for p in PROMPTS],
  )
  out = tmp_path / "distilled.jsonl"
  argv = ["distill-data", str(checkpoint), str(prompts), str(out),
          "--max-new-tokens", str(MAX_NEW), "--batch-size", "2"]
  assert cli.main(argv) == 0
  assert f"to {out}" in capsys.readouterr().out
  rows = _read_jsonl(out)
  assert rows == _direct_greedy(checkpoint, PROMPTS)
  assert len(rows) >= 3  # the random model does not stop at once.
  tokenizer = checkpoints.HFTokenizer(checkpoint)
  for i, row in enumerate(rows):
    assert set(row) == {"prompt", "completion"}
    # What an SFT recipe's `dataset.train=FILE` reads back.
    encoded = rows_lib.encode_row(row, where=f"x:{i}", index=i,
                                  tokenizer=tokenizer)
    assert encoded.completion[-1] == EOS
  # Without --overwrite the non-empty output is refused, with it replaced.
  assert cli.main(argv) == 2
  assert "--overwrite" in capsys.readouterr().err
  assert cli.main(argv + ["--overwrite"]) == 0


def test_chat_rows_use_the_chat_template_and_sampling_is_seeded(
    checkpoint, tmp_path
):
  prompts = _write_jsonl(tmp_path / "chat.jsonl", [
      {"messages": [{"role": "user", "content": "hi"}]},
      {"messages": [{"role": "user", "content": "ab"},
                    {"role": "assistant", "content": "dropped"}]},
  ])
  runs = []
  for name in ("a.jsonl", "b.jsonl"):
    options = distill_data.parse_args([
        str(checkpoint), str(prompts), str(tmp_path / name),
        "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3",
    ])
    assert options.sampling_top_p == 1.0
    summary = distill_data.run(options)
    runs.append(_read_jsonl(tmp_path / name))
    assert summary["rows"] + summary["empty"] == 2
  assert runs[0] == runs[1] and runs[0]
  for row in runs[0]:
    assert row["prompt"].startswith("<|im_start|>user\n")
    assert row["prompt"].endswith("<|im_start|>assistant\n")
    assert "dropped" not in row["prompt"]


BAD_ROWS = [
    "{not json",
    {"completion": "no prompt"},
    {"prompt": ""},
    {"prompt": 7},
    {"prompt": "UPPER CASE"},  # outside the tokenizer's alphabet
    {"messages": [{"role": "user"}]},
]


def test_bad_prompt_rows_are_skipped_and_counted_or_raise_with_file_line(
    checkpoint, tmp_path, capsys
):
  path = _write_jsonl(
      tmp_path / "mixed.jsonl", [{"prompt": "ok"}, *BAD_ROWS, {"prompt": "yes"}]
  )
  tokenizer = checkpoints.HFTokenizer(checkpoint)
  prompts = prompts_lib.read_prompts(str(path), tokenizer)
  assert prompts == prompts_lib.Prompts(["ok", "yes"], len(BAD_ROWS))
  captured = capsys.readouterr()
  assert f"skipped {len(BAD_ROWS)} bad prompt rows" in captured.out
  assert f"{path}:2" in captured.err
  with pytest.raises(errors.UsageError, match=f"{path}:2"):
    prompts_lib.read_prompts(str(path), tokenizer, bad_rows="error")
  for line, row in enumerate(BAD_ROWS[1:], start=3):
    one = _write_jsonl(tmp_path / f"bad{line}.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(errors.UsageError, match=f"{one}:2: "):
      prompts_lib.read_prompts(str(one), tokenizer, bad_rows="error")
  # Through the command: one line, exit status 2, nothing written.
  out = tmp_path / "out.jsonl"
  assert cli.main(["distill-data", str(checkpoint), str(path), str(out),
                   "--bad-rows", "error"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{path}:2" in err
  assert not out.exists()


def _one_line_error(capsys, argv) -> str:
  assert cli.main(["distill-data", *argv]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err.startswith("tunix-blockdiff distill-data: error: ")
  return err


def test_usage_errors_are_one_line_before_any_model_is_loaded(
    checkpoint, tmp_path, capsys
):
  prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}])
  out = str(tmp_path / "out.jsonl")
  err = _one_line_error(capsys, [str(tmp_path / "nope"), str(prompts), out])
  assert "is not a directory" in err
  empty = tmp_path / "empty_dir"
  empty.mkdir()
  assert "no config.json" in _one_line_error(
      capsys, [str(empty), str(prompts), out]
  )
  (empty / "config.json").write_text(json.dumps({"model_type": "bert"}))
  (empty / "model.safetensors").write_bytes(b"")
  (empty / "tokenizer.json").write_text("{}")
  assert "'bert'" in _one_line_error(capsys, [str(empty), str(prompts), out])
  assert "does not exist" in _one_line_error(
      capsys, [str(checkpoint), str(tmp_path / "missing.jsonl"), out]
  )
  existing = _write_jsonl(tmp_path / "existing.jsonl", [{"x": 1}])
  assert "--overwrite" in _one_line_error(
      capsys, [str(checkpoint), str(prompts), str(existing)]
  )
  for flags, needle in [
      (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
      (["--batch-size", "0"], "--batch-size must be >= 1"),
      (["--top-p", "0.5"], "--temperature > 0"),
      (["--temperature", "1", "--top-p", "1.5"], "--top-p must satisfy"),
      (["--bad-rows", "drop"], "--bad-rows"),
  ]:
    err = _one_line_error(capsys, [str(checkpoint), str(prompts), out, *flags])
    assert needle in err, err
  assert "OUT.jsonl" in _one_line_error(capsys, [str(checkpoint)])
  assert not pathlib.Path(out).exists()
