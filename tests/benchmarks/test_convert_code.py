"""The pieces of `benchmarks/convert_code.py`, and its `--quick` run.

Corpus split, tokenizer, causal pretraining with PeftTrainer, HF export and
reload, jsonl rows, AR decoding with Tunix's Sampler, block-diffusion
decoding and scoring, summary, table and figure: each for a few steps with a
tiny model, so the benchmark cannot rot. (The `tunix-blockdiff sft` step it
runs is the sft job, tested with dataset files in tests/jobs.)
"""

import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np
import omegaconf
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _causal_lm  # noqa: E402  pylint: disable=g-import-not-at-top
import _code_corpus  # noqa: E402  pylint: disable=g-import-not-at-top
import _convert_eval  # noqa: E402  pylint: disable=g-import-not-at-top
import _convert_report  # noqa: E402  pylint: disable=g-import-not-at-top
import _convert_stages  # noqa: E402  pylint: disable=g-import-not-at-top
import _pretrain  # noqa: E402  pylint: disable=g-import-not-at-top
import _timing  # noqa: E402  pylint: disable=g-import-not-at-top
import convert_agreement  # noqa: E402  pylint: disable=g-import-not-at-top
import convert_code  # noqa: E402  pylint: disable=g-import-not-at-top
import convert_speed  # noqa: E402  pylint: disable=g-import-not-at-top

from tunix_blockdiff.models import checkpoints  # noqa: E402
from tunix_blockdiff import config as config_lib  # noqa: E402
from tunix_blockdiff import data as data_lib  # noqa: E402
from tunix_blockdiff.runs import common  # noqa: E402

# Row budgets (tokens): the tiny tokenizer needs room for a docstring.
PROMPT, COMPLETION = 160, 40

SOURCE = '''
class A:

  @staticmethod
  def add(x, y):
    """Adds."""
    # the sum
    return x + y

  def nodoc(self):
    return 1


def only_doc():
  """Nothing else."""
'''


def test_median_seconds_returns_the_first_output_and_the_median():
  calls = []

  def run():
    calls.append(len(calls))
    return np.asarray([len(calls)])

  first, seconds = _timing.median_seconds(run, 3)
  assert calls == [0, 1, 2] and first.tolist() == [1]
  assert seconds >= 0.0
  with pytest.raises(ValueError, match="repeats must be >= 1"):
    _timing.median_seconds(run, 0)


def test_function_pairs_split_signature_docstring_and_body():
  pairs = list(_code_corpus.function_pairs(SOURCE))
  assert pairs == [(
      '@staticmethod\ndef add(x, y):\n  """Adds."""\n',
      "  # the sum\n  return x + y\n",
  )]
  assert not list(_code_corpus.function_pairs("def broken(:"))


def test_function_prefixes_cut_every_function_at_its_statements():
  source = SOURCE + (
      "\ndef f(a,\n      b):\n  x = 1\n  # c\n  y = 2\n  return x\n"
      "\ndef one_line(): return 1\n"
  )
  # ast.walk's order: breadth first.
  assert list(_code_corpus.function_prefixes(source)) == [
      "def f(a,\n      b):\n",
      "def f(a,\n      b):\n  x = 1\n",
      "def f(a,\n      b):\n  x = 1\n  # c\n  y = 2\n",
      '@staticmethod\ndef add(x, y):\n  """Adds."""\n',
      "def nodoc(self):\n",
  ]
  assert not list(_code_corpus.function_prefixes("def broken(:"))


class _CharTokenizer:

  def encode(self, text):
    return list(text)


