"""Convert a pretrained autoregressive model on real code; what is kept?

The corpus is the running Python's standard library source (`sysconfig`; no
download), or any source tree of Python files (`--corpus DIR`, e.g. an
installed package's directory), split by top-level entry with a fixed seed:
held-out modules are never seen by the tokenizer, pretraining or fine-tuning.
The script

1. trains a byte-level BPE tokenizer (HF `tokenizers`) on the training
   modules and saves it (`tokenizer.json` + `tokenizer_config.json`);
2. pretrains a small Tunix Qwen3 as a causal LM with Tunix's `PeftTrainer`
   and saves it as a Hugging Face directory (`hf_export.save_qwen3_hf`);
3. writes fine-tuning rows as jsonl: prompt = a documented function's
   signature + docstring, completion = its body (whole lines, <= a token
   budget); train rows from training modules, eval rows from held-out ones;
4. fine-tunes the checkpoint causally on the train rows (the AR peer) and
   saves it as a Hugging Face directory (`RUN/ar_peer`), the teacher;
5. runs the conversion recipe chain (`_convert_stages.py`), each stage a
   `tunix-blockdiff` command on the previous stage's output: `sft
   convert_code.yaml model.path=RUN/ar_base ...` (full and LoRA), then
   sequence-level KD (`distill-data RUN/ar_peer` on the train prompts,
   `export`, `sft` on those rows), the certainty term
   (`diffusion.certainty_weight`), OPD from the AR peer (`opd
   teacher.kind=hf`), and all of them combined; and the AR peer itself
   converted on its own outputs (`sft model.path=RUN/ar_peer` on the
   distilled rows, with the certainty term);
6. evaluates on the held-out rows: the AR peer with Tunix's `Sampler`
   (greedy) against every stage with `tunix_blockdiff.generate` (a threshold
   sweep and static `steps_per_block` schedules), in this process: edit
   similarity of the first 64 tokens to the reference and to the AR peer's
   output, tokens per model call and wall time (the median of
   `timed_repeats` passes); writes `summary.json`
   (`"rows"`: one object per point) and `convert_code.png`.

    python benchmarks/convert_code.py                 # the README table
    python benchmarks/convert_code.py --quick         # a minute-long smoke run
    python benchmarks/convert_code.py --corpus DIR    # another source tree
    tunix-blockdiff bench convert_code [--out DIR]    # the same, via the CLI
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _code_corpus
import _convert_eval
import _convert_report
import _convert_stages
import _pretrain

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.runs import common


# Run only when named with --stages (the quick run runs them too): the AR peer
# converted on its own outputs measured no better than converting the base
# (docs/conversion.md); its time goes to `sft_kd_certainty_x4` instead.
OPT_IN_STAGES = ("peer_kd_certainty",)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Everything that sets the benchmark's cost."""

  vocab_size: int = 1024
  num_layers: int = 2
  embed_dim: int = 128
  hidden_dim: int = 384
  num_heads: int = 4
  head_dim: int = 32
  num_kv_heads: int = 2
  pretrain_steps: int = 800
  pretrain_seq_len: int = 128
  pretrain_batch: int = 16
  pretrain_lr: float = 2e-3
  prompt_tokens: int = 63  # BOS + prompt <= 64
  completion_tokens: int = 63  # completion + EOS <= 64
  max_train_rows: int | None = None
  max_eval_rows: int = 128
  sft_steps: int = 300
  sft_batch: int = 16
  lora_lr: float = 3e-3
  # The AR peer completes the train rows' prompts, plus more function
  # prefixes of the training modules up to this many prompts in all (the KD
  # rows); 0: the train rows' prompts only.
  distill_prompts: int = 0
  stage_steps: int = 600  # each KD sft stage (on the AR peer's outputs)
  certainty_weight: float = 0.5
  block_size: int = 4  # every sft stage's diffusion.block_size
  certainty_temperature: float = 1.0
  # The threshold at which a self-distillation stage decodes its own rows:
  # the grid's highest (fixed in advance).
  self_threshold: float = 0.9
  opd_steps: int = 40
  opd_prompts: int = 8
  opd_lr: float = 3e-4
  opd_eval_prompts: int = 16
  stages: tuple[str, ...] = tuple(
      s.name for s in _convert_stages.STAGES if s.name not in OPT_IN_STAGES
  )
  thresholds: tuple[float, ...] = (0.5, 0.7, 0.9)
  steps_per_block: tuple[int, ...] = (1, 2)
  eval_batch: int = 32
  timed_repeats: int = 3  # wall time: the median of this many passes
  eval_fraction: float = 0.15
  seed: int = 0


