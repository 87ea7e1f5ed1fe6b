"""How far can agreement with the AR peer go? A causal student as yardstick.

Issue 17 asks the converted model to agree with its AR teacher's greedy
output (edit similarity of the first 64 tokens >= 0.8). This script asks
whether the block-diffusion objective is what holds agreement back, or the
distillation data and the model's size. For a finished `convert_code.py`
run it

1. trains a *causal* student from the same base (`RUN/ar_base`) on the same
   rows as the KD stages (the AR peer's greedy completions,
   `RUN/distilled.jsonl`), with the first named stage's own budget (its
   recipe's steps, batch, sequence length and learning-rate schedule), using
   the benchmark's causal trainer (Tunix `PeftTrainer`);
2. decodes two prompt sets: the held-out rows (`RUN/sft_eval.jsonl`) and a
   seeded sample of the KD rows' own prompts (rows the students trained on),
   with the AR peer and the causal student (Tunix `Sampler`, greedy) and with
   each named block-diffusion stage under `--thresholds` (1.0: one token per
   call, the most autoregressive a threshold schedule gets);
3. prints every model's agreement with the AR peer on both sets, and writes
   `RUN/agreement.json`.

    python benchmarks/convert_agreement.py RUN --stages sft_kd_certainty
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _causal_lm
import _code_corpus
import _convert_eval
import _convert_stages
import _run_args
import numpy as np
import omegaconf
import transformers

from tunix_blockdiff.runs import common
from tunix_blockdiff.models import checkpoints


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  _run_args.add_run_arguments(
      parser,
      stages_help=(
          "comma-separated block-diffusion stages (RUN/<stage>); the first"
          " one's recipe sets the causal student's budget"
      ),
      thresholds=(0.7, 1.0),
  )
  parser.add_argument(
      "--sample", type=int, default=128, help="KD rows whose prompts to decode"
  )
  parser.add_argument(
      "--steps",
      type=int,
      default=None,
      help="the causal student's steps (default: the first stage's)",
  )
  parser.add_argument("--batch", type=int, default=32, help="decoding batch")
  return parser


def train_causal_student(run: pathlib.Path, recipe, pairs, pad_id, steps):
  """A causal LM from `RUN/ar_base` on the KD `pairs`, `recipe`'s budget."""
  model = checkpoints.load_qwen3(run / "ar_base")
  clock = time.perf_counter()
  losses = _causal_lm.fine_tune(
      model, pairs, recipe, pad_id=pad_id, max_steps=steps
  )
  return model, {
      "steps": steps,
      "batch_size": int(recipe.data.batch_size),
      "learning_rate": float(recipe.training.learning_rate),
      "final_train_loss": float(np.mean(losses[-20:])),
      "train_seconds": time.perf_counter() - clock,
  }


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  run, stages = _run_args.checked_run(
      "convert_agreement",
      args,
      (
          ("--sample", args.sample >= 1, ">= 1"),
          ("--batch", args.batch >= 1, ">= 1"),
          ("--steps", args.steps is None or args.steps >= 1, ">= 1"),
      ),
      needed=("ar_base", _convert_stages.DISTILLED),
  )

  def log(message: str) -> None:
    print(f"[convert_agreement] {message}", file=sys.stderr, flush=True)

  tokenizer = checkpoints.HFTokenizer(run / "ar_peer")
  sampler_tokenizer = transformers.AutoTokenizer.from_pretrained(
      str(run / "ar_peer")
  )
  recipe = omegaconf.OmegaConf.load(run / stages[0] / common.RECIPE_FILE)
  steps = args.steps or int(recipe.training.max_steps)
  kd_rows = _code_corpus.read_jsonl(run / _convert_stages.DISTILLED)
  pairs = [
      common.encode_pair(tokenizer, r["prompt"], r["completion"])
      for r in kd_rows
  ]
  student, training = train_causal_student(
      run, recipe, pairs, tokenizer.pad_id(), steps
  )
  log(f"causal student: {training}")
  pick = np.random.default_rng(0).permutation(len(kd_rows))[: args.sample]
  prompt_sets = {
      "held_out": _code_corpus.read_jsonl(run / "sft_eval.jsonl"),
      "kd_prompts": [kd_rows[i] for i in sorted(pick)],
  }
  peer = checkpoints.load_qwen3(run / "ar_peer")
  # The Sampler's prompt width, as in the run (every KD prompt fits it too).
  width = 1 + _run_args.prompt_tokens(run)
  results = []
  for set_name, rows in prompt_sets.items():

    def greedy(model, rows=rows):
      return _causal_lm.greedy_generate(
          model,
          sampler_tokenizer,
          [r["prompt"] for r in rows],
          max_new_tokens=_convert_eval.COMPARED_TOKENS,
          max_prompt_length=width,
          batch_size=args.batch,
      )[0]

    reference = greedy(peer)
    decoded = {"ar_peer": reference, "causal_student": greedy(student)}
    for name, generated in decoded.items():
      results.append({
          "prompts": set_name,
          "model": name,
          "threshold": None,
          "tokens_per_call": 1.0,
          "ar_agreement": _convert_eval.agreement(generated, reference),
      })
    sizes = _convert_eval.EvalSizes(args.thresholds, args.batch, 1)
    for stage in stages:
      points = _convert_eval.evaluate_converted(
          run / stage,
          tokenizer,
          rows,
          sizes,
          log,
          name=f"{stage} on {set_name}",
          ar_generated=reference,
      )["points"]
      results += [
          {
              "prompts": set_name,
              "model": stage,
              "threshold": p["threshold"],
              "tokens_per_call": p["tokens_per_call"],
              "ar_agreement": p["ar_agreement"],
          }
          for p in points
      ]
  print(table(results, training))
  out = run / "agreement.json"
  out.write_text(
      json.dumps({"causal_student": training, "points": results}, indent=1)
  )
  log(f"wrote {out}")
  return 0


def table(results, training) -> str:
  """One row per (model, decoding): agreement on both prompt sets."""
  lines = [
      f"Agreement with the AR peer's greedy output (first"
      f" {_convert_eval.COMPARED_TOKENS} tokens); causal student:"
      f" {training['steps']} steps, final train loss"
      f" {training['final_train_loss']:.3f}",
      "",
      "| model | decoding | tokens/call | held-out | KD prompts |",
      "|---|---|---:|---:|---:|",
  ]
  keyed = {(r["model"], r["threshold"], r["prompts"]): r for r in results}
  for model, threshold in dict.fromkeys(
      (r["model"], r["threshold"]) for r in results
  ):
    held = keyed[model, threshold, "held_out"]
    kd = keyed[model, threshold, "kd_prompts"]
    decoding = "greedy" if threshold is None else f"threshold {threshold}"
    lines.append(
        f"| {model} | {decoding} | {held['tokens_per_call']:.2f} |"
        f" {held['ar_agreement']:.3f} | {kd['ar_agreement']:.3f} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