def test_distill_prompts_keep_the_base_first_then_a_seeded_sample(tmp_path):
  path = tmp_path / "m.py"
  path.write_text(SOURCE + "\ndef g():\n  a = 1\n  b = 2\n  return a\n")
  base = ['@staticmethod\ndef add(x, y):\n  """Adds."""\n']
  kwargs = dict(base=base, prompt_tokens=100, seed=0)
  rows = _code_corpus.distill_prompts(
      [path], _CharTokenizer(), num_prompts=10, **kwargs
  )
  prompts = [r["prompt"] for r in rows]
  # The base prompt once, then every other prefix once, in a seeded order.
  assert prompts[0] == base[0] and len(prompts) == len(set(prompts)) == 5
  assert set(prompts[1:]) == {
      "def nodoc(self):\n",
      "def g():\n",
      "def g():\n  a = 1\n",
      "def g():\n  a = 1\n  b = 2\n",
  }
  again = _code_corpus.distill_prompts(
      [path], _CharTokenizer(), num_prompts=10, **kwargs
  )
  assert again == rows
  capped = _code_corpus.distill_prompts(
      [path], _CharTokenizer(), num_prompts=3, **kwargs
  )
  assert [r["prompt"] for r in capped] == prompts[:3]
  short = _code_corpus.distill_prompts(
      [path], _CharTokenizer(), num_prompts=10, base=[], prompt_tokens=10,
      seed=0,
  )
  assert {r["prompt"] for r in short} == {"def g():\n"}
  with pytest.raises(ValueError, match="num_prompts"):
    _code_corpus.distill_prompts(
        [path], _CharTokenizer(), num_prompts=0, **kwargs
    )


def test_sft_stage_arguments_carry_the_block_size(tmp_path):
  sizes = dataclasses.replace(convert_code.QUICK, block_size=8)
  for stage in _convert_stages.STAGES:
    if stage.command == "sft":
      args = _convert_stages.sft_args(sizes, tmp_path, stage)
      assert "diffusion.block_size=8" in args, stage.name