QUICK = Sizes(
    vocab_size=300,
    num_layers=1,
    embed_dim=32,
    hidden_dim=64,
    num_heads=2,
    head_dim=16,
    num_kv_heads=1,
    pretrain_steps=3,
    pretrain_seq_len=64,
    pretrain_batch=4,
    prompt_tokens=160,
    completion_tokens=40,
    max_train_rows=32,
    max_eval_rows=4,
    distill_prompts=48,
    sft_steps=2,
    sft_batch=4,
    stage_steps=2,
    opd_steps=1,
    opd_prompts=2,
    opd_eval_prompts=2,
    stages=tuple(s.name for s in _convert_stages.STAGES if not s.lora),
    thresholds=(0.9,),
    steps_per_block=(2,),
    eval_batch=4,
    timed_repeats=1,
)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="runs/convert_code")
  parser.add_argument(
      "--quick",
      action="store_true",
      help="tiny sizes: a smoke run of every stage",
  )
  parser.add_argument(
      "--corpus",
      "--stdlib",
      dest="corpus",
      default=None,
      help=(
          "a source tree of Python files, grouped by top-level entry"
          " (default: sysconfig's stdlib; --stdlib is an alias)"
      ),
  )
  parser.add_argument(
      "--max-modules",
      type=int,
      default=None,
      help="use only the first N modules (smoke runs)",
  )
  parser.add_argument(
      "--stage-steps",
      type=int,
      default=None,
      help="steps of each KD sft stage, on the distilled rows (default: Sizes)",
  )
  parser.add_argument(
      "--distill-prompts",
      type=int,
      default=None,
      help=(
          "prompts the AR peer completes for the KD rows: the train rows'"
          " plus function prefixes of the train modules (default: Sizes)"
      ),
  )
  parser.add_argument(
      "--certainty-weight",
      type=float,
      default=None,
      help=(
          "the certainty stages' base weight (sft_kd_certainty_x4: 4x it;"
          " default: Sizes)"
      ),
  )
  parser.add_argument(
      "--block-size",
      type=int,
      default=None,
      help="every sft stage's diffusion.block_size (default: Sizes, 4)",
  )
  parser.add_argument(
      "--stages",
      default=None,
      help=(
          "comma-separated stages to run (parents run first); default: all"
          f" but {', '.join(OPT_IN_STAGES)}"
      ),
  )
  return parser


def split_corpus(root, sizes: Sizes, max_modules: int | None):
  """(train modules, eval modules, train files, eval files) of a corpus."""
  groups = _code_corpus.modules(root)
  if max_modules:
    groups = dict(sorted(groups.items())[:max_modules])
  train_mods, eval_mods = _code_corpus.split_modules(
      groups, eval_fraction=sizes.eval_fraction, seed=sizes.seed
  )
  return (
      train_mods,
      eval_mods,
      [f for m in train_mods for f in groups[m]],
      [f for m in eval_mods for f in groups[m]],
  )


