"""Held-out evaluation of `convert_code.py`: AR peer vs converted models.

Quality is measured the same way for both: the generated completion (token
ids before EOS) against the reference body: exact match of the first line
(decoded text) and `metrics.edit_similarity` of the first 64 token ids.
Tokens per model call: committed tokens (with EOS) over the model calls a
row takes part in; the AR peer commits one token per decoding call. Wall
time is measured after one untimed warm-up batch (compilation excluded).
Agreement with the AR peer: the edit similarity of the first 64 tokens of a
model's completion to the AR peer's greedy completion of the same prompt.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Sequence

import _causal_lm
import _timing
import numpy as np
import omegaconf

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import metrics
from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import generate as generate_job
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.rollout import cached

COMPARED_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class EvalSizes:
  """The fields of `convert_code.Sizes` that `evaluate_converted` reads."""

  thresholds: tuple[float, ...]
  eval_batch: int
  timed_repeats: int
  steps_per_block: tuple[int, ...] = ()


def agreement(
    generated: Sequence[Sequence[int]], ar_generated: Sequence[Sequence[int]]
) -> float:
  """Mean edit similarity of the first 64 tokens to the AR peer's output."""
  return float(
      np.mean([
          metrics.edit_similarity(
              list(a)[:COMPARED_TOKENS], list(b)[:COMPARED_TOKENS]
          )
          for a, b in zip(generated, ar_generated, strict=True)
      ])
  )


