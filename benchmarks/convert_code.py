"""Convert a pretrained autoregressive model on real code; what is kept?

The corpus is the running Python's standard library source (`sysconfig`; no
download), split by top-level module with a fixed seed: held-out modules are
never seen by the tokenizer, pretraining or fine-tuning. The script

1. trains a byte-level BPE tokenizer (HF `tokenizers`) on the training
   modules and saves it (`tokenizer.json` + `tokenizer_config.json`);
2. pretrains a small Tunix Qwen3 as a causal LM with Tunix's `PeftTrainer`
   and saves it as a Hugging Face directory (`hf_export.save_qwen3_hf`);
3. writes fine-tuning rows as jsonl: prompt = a documented function's
   signature + docstring, completion = its body (whole lines, <= a token
   budget); train rows from training modules, eval rows from held-out ones;
4. converts the checkpoint with `tunix-blockdiff sft convert_code.yaml
   model.path=... dataset.train=... dataset.eval=...` (it loads through
   `model.kind: qwen3_hf`, as a real Qwen3 does): full fine-tuning and LoRA;
5. fine-tunes the same checkpoint causally on the same rows, with the same
   steps, batch and learning rate (the AR peer);
6. evaluates on the held-out rows: the AR peer with Tunix's `Sampler`
   (greedy) against the converted models with `tunix_blockdiff.generate`
   (a threshold sweep and static `steps_per_block` schedules): first-line
   exact match, edit similarity of the first 64 tokens, tokens per model
   call and wall time; writes `summary.json` and `convert_code.png`.

    python benchmarks/convert_code.py                 # the README table
    python benchmarks/convert_code.py --quick         # a minute-long smoke run
    tunix-blockdiff bench convert_code [--out DIR]    # the same, via the CLI
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _causal_lm
import _code_corpus
import _convert_eval
from flax import nnx
import numpy as np
import omegaconf
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.jobs import common

RECIPE = (
    pathlib.Path(__file__).resolve().parents[1]
    / "recipes"
    / "convert_code.yaml"
)


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
  thresholds: tuple[float, ...] = (0.5, 0.7, 0.9)
  steps_per_block: tuple[int, ...] = (1, 2)
  eval_batch: int = 32
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
    sft_steps=2,
    sft_batch=4,
    thresholds=(0.9,),
    steps_per_block=(2,),
    eval_batch=4,
)


def optimizer(steps: int, lr: float, warmup: int):
  return common.make_optimizer(
      omegaconf.OmegaConf.create({
          "max_steps": steps,
          "warmup_steps": warmup,
          "learning_rate": lr,
          "final_lr_fraction": 0.1,
          "weight_decay": 0.0,
          "adam_b2": 0.99,
          "grad_clip": 1.0,
      })
  )


def pretrain(sizes: Sizes, tokenizer, files, out: pathlib.Path, log) -> dict:
  """Tokenizer-encoded training modules -> a causal Qwen3 -> `out` (HF)."""
  config = tiny_models.qwen3_config(
      len(tokenizer),
      num_layers=sizes.num_layers,
      embed_dim=sizes.embed_dim,
      hidden_dim=sizes.hidden_dim,
      num_heads=sizes.num_heads,
      head_dim=sizes.head_dim,
      num_kv_heads=sizes.num_kv_heads,
  )
  # Tunix 0.1.7 initialises feed-forward kernels to zero, a saddle where they
  # never receive a gradient: draw them, or the pretrained model has no MLPs.
  model = tiny_models.random_mlps(
      qwen3_lib.Qwen3(config, rngs=nnx.Rngs(sizes.seed)), sizes.seed
  )
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  documents = []
  for path in files:
    text = _code_corpus.read_text(path)
    if text:
      documents.append([bos] + tokenizer.encode(text) + [eos])
  num_tokens = sum(len(d) for d in documents)
  log(f"pretraining on {len(documents)} files, {num_tokens} tokens")
  start = time.perf_counter()
  losses = _causal_lm.train(
      model,
      optimizer(sizes.pretrain_steps, sizes.pretrain_lr, 50),
      _causal_lm.pretraining_batches(
          documents,
          seq_len=sizes.pretrain_seq_len,
          batch_size=sizes.pretrain_batch,
          seed=sizes.seed,
      ),
      max_steps=sizes.pretrain_steps,
      pad_id=tokenizer.pad_token_id,
  )
  seconds = time.perf_counter() - start
  hf_export.save_qwen3_hf(
      model,
      out,
      tokenizer_json=out.parent / "tokenizer",
      bos_token_id=bos,
      eos_token_id=eos,
      pad_token_id=tokenizer.pad_token_id,
  )
  log(
      f"pretrained {sizes.pretrain_steps} steps in {seconds:.0f}s, final"
      f" loss {np.mean(losses[-20:]):.3f}; saved {out}"
  )
  return {
      "files": len(documents),
      "tokens": num_tokens,
      "steps": sizes.pretrain_steps,
      "tokens_seen": (
          sizes.pretrain_steps * sizes.pretrain_batch * sizes.pretrain_seq_len
      ),
      "final_loss": float(np.mean(losses[-20:])),
      "seconds": seconds,
      "num_params": int(
          sum(
              np.size(v.get_value())
              for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          )
      ),
  }


def sft_overrides(sizes: Sizes, out: pathlib.Path, name: str, lora: bool):
  overrides = [
      f"model.path={out / 'ar_base'}",
      f"dataset.train={out / 'sft_train.jsonl'}",
      f"dataset.eval={out / 'sft_eval.jsonl'}",
      f"output_dir={out / name}",
      f"training.max_steps={sizes.sft_steps}",
      f"training.eval_every_n_steps={max(sizes.sft_steps // 2, 1)}",
      f"training.checkpoint_every_n_steps={sizes.sft_steps}",
      f"data.seq_len={1 + sizes.prompt_tokens + sizes.completion_tokens + 1}",
      f"data.batch_size={sizes.sft_batch}",
      f"eval.batch_size={sizes.eval_batch}",
      f"seed={sizes.seed}",
  ]
  if lora:
    overrides += [
        "lora.enabled=true",
        f"training.learning_rate={sizes.lora_lr}",
    ]
  return overrides


def convert(sizes: Sizes, out: pathlib.Path, name: str, lora: bool, log):
  """`tunix-blockdiff sft convert_code.yaml ...` in a subprocess."""
  command = [
      sys.executable,
      "-m",
      "tunix_blockdiff.cli",
      "sft",
      str(RECIPE),
      *sft_overrides(sizes, out, name, lora),
  ]
  log("$ tunix-blockdiff sft " + " ".join(command[4:]))
  start = time.perf_counter()
  subprocess.run(command, check=True, env=dict(os.environ))
  seconds = time.perf_counter() - start
  summary = json.loads((out / name / common.SUMMARY_FILE).read_text())
  return seconds, summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="runs/convert_code")
  parser.add_argument(
      "--quick",
      action="store_true",
      help="tiny sizes: a smoke run of every step",
  )
  parser.add_argument(
      "--stdlib", default=None, help="corpus root (default: sysconfig's stdlib)"
  )
  parser.add_argument(
      "--max-modules",
      type=int,
      default=None,
      help="use only the first N modules (smoke runs)",
  )
  args = parser.parse_args(argv)
  sizes = QUICK if args.quick else Sizes()
  out = pathlib.Path(args.out).expanduser().resolve()
  out.mkdir(parents=True, exist_ok=True)
  clock = time.perf_counter()

  def log(message: str) -> None:
    print(
        f"[convert_code {time.perf_counter() - clock:6.0f}s] {message}",
        file=sys.stderr,
        flush=True,
    )

  groups = _code_corpus.modules(args.stdlib)
  if args.max_modules:
    groups = dict(sorted(groups.items())[: args.max_modules])
  train_mods, eval_mods = _code_corpus.split_modules(
      groups, eval_fraction=sizes.eval_fraction, seed=sizes.seed
  )
  train_files = [f for m in train_mods for f in groups[m]]
  eval_files = [f for m in eval_mods for f in groups[m]]
  log(
      f"{len(train_mods)} train modules ({len(train_files)} files),"
      f" {len(eval_mods)} eval modules ({len(eval_files)} files)"
  )

  tokenizer = _code_corpus.train_tokenizer(
      (t for t in map(_code_corpus.read_text, train_files) if t),
      out / "tokenizer",
      vocab_size=sizes.vocab_size,
  )
  pretraining = pretrain(sizes, tokenizer, train_files, out / "ar_base", log)

  rows = {}
  for split, files, cap in (
      ("train", train_files, sizes.max_train_rows),
      ("eval", eval_files, sizes.max_eval_rows),
  ):
    rows[split] = _code_corpus.sft_rows(
        files,
        tokenizer,
        prompt_tokens=sizes.prompt_tokens,
        completion_tokens=sizes.completion_tokens,
        max_rows=cap,
        seed=sizes.seed,
    )
    _code_corpus.write_jsonl(rows[split], out / f"sft_{split}.jsonl")
  log(f"{len(rows['train'])} train rows, {len(rows['eval'])} eval rows")

  hf_tok = checkpoints.HFTokenizer(out / "ar_base")
  results = {}
  for name, lora in (("converted_full", False), ("converted_lora", True)):
    seconds, summary = convert(sizes, out, name, lora, log)
    cfg = omegaconf.OmegaConf.load(out / name / common.RECIPE_FILE)
    results[name] = _convert_eval.evaluate_converted(
        out / name, cfg, hf_tok, rows["eval"], sizes, log
    )
    results[name]["train_seconds"] = seconds
    results[name]["final_train_loss"] = summary.get("final_train_loss")

  peer_cfg = common.load_recipe(
      [str(RECIPE)] + sft_overrides(sizes, out, "ar_peer", lora=False)
  )
  results["ar_peer"] = _convert_eval.ar_peer(
      peer_cfg, tokenizer, hf_tok, rows, sizes, log
  )
  summary = _convert_eval.summarize(
      results,
      sizes=dataclasses.asdict(sizes),
      pretraining=pretraining,
      corpus={
          "name": _code_corpus.corpus_name(args.stdlib),
          "root": str(
              pathlib.Path(args.stdlib).expanduser().resolve()
              if args.stdlib
              else _code_corpus.stdlib_root()
          ),
      },
      modules={"train": train_mods, "eval": eval_mods},
      rows={k: len(v) for k, v in rows.items()},
      seconds=time.perf_counter() - clock,
  )
  common.write_summary(out, summary)
  _convert_eval.plot(out / "convert_code.png", summary)
  print(_convert_eval.table(summary))
  log(f"wrote {out / common.SUMMARY_FILE} and {out / 'convert_code.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