def write_rows(sizes: Sizes, tokenizer, files, out: pathlib.Path, root):
  """Train and eval `{"prompt", "completion"}` rows, written as jsonl."""
  rows = {}
  for split, cap in (
      ("train", sizes.max_train_rows),
      ("eval", sizes.max_eval_rows),
  ):
    rows[split] = _code_corpus.sft_rows(
        files[split],
        tokenizer,
        prompt_tokens=sizes.prompt_tokens,
        completion_tokens=sizes.completion_tokens,
        max_rows=cap,
        seed=sizes.seed,
    )
    if not rows[split]:
      raise SystemExit(
          f"convert_code: the {split} modules of {root} have no documented"
          " function within the token budgets: no rows to train or evaluate"
      )
    _code_corpus.write_jsonl(rows[split], out / f"sft_{split}.jsonl")
  prompts = _code_corpus.distill_prompts(
      files["train"],
      tokenizer,
      base=[r["prompt"] for r in rows["train"]],
      prompt_tokens=sizes.prompt_tokens,
      num_prompts=max(sizes.distill_prompts, len(rows["train"])),
      seed=sizes.seed,
  )
  _code_corpus.write_jsonl(prompts, out / _convert_stages.DISTILL_PROMPTS)
  rows["distill_prompts"] = prompts
  return rows


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  sizes = QUICK if args.quick else Sizes()
  for field, value, ok, rule in (
      ("stage_steps", args.stage_steps, lambda v: v >= 1, ">= 1"),
      ("distill_prompts", args.distill_prompts, lambda v: v >= 0, ">= 0"),
      ("certainty_weight", args.certainty_weight, lambda v: v > 0, "> 0"),
      ("block_size", args.block_size, lambda v: v >= 1, ">= 1"),
  ):
    if value is None:
      continue
    if not ok(value):
      flag = "--" + field.replace("_", "-")
      raise SystemExit(f"{flag} must be {rule}, got {value}")
    sizes = dataclasses.replace(sizes, **{field: value})
  if args.stages is not None:
    names = tuple(n for n in args.stages.split(",") if n)
    known = _convert_stages.by_name()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
      raise SystemExit(
          f"--stages must name stages among {sorted(known)}, got"
          f" {args.stages!r}"
      )
    sizes = dataclasses.replace(sizes, stages=names)
  out = pathlib.Path(args.out).expanduser().resolve()
  out.mkdir(parents=True, exist_ok=True)
  clock = time.perf_counter()

  def log(message: str) -> None:
    print(
        f"[convert_code {time.perf_counter() - clock:6.0f}s] {message}",
        file=sys.stderr,
        flush=True,
    )

  root = (
      pathlib.Path(args.corpus).expanduser().resolve()
      if args.corpus
      else _code_corpus.stdlib_root()
  )
  train_mods, eval_mods, train_files, eval_files = split_corpus(
      root, sizes, args.max_modules
  )
  log(
      f"{len(train_mods)} train modules ({len(train_files)} files),"
      f" {len(eval_mods)} eval modules ({len(eval_files)} files)"
  )
  tokenizer = _code_corpus.train_tokenizer(
      (t for t in map(_code_corpus.read_text, train_files) if t),
      out / "tokenizer",
      vocab_size=sizes.vocab_size,
  )
  pretraining = _pretrain.pretrain(
      sizes, tokenizer, train_files, out / "ar_base", log
  )
  rows = write_rows(
      sizes, tokenizer, {"train": train_files, "eval": eval_files}, out, root
  )
  log(
      f"{len(rows['train'])} train rows, {len(rows['eval'])} eval rows,"
      f" {len(rows['distill_prompts'])} distillation prompts"
  )

  hf_tok = checkpoints.HFTokenizer(out / "ar_base")
  # The AR peer: the first sft stage's steps, batch, schedule and width.
  peer_cfg = common.load_recipe(
      _convert_stages.sft_args(sizes, out, _convert_stages.Stage("ar", "sft"))
  )
  results = {
      "ar_peer": _convert_eval.ar_peer(
          peer_cfg,
          tokenizer,
          hf_tok,
          rows,
          sizes,
          log,
          save_dir=out / "ar_peer",
      )
  }
  ar_generated = results["ar_peer"].pop("generated")
  stages = [s for s in _convert_stages.STAGES if s.name in sizes.stages]
  peer = results["ar_peer"]
  peer_training = _convert_stages.compute(
      "ar_peer (causal)",
      peer["steps"],
      peer["batch_size"],
      _convert_stages.row_tokens(sizes),
      peer["train_seconds"],
  )
  compute = _convert_stages.run_all(
      sizes, out, log, stages, sources={"ar_peer": peer_training}
  )
  for stage in stages:
    results[stage.name] = _convert_eval.evaluate_converted(
        out / stage.name,
        hf_tok,
        rows["eval"],
        sizes,
        log,
        name=stage.name,
        ar_generated=ar_generated,
    )
    results[stage.name]["train_seconds"] = compute[stage.name]["train_seconds"]
  summary = _convert_report.summarize(
      results,
      compute=compute,
      sizes=dataclasses.asdict(sizes),
      pretraining=pretraining,
      corpus={"name": _code_corpus.corpus_name(args.corpus), "root": str(root)},
      modules={"train": train_mods, "eval": eval_mods},
      num_rows={k: len(v) for k, v in rows.items()},
      seconds=time.perf_counter() - clock,
  )
  common.write_summary(out, summary)
  _convert_report.plot(out / "convert_code.png", summary)
  print(_convert_report.table(summary))
  log(f"wrote {out / common.SUMMARY_FILE} and {out / 'convert_code.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