def score(
    generated: Sequence[Sequence[int]],
    rows: Sequence[dict],
    tokenizer,
    ar_generated: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
  """First-line exact match and 64-token edit similarity, averaged.

  With `ar_generated` (the AR peer's greedy ids per row), also
  `ar_agreement`: the edit similarity of the first 64 tokens to them.
  """
  em, sim = [], []
  for ids, row in zip(generated, rows, strict=True):
    reference = tokenizer.encode(row["completion"])
    sim.append(
        metrics.edit_similarity(
            list(ids)[:COMPARED_TOKENS], reference[:COMPARED_TOKENS]
        )
    )
    em.append(
        metrics.first_line(tokenizer.decode(list(ids)))
        == metrics.first_line(row["completion"])
    )
  out = {
      "first_line_em": float(np.mean(em)),
      "edit_similarity": float(np.mean(sim)),
  }
  if ar_generated is not None:
    out["ar_agreement"] = agreement(generated, ar_generated)
  return out


def _until_eos(ids, eos: int, pad: int) -> list[int]:
  out = []
  for t in ids:
    if t in (eos, pad):
      break
    out.append(int(t))
  return out


def diffusion_generate(
    model,
    examples,
    tokenizer,
    config,
    *,
    batch_size,
    max_new_tokens,
    repeats: int = 1,
):
  """Generated ids (before EOS), tokens per call, timed seconds.

  The seconds are the median of `repeats` passes over every prompt (the
  generation is deterministic: the first pass's outputs are returned).
  """
  prompts, lengths = data_lib.left_padded_prompts(examples, tokenizer.pad_id())
  num = len(examples)

  def batch(start):
    index = np.minimum(np.arange(start, start + batch_size), num - 1)
    return cached.generate(
        model,
        prompts[index],
        lengths[index],
        config,
        max_new_tokens=max_new_tokens,
    )

  def one_pass():
    return [batch(start) for start in range(0, num, batch_size)]

  np.asarray(batch(0).tokens)  # warm-up: compilation is not timed
  results, seconds = _timing.median_seconds(one_pass, repeats)
  generated, committed, calls = [], 0, 0
  for start, result in zip(range(0, num, batch_size), results):
    tokens = np.asarray(result.tokens)
    commit_step = np.asarray(result.commit_step)
    trace_step = np.asarray(result.trace_commit_step)
    for b in range(min(batch_size, num - start)):
      generated.append(
          _until_eos(tokens[b], tokenizer.eos_id(), tokenizer.pad_id())
      )
      committed += int(np.sum(commit_step[b] >= 0))
      calls += int(trace_step[b].max(initial=-1)) + 1
  return generated, committed / max(calls, 1), seconds


def evaluate_converted(
    run_dir, tokenizer, rows, sizes, log, *, name, ar_generated=None
) -> dict:
  """A converted run (an sft, rl or opd output_dir) over the schedules.

  Args:
    run_dir: The run directory (`rl_checkpoints.policy_dir` resolves an
      opd output_dir to its `policy/`).
    tokenizer: The checkpoint's `HFTokenizer`.
    rows: Held-out `{"prompt", "completion"}` rows.
    sizes: The benchmark's `Sizes` (thresholds, schedules, eval batch).
    log: A one-line logger.
    name: The model's name in the log.
    ar_generated: The AR peer's greedy ids per row, for `ar_agreement`.

  Returns:
    `{"points": [...], "samples": [...]}`.
  """
  run_dir = rl_checkpoints.policy_dir(run_dir)
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  model, _ = generate_job.load_trained_model(run_dir, cfg)
  diffusion = common.diffusion_config_from(cfg.diffusion)
  examples = data_lib.as_examples(
      [
          common.encode_pair(tokenizer, r["prompt"], r["completion"])
          for r in rows
      ],
      seq_len=int(cfg.data.seq_len),
      vocab_size=int(model.config.vocab_size),
      mask_token_id=diffusion.mask_token_id,
  )
  settings = [("threshold", t) for t in sizes.thresholds] + [
      ("steps_per_block", s) for s in sizes.steps_per_block
  ]
  points = []
  for kind, value in settings:
    config = config_lib.DenoiseConfig(
        block_size=diffusion.block_size,
        mask_token_id=diffusion.mask_token_id,
        alignment=diffusion.alignment,
        threshold=float(value) if kind == "threshold" else 0.9,
        steps_per_block=int(value) if kind == "steps_per_block" else None,
        eos_token_id=tokenizer.eos_id(),
        pad_token_id=tokenizer.pad_id(),
    )
    generated, tokens_per_call, seconds = diffusion_generate(
        model,
        examples,
        tokenizer,
        config,
        batch_size=sizes.eval_batch,
        max_new_tokens=COMPARED_TOKENS,
        repeats=sizes.timed_repeats,
    )
    point = {
        kind: value,
        "tokens_per_call": tokens_per_call,
        "seconds": seconds,
        **score(generated, rows, tokenizer, ar_generated),
    }
    log(f"{name} {kind}={value}: {point}")
    points.append(point)
  return {
      "points": points,
      "samples": [
          {"prompt": r["prompt"], "reference": r["completion"]}
          for r in rows[:3]
      ],
  }


def ar_peer(
    cfg, hf_tokenizer, tokenizer, rows, sizes, log, *, save_dir=None
) -> dict:
  """Causal fine-tuning of `cfg.model.path` with the sft recipe's budget.

  `cfg` is the full fine-tuning sft recipe: the same steps, batch size,
  learning-rate schedule and sequence length as the converted model's run.
  With `save_dir` the fine-tuned peer is saved there as a Hugging Face
  directory (the distillation teacher). The result's `generated` holds its
  greedy ids per held-out row (for the agreement of the other models).
  """
  model = checkpoints.load_qwen3(cfg.model.path)
  pairs = [
      common.encode_pair(tokenizer, r["prompt"], r["completion"])
      for r in rows["train"]
  ]
  steps = int(cfg.training.max_steps)
  clock = time.perf_counter()
  losses = _causal_lm.fine_tune(model, pairs, cfg, pad_id=tokenizer.pad_id())
  train_seconds = time.perf_counter() - clock
  log(
      f"AR peer: {steps} causal steps in {train_seconds:.0f}s, final loss"
      f" {np.mean(losses[-10:]):.3f}"
  )
  if save_dir is not None:
    hf_export.save_qwen3_hf(
        model,
        save_dir,
        tokenizer_json=pathlib.Path(cfg.model.path).parent / "tokenizer",
        bos_token_id=tokenizer.bos_id(),
        eos_token_id=tokenizer.eos_id(),
        pad_token_id=tokenizer.pad_id(),
    )
  prompts = [r["prompt"] for r in rows["eval"]]
  kwargs = dict(
      max_new_tokens=COMPARED_TOKENS,
      max_prompt_length=sizes.prompt_tokens + 1,
      batch_size=sizes.eval_batch,
  )
  generated, seconds = _causal_lm.greedy_generate(
      model,
      hf_tokenizer,
      prompts,
      warmup=True,
      repeats=sizes.timed_repeats,
      **kwargs,
  )
  point = {
      "tokens_per_call": 1.0,
      "seconds": seconds,
      **score(generated, rows["eval"], tokenizer),
  }
  log(f"AR peer (Tunix Sampler, greedy): {point}")
  return {
      "points": [point],
      "generated": [list(map(int, g)) for g in generated],
      "train_seconds": train_seconds,
      "final_train_loss": float(np.mean(losses[-10:])),
      "learning_rate": float(cfg.training.learning_rate),
      "batch_size": int(cfg.data.batch_size),
      "steps": steps,
  }