def test_split_is_seeded_disjoint_and_complete():
  names = [f"m{i}" for i in range(40)]
  train, held = _code_corpus.split_modules(names, eval_fraction=0.2, seed=3)
  again = _code_corpus.split_modules(names, eval_fraction=0.2, seed=3)
  assert (train, held) == again
  assert len(held) == 8 and not set(train) & set(held)
  assert sorted(train + held) == sorted(names)
  with pytest.raises(ValueError, match="eval_fraction"):
    _code_corpus.split_modules(names, eval_fraction=1.0, seed=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A few real stdlib modules (a package and plain files) and a test dir."""
  root = tmp_path_factory.mktemp("stdlib")
  stdlib = _code_corpus.stdlib_root()
  shutil.copytree(stdlib / "json", root / "json")
  for name in ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py"):
    shutil.copy(stdlib / name, root / name)
  (root / "test").mkdir()
  (root / "test" / "test_x.py").write_text("def f():\n  '''x'''\n  pass\n")
  return root


def test_corpus_name_is_stdlib_only_for_the_stdlib(tmp_path):
  assert _code_corpus.corpus_name(None) == "stdlib"
  assert _code_corpus.corpus_name(_code_corpus.stdlib_root()) == "stdlib"
  assert _code_corpus.corpus_name(tmp_path / "mylib") == "mylib"


def test_pieces_end_to_end(corpus, tmp_path):
  sizes = convert_code.QUICK
  groups = _code_corpus.modules(corpus)
  assert "test" not in groups and "json" in groups
  train_mods, eval_mods = _code_corpus.split_modules(
      groups, eval_fraction=0.4, seed=0
  )
  train_files = [f for m in train_mods for f in groups[m]]
  eval_files = [f for m in eval_mods for f in groups[m]]
  tokenizer = _code_corpus.train_tokenizer(
      map(_code_corpus.read_text, train_files),
      tmp_path / "tokenizer",
      vocab_size=sizes.vocab_size,
  )
  assert tokenizer.convert_tokens_to_ids("<mask>") == 3
  pretraining = _pretrain.pretrain(
      sizes, tokenizer, train_files, tmp_path / "ar_base", print
  )
  assert pretraining["steps"] == sizes.pretrain_steps
  assert np.isfinite(pretraining["final_loss"])
  hf_tok = checkpoints.HFTokenizer(tmp_path / "ar_base")
  assert (hf_tok.bos_id(), hf_tok.eos_id(), hf_tok.pad_id()) == (1, 2, 0)

  rows = {
      split: _code_corpus.sft_rows(
          files,
          tokenizer,
          prompt_tokens=PROMPT,
          completion_tokens=COMPLETION,
          max_rows=4,
          seed=0,
      )
      for split, files in (("train", train_files), ("eval", eval_files))
  }
  for split in rows:
    assert 0 < len(rows[split]) <= 4
    path = _code_corpus.write_jsonl(rows[split], tmp_path / f"{split}.jsonl")
    assert _code_corpus.read_jsonl(path) == rows[split]
  eval_sources = {f.name for f in eval_files}
  assert all(r["source"] in eval_sources for r in rows["eval"])
  for r in rows["train"] + rows["eval"]:
    assert len(tokenizer.encode(r["prompt"])) <= PROMPT
    assert len(tokenizer.encode(r["completion"])) <= COMPLETION

  # The AR peer's pieces: causal SFT batches and Tunix's greedy Sampler.
  model = checkpoints.load_qwen3(tmp_path / "ar_base")
  pairs = [
      common.encode_pair(hf_tok, r["prompt"], r["completion"])
      for r in rows["train"]
  ]
  batch = next(
      _causal_lm.sft_batches(
          pairs, seq_len=PROMPT + COMPLETION + 2, batch_size=2, pad_id=0, seed=0
      )
  )
  # The loss covers exactly one pair's completion (with EOS) per row.
  for tokens, mask in zip(batch.input_tokens, batch.input_mask):
    assert list(tokens[mask]) in [list(c) for _, c in pairs]
  with pytest.raises(ValueError, match="batch_size"):
    next(
        _causal_lm.sft_batches(
            pairs,
            seq_len=PROMPT + COMPLETION + 2,
            batch_size=9,
            pad_id=0,
            seed=0,
        )
    )
  generated, _ = _causal_lm.greedy_generate(
      model,
      tokenizer,
      [r["prompt"] for r in rows["eval"]],
      max_new_tokens=8,
      max_prompt_length=PROMPT + 1,
      batch_size=2,
  )
  assert len(generated) == len(rows["eval"])
  assert all(len(g) <= 8 and 2 not in g for g in generated)

  # The converted side: block-diffusion decoding, scoring, the report.
  examples = data_lib.as_examples(
      [
          common.encode_pair(hf_tok, r["prompt"], r["completion"])
          for r in rows["eval"]
      ],
      seq_len=PROMPT + 10,
      vocab_size=len(tokenizer),
      mask_token_id=3,
  )
  config = config_lib.DenoiseConfig(
      block_size=4,
      mask_token_id=3,
      alignment="shifted",
      steps_per_block=2,
      eos_token_id=2,
      pad_token_id=0,
  )
  generated, tokens_per_call, _ = _convert_eval.diffusion_generate(
      model, examples, hf_tok, config, batch_size=2, max_new_tokens=8
  )
  assert len(generated) == len(rows["eval"])
  assert 1.0 <= tokens_per_call <= 2.0
  point = _convert_eval.score(generated, rows["eval"], hf_tok)
  assert 0.0 <= point["edit_similarity"] <= 1.0
  perfect = _convert_eval.score(
      [hf_tok.encode(r["completion"]) for r in rows["eval"]],
      rows["eval"],
      hf_tok,
  )
  assert perfect == {"first_line_em": 1.0, "edit_similarity": 1.0}

  assert _convert_eval.score(
      generated, rows["eval"], hf_tok, ar_generated=generated
  )["ar_agreement"] == pytest.approx(1.0)

  ar = {"tokens_per_call": 1.0, "seconds": 1.0, **perfect}
  fast = {
      "steps_per_block": 2,
      "tokens_per_call": 2.0,
      "seconds": 0.5,
      "first_line_em": 0.5,
      "edit_similarity": 0.95,
      "ar_agreement": 0.9,
  }
  slow = {
      "threshold": 0.9,
      "tokens_per_call": 2.6,
      "seconds": 0.4,
      "first_line_em": 1.0,
      "edit_similarity": 0.96,
      "ar_agreement": 0.7,
  }
  summary = _convert_report.summarize(
      {"sft": {"points": [slow, fast]}, "ar_peer": {"points": [ar]}}
  )
  verdict = summary["target"]["sft"]
  assert verdict["best_at_2_tokens_per_call"] == slow
  assert verdict["fraction_of_ar_edit_similarity"] == pytest.approx(0.96)
  assert verdict["reached"]
  # Issue 17's targets: all but the agreement (0.7 < 0.8) are met.
  parallel = summary["parallel_target"]["sft"]
  assert parallel["point"]["threshold"] == 0.9
  targets = parallel["targets"]
  assert targets["speedup_over_ar_sampler"]["measured"] == pytest.approx(2.5)
  assert [t["reached"] for t in targets.values()] == [True, True, False, True]
  assert not parallel["reached"]
  # No steps_per_block 1 point: no ceiling. With one at 0.25 s: 1 / 0.25.
  assert parallel["speedup_ceiling"] is None
  one_call = dict(fast, steps_per_block=1, seconds=0.25)
  assert _convert_report.summarize(
      {"sft": {"points": [slow, one_call]}, "ar_peer": {"points": [ar]}}
  )["parallel_target"]["sft"]["speedup_ceiling"] == pytest.approx(4.0)
  assert [r["decoding"] for r in summary["rows"]] == [
      "ar_greedy", "threshold", "static"
  ]
  assert "steps_per_block 2" in _convert_report.table(summary)
  _convert_report.plot(tmp_path / "fig.png", summary)
  assert (tmp_path / "fig.png").stat().st_size > 1000
  # The title names the corpus the run used, not always the stdlib.
  assert _convert_report.figure_title(summary) == (
      "held-out modules: converted vs AR"
  )
  summary["corpus"] = {"name": "mylib", "root": "/src/mylib"}
  assert _convert_report.figure_title(summary) == (
      "mylib held-out modules: converted vs AR"
  )


def _write_package(root: pathlib.Path) -> pathlib.Path:
  """A small source tree: 7 top-level entries of documented functions."""
  ops = ("+", "-", "*", "//", "%", "**")
  for m in range(7):
    lines = []
    for f in range(8):
      op = ops[(m + f) % len(ops)]
      lines += [
          f"def f{m}_{f}(a, b):",
          f'  """Returns a {op} b, then adds {f}."""',
          f"  c = a {op} b",
          f"  if c > {f}:",
          f"    return c + {f}",
          "  return c",
          "",
      ]
    text = "\n".join(lines) + "\n"
    if m % 2:  # a package: its files belong to one top-level entry
      (root / f"pkg{m}").mkdir(parents=True)
      (root / f"pkg{m}" / "__init__.py").write_text(text)
      (root / f"pkg{m}" / "extra.py").write_text(text.replace("def f", "def g"))
    else:
      root.mkdir(parents=True, exist_ok=True)
      (root / f"mod{m}.py").write_text(text)
  return root


@pytest.mark.slow
def test_quick_run_on_another_corpus_writes_every_stage_row(
    tmp_path, monkeypatch
):
  """`--quick --corpus DIR`: every stage end to end; the rows' schema."""
  corpus = _write_package(tmp_path / "mylib")
  out = tmp_path / "run"
  with pytest.raises(SystemExit, match="--stage-steps must be >= 1"):
    convert_code.main(["--quick", "--stage-steps", "0", "--out", str(out)])
  with pytest.raises(SystemExit, match="--stages must name stages"):
    convert_code.main(["--quick", "--stages", "sft,nope", "--out", str(out)])
  with pytest.raises(SystemExit, match="--certainty-weight must be > 0"):
    convert_code.main(["--quick", "--certainty-weight", "0", "--out", str(out)])
  with pytest.raises(SystemExit, match="--distill-prompts must be >= 0"):
    convert_code.main(["--quick", "--distill-prompts", "-1", "--out", str(out)])
  with pytest.raises(SystemExit, match="--block-size must be >= 1"):
    convert_code.main(["--quick", "--block-size", "0", "--out", str(out)])
  assert "peer_kd_certainty" not in convert_code.Sizes().stages
  # A stage named alone still runs its parents first (and reports only it).
  calls = []
  monkeypatch.setattr(
      _convert_stages, "run_stage",
      lambda sizes, run, stage, log: calls.append(stage.name) or
      _convert_stages.compute("x", 1, 1, 1, 0.0),
  )
  monkeypatch.setattr(_convert_stages, "export", lambda *a: 0.0)
  monkeypatch.setattr(
      _convert_stages, "distill",
      lambda *a: _convert_stages.compute("d", 1, 1, 1, 0.0),
  )
  stages = [_convert_stages.by_name()["sft_kd_certainty_x4"]]
  got = _convert_stages.run_all(convert_code.QUICK, out, print, stages)
  assert calls == ["sft", "sft_kd_certainty_x4"] and list(got) == [
      "sft_kd_certainty_x4"
  ]
  monkeypatch.undo()
  # --stage-steps overrides the KD stages' steps (QUICK has 2).
  assert convert_code.main([
      "--quick", "--corpus", str(corpus), "--out", str(out),
      "--stage-steps", "3",
  ]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["corpus"] == {"name": "mylib", "root": str(corpus)}
  rows = summary["rows"]
  assert all(set(r) == set(_convert_report.ROW_KEYS) for r in rows)
  (ar,) = [r for r in rows if r["model"] == "ar_peer"]
  assert ar["decoding"] == "ar_greedy" and ar["ar_agreement"] == 1.0
  assert ar["threshold"] is None and ar["steps_per_block"] is None
  sizes = dataclasses.replace(convert_code.QUICK, stage_steps=3)
  assert summary["sizes"]["stage_steps"] == 3
  models = {r["model"] for r in rows} - {"ar_peer"}
  assert models == set(sizes.stages)
  assert {"sft_kd", "sft_kd_certainty", "sft_opd"} <= models
  for name in models:
    mine = [r for r in rows if r["model"] == name]
    assert [r["threshold"] for r in mine if r["decoding"] == "threshold"] == (
        list(sizes.thresholds)
    )
    assert [
        r["steps_per_block"] for r in mine if r["decoding"] == "static"
    ] == list(sizes.steps_per_block)
    for r in mine:
      assert 0.0 <= r["edit_similarity"] <= 1.0
      assert 0.0 <= r["ar_agreement"] <= 1.0
      assert r["tokens_per_call"] > 0 and r["wall_seconds"] > 0
  compute = summary["compute"]
  assert compute["sft"]["extra_token_slots"] == 0
  assert [s["stage"] for s in compute["sft_kd_certainty_opd"]["stages"]] == [
      "sft", "sft+kd+certainty", "opd"
  ]
  # The heavier certainty term: 4x the weight, the same rows and steps.
  assert compute["sft_kd_certainty_x4"]["stages"][-1]["stage"] == (
      "sft+kd+certainty x4"
  )
  heavy = omegaconf.OmegaConf.load(out / "sft_kd_certainty_x4" / "recipe.yaml")
  assert heavy.diffusion.certainty_weight == 4 * sizes.certainty_weight
  assert heavy.diffusion.block_size == sizes.block_size == 4
  assert compute["sft_kd"]["extra_token_slots"] == (
      sizes.stage_steps * sizes.sft_batch
      * (sizes.prompt_tokens + sizes.completion_tokens + 2)
  )
  assert compute["sft_kd"]["distill_token_slots"] > 0
  # Self-distillation: the x4 stage's own decodes of the same prompts, with
  # the same term, the KD budget again; their decoding counted as inference.
  self_stage = compute["sft_kd_certainty_x4_self"]
  assert [s["stage"] for s in self_stage["stages"]] == [
      "sft", "sft+kd+certainty x4", "sft+self+certainty x4"
  ]
  assert self_stage["extra_token_slots"] == 2 * (
      compute["sft_kd"]["extra_token_slots"]
  )
  (decodes,) = self_stage["self_distill"]
  assert self_stage["distill_token_slots"] == (
      compute["sft_kd"]["distill_token_slots"] + decodes["token_slots"]
  )
  own = _code_corpus.read_jsonl(out / "self_sft_kd_certainty_x4.jsonl")
  distilled = _code_corpus.read_jsonl(out / "distilled.jsonl")
  assert own and {r["prompt"] for r in own} <= {
      r["prompt"] for r in _code_corpus.read_jsonl(out / "distill_prompts.jsonl")
  }
  assert [r["completion"] for r in own] != [r["completion"] for r in distilled]
  again = omegaconf.OmegaConf.load(
      out / "sft_kd_certainty_x4_self" / "recipe.yaml"
  )
  assert again.dataset.train == str(out / "self_sft_kd_certainty_x4.jsonl")
  assert again.model.path == str(out / "sft_kd_certainty_x4_hf")
  assert again.diffusion.certainty_weight == 4 * sizes.certainty_weight
  # The teacher completed the train prompts and more prefixes of train files.
  prompts = _code_corpus.read_jsonl(out / "distill_prompts.jsonl")
  train = _code_corpus.read_jsonl(out / "sft_train.jsonl")
  assert [p["prompt"] for p in prompts[: len(train)]] == [
      r["prompt"] for r in train
  ]
  assert len(train) < len(prompts) <= sizes.distill_prompts
  assert summary["num_rows"]["distill_prompts"] == len(prompts)
  # The AR peer converted on its own outputs: its causal fine-tuning is the
  # chain's first stage, the KD stage the extra.
  peer = compute["peer_kd_certainty"]
  assert [s["stage"] for s in peer["stages"]] == [
      "ar_peer (causal)", "sft+kd+certainty"
  ]
  assert peer["extra_token_slots"] == compute["sft_kd"]["extra_token_slots"]
  recipe = (out / "peer_kd_certainty" / "recipe.yaml").read_text()
  assert str(out / "ar_peer") in recipe
  assert (out / "convert_code.png").stat().st_size > 1000

  # convert_speed re-decodes the finished run: the same tokens as the run's
  # own evaluation (at its batch), next to the Sampler's one-step cost.
  for bad, rule in (
      (["--stages", "nope"], "lacks .*nope"),
      (["--stages", "sft_kd", "--batch", "0"], "--batch must be sizes >= 1"),
      (["--stages", "sft_kd", "--thresholds", "1.5"], "--thresholds must be"),
      (["--stages", ","], "--stages must be non-empty"),
  ):
    with pytest.raises(SystemExit, match=rule):
      convert_speed.main([str(out), *bad])
  assert convert_speed.main([
      str(out), "--stages", "sft_kd", "--thresholds", "0.9",
      "--batch", str(sizes.eval_batch), "--repeats", "1",
  ]) == 0
  speed = json.loads((out / "speed_cpu.json").read_text())["points"]
  peer, kd = speed
  assert peer["model"] == "ar_peer" and peer["ar_agreement"] == 1.0
  assert peer["edit_similarity"] == ar["edit_similarity"]
  assert 0 < peer["one_step_seconds"] and peer["speedup"] == 1.0
  (kd_row,) = [
      r for r in rows if r["model"] == "sft_kd" and r["threshold"] == 0.9
  ]
  for key in ("tokens_per_call", "edit_similarity", "ar_agreement"):
    assert kd[key] == pytest.approx(kd_row[key]), key
  assert kd["speedup"] == pytest.approx(peer["seconds"] / kd["seconds"])
  assert "ar_peer, 1 step (fixed cost)" in convert_speed.table(speed, "cpu")

  # convert_agreement: a causal student on the KD rows as the yardstick.
  with pytest.raises(SystemExit, match="--sample must be >= 1"):
    convert_agreement.main([str(out), "--stages", "sft_kd", "--sample", "0"])
  with pytest.raises(SystemExit, match="lacks .*nope"):
    convert_agreement.main([str(out), "--stages", "nope"])
  assert convert_agreement.main([
      str(out), "--stages", "sft_kd", "--thresholds", "0.9", "--steps", "2",
      "--sample", "3", "--batch", str(sizes.eval_batch),
  ]) == 0
  agreement = json.loads((out / "agreement.json").read_text())
  assert agreement["causal_student"]["steps"] == 2
  got = {(r["prompts"], r["model"]): r for r in agreement["points"]}
  assert set(got) == {
      (p, m) for p in ("held_out", "kd_prompts")
      for m in ("ar_peer", "causal_student", "sft_kd")
  }
  assert got["held_out", "ar_peer"]["ar_agreement"] == 1.0
  # The held-out decoding is the run's own (same stage, threshold, batch).
  assert got["held_out", "sft_kd"]["ar_agreement"] == pytest.approx(
      kd_row["ar_agreement"]
  )
  for r in agreement["points"]:
    assert 0.0 <= r["ar_agreement"] <= 1.0
