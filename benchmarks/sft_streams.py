"""Which training stream generates best? single vs two_stream vs clean_prefix.

Runs the default SFT recipe (`recipes/tiny.yaml`: a ~0.6M-parameter Qwen3
from scratch on reversing 6-10 digit strings, block 8) once per stream, at
the same number of steps, seed and data, and evaluates each model the same
way: block-KV-cached `generate` on the same held-out prompts, where earlier
blocks are always clean. Reported per stream: exact match and committed
tokens per model call at the recipe's threshold, the best exact match over
the threshold sweep, the eval loss under the stream's own objective (not
comparable across streams: each is a different corruption of the context),
and the eval loss of the *two-stream* objective, which scores every model
on the context it meets at inference.

    python benchmarks/sft_streams.py                    # the README table
    python benchmarks/sft_streams.py training.max_steps=300   # any override
    tunix-blockdiff bench sft_streams [overrides]        # the same, via the CLI
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys

from tunix_blockdiff import data as data_lib
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import outputs
from tunix_blockdiff.jobs import sft

STREAMS = ("single", "clean_prefix", "two_stream")


def inference_context_loss(cfg, out: pathlib.Path) -> float:
  """The two-stream eval loss of the checkpoint in `out` (clean context)."""
  diffusion = dataclasses.replace(
      common.diffusion_config_from(cfg.diffusion), stream="two_stream"
  )
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  model = common.build_model(cfg.model, seed=int(cfg.seed))
  task_data = common.build_task_data(
      cfg.task,
      tokenizer,
      seq_len=int(cfg.data.seq_len),
      vocab_size=common.model_vocab_size(model),
      mask_token_id=diffusion.mask_token_id,
  )
  batches = data_lib.eval_batches(
      task_data.eval,
      diffusion,
      data_lib.DataConfig(
          seq_len=int(cfg.data.seq_len),
          batch_size=int(cfg.eval.batch_size),
          vocab_size=common.model_vocab_size(model),
          seed=int(cfg.seed),
          completion_fill_id=(
              tokenizer.eos_id() if cfg.data.fill_completion_with_eos else None
          ),
      ),
  )
  # A trainer on the run's checkpoint directory restores its final weights
  # (the trainer always checkpoints its last step when it finishes).
  training = common.make_training_config(cfg, None)
  training.checkpoint_root_directory = str(out.resolve() / "checkpoints")
  trainer = trainer_lib.BlockDiffusionTrainer(
      model, common.make_optimizer(cfg.training), training, diffusion
  )
  if trainer.train_steps != int(cfg.training.max_steps):
    raise RuntimeError(f"no final checkpoint in {out}")
  return outputs.eval_loss(trainer, batches)


def main(argv: list[str]) -> int:
  root = pathlib.Path("runs/sft_streams")
  rows = []
  for stream in STREAMS:
    out = root / stream
    # A fresh run each time: the job resumes from checkpoints it finds.
    shutil.rmtree(out, ignore_errors=True)
    cfg = common.load_recipe(
        ["tiny.yaml", *argv, f"diffusion.stream={stream}", f"output_dir={out}"]
    )
    summary = sft.run(cfg)
    best = max(
        summary["threshold_sweep"],
        key=lambda r: (r["exact_match"], r["tokens_per_step"]),
    )
    rows.append({
        "stream": stream,
        "steps": summary["train_steps"],
        "exact_match": summary["eval_exact_match"],
        "tokens_per_step": summary["tokens_per_step"],
        "threshold": summary["threshold"],
        "best_sweep": best,
        "own_eval_loss": summary["eval_loss"],
        "clean_context_loss": inference_context_loss(
            cfg, pathlib.Path(cfg.output_dir)
        ),
        "train_seconds": summary["train_seconds"],
    })
    print(json.dumps(rows[-1]), flush=True)

  (root / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
  print(
      f"\n{cfg.task.name}, {rows[0]['steps']} steps, block"
      f" {cfg.diffusion.block_size}, threshold {rows[0]['threshold']:g},"
      f" {cfg.task.num_eval} held-out prompts\n"
  )
  print(
      "| stream | exact match | tokens / call | best EM in sweep (tokens /"
      " call) | eval loss (own objective) | eval loss (clean context) |"
      " train s |"
  )
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    b = r["best_sweep"]
    print(
        f"| {r['stream']} | {r['exact_match']:.3f} | {r['tokens_per_step']:.2f}"
        f" | {b['exact_match']:.3f} ({b['tokens_per_step']:.2f}) |"
        f" {r['own_eval_loss']:.4f} | {r['clean_context_loss']:.4f} |"
        f" {r['train_seconds']:.0f} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
