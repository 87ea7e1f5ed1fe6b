"""Re-time a finished `convert_code.py` run on this machine, side by side.

`convert_code.py` trains and evaluates on one 2-core CPU, where a block call
costs 2.5-2.8 AR decoding steps, so its wall-time ratio says little about an
accelerator, where a call's cost is nearly flat in its rows. This script
loads what a run left behind (`RUN/ar_peer`, the converted stages'
`output_dir`s, the held-out rows `RUN/sft_eval.jsonl` and the tokenizer)
and decodes the same held-out prompts on the current JAX backend, in one
process, at each `--batch`:

* the AR peer with Tunix's `Sampler` (greedy, its KV cache), as
  `convert_code.py` does;
* each stage with `tunix_blockdiff.generate` under each `--thresholds`
  schedule (the exact block-KV-cached driver).

Every program is warmed up (compiled) on its first batch, then timed as the
median of `--repeats` passes over every prompt. The `Sampler` is also timed
with one generation step: its fixed cost per pass (tokenizing the prompts,
prefill, detokenizing), which a block decoder given token ids skips. Each
point reports edit similarity to the reference, agreement with the AR
peer's output (both over the first 64 tokens, as `convert_code.py`), tokens
per call and seconds, and the AR peer's seconds over its own at the same
batch (`speedup`). The table is printed and written to
`RUN/speed_<platform>.json`.

    python benchmarks/convert_code.py --out RUN     # train (CPU is fine)
    python benchmarks/convert_speed.py RUN --stages sft_kd_certainty
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# pylint: disable=g-import-not-at-top,wrong-import-position
import _causal_lm
import _code_corpus
import _convert_eval
import _run_args
import jax
import transformers

from tunix_blockdiff.models import checkpoints


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  _run_args.add_run_arguments(
      parser,
      stages_help="comma-separated converted stages (RUN/<stage>) to decode",
      thresholds=(0.5, 0.7, 0.9),
  )
  parser.add_argument(
      "--batch",
      type=_run_args.comma_ints,
      default=(32,),
      help="comma-separated batch sizes",
  )
  parser.add_argument("--repeats", type=int, default=5)
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  run, stages = _run_args.checked_run(
      "convert_speed",
      args,
      (
          ("--batch", bool(args.batch) and min(args.batch) >= 1, "sizes >= 1"),
          ("--repeats", args.repeats >= 1, ">= 1"),
      ),
  )

  def log(message: str) -> None:
    print(f"[convert_speed] {message}", file=sys.stderr, flush=True)

  rows = _code_corpus.read_jsonl(run / "sft_eval.jsonl")
  # The run's prompt budget sets the Sampler's prompt width, as it did there.
  prompt_tokens = _run_args.prompt_tokens(run)
  tokenizer = checkpoints.HFTokenizer(run / "ar_peer")
  sampler_tokenizer = transformers.AutoTokenizer.from_pretrained(
      str(run / "ar_peer")
  )
  peer = checkpoints.load_qwen3(run / "ar_peer")
  platform = jax.devices()[0].platform
  log(f"{len(rows)} held-out rows, {jax.devices()[0].device_kind}")
  points = []
  for batch in args.batch:

    def sampler(new_tokens, batch=batch):
      return _causal_lm.greedy_generate(
          peer,
          sampler_tokenizer,
          [r["prompt"] for r in rows],
          max_new_tokens=new_tokens,
          max_prompt_length=prompt_tokens + 1,
          batch_size=batch,
          warmup=True,
          repeats=args.repeats,
      )

    # The Sampler's fixed cost per pass: tokenizing, prefill, detokenizing.
    _, fixed = sampler(1)
    generated, seconds = sampler(_convert_eval.COMPARED_TOKENS)
    ar = {
        "model": "ar_peer",
        "batch": batch,
        "threshold": None,
        "tokens_per_call": 1.0,
        "seconds": seconds,
        "speedup": 1.0,
        "one_step_seconds": fixed,
        **_convert_eval.score(generated, rows, tokenizer, generated),
    }
    log(str(ar))
    points.append(ar)
    sizes = _convert_eval.EvalSizes(args.thresholds, batch, args.repeats)
    for stage in stages:
      result = _convert_eval.evaluate_converted(
          run / stage,
          tokenizer,
          rows,
          sizes,
          log,
          name=f"{stage} batch {batch}",
          ar_generated=generated,
      )
      for point in result["points"]:
        points.append({
            "model": stage,
            "batch": batch,
            **point,
            "speedup": seconds / point["seconds"],
        })
  print(table(points, jax.devices()[0].device_kind))
  out = run / f"speed_{platform}.json"
  out.write_text(
      json.dumps(
          {"device": jax.devices()[0].device_kind, "points": points}, indent=1
      )
  )
  log(f"wrote {out}")
  return 0


def table(points, device: str) -> str:
  """The points as a markdown table, each AR row after its one-step cost."""
  lines = [
      f"Held-out prompts decoded on {device} (median of timed passes):",
      "",
      "| model | batch | threshold | tokens/call | edit sim. | agreement |"
      " seconds | speed-up vs AR |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for p in points:
    if p["model"] == "ar_peer":
      lines.append(
          f"| ar_peer, 1 step (fixed cost) | {p['batch']} | greedy | |"
          f" | | {p['one_step_seconds']:.3f} | |"
      )
    threshold = "greedy" if p["threshold"] is None else p["threshold"]
    lines.append(
        f"| {p['model']} | {p['batch']} | {threshold} |"
        f" {p['tokens_per_call']:.2f} | {p['edit_similarity']:.3f} |"
        f" {p['ar_agreement']:.3f} | {p['seconds']:.3f} |"
        f" {p['speedup']:.2f}x |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
