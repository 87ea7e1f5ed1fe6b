"""Held-out evaluation of `convert_code.py`: AR peer vs converted models.

Quality is measured the same way for both: the generated completion (token
ids before EOS) against the reference body: exact match of the first line
(decoded text) and `metrics.edit_similarity` of the first 64 token ids.
Tokens per model call: committed tokens (with EOS) over the model calls a
row takes part in; the AR peer commits one token per decoding call. Wall
time is measured after one untimed warm-up batch (compilation excluded).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import _causal_lm
import numpy as np

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import metrics
from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import generate as generate_job
from tunix_blockdiff.rollout import cached

COMPARED_TOKENS = 64
TARGET_FRACTION = 0.9
TARGET_TOKENS_PER_CALL = 2.0


def score(
    generated: Sequence[Sequence[int]], rows: Sequence[dict], tokenizer
) -> dict[str, float]:
  """First-line exact match and 64-token edit similarity, averaged."""
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
  return {
      "first_line_em": float(np.mean(em)),
      "edit_similarity": float(np.mean(sim)),
  }


def _until_eos(ids, eos: int, pad: int) -> list[int]:
  out = []
  for t in ids:
    if t in (eos, pad):
      break
    out.append(int(t))
  return out


def diffusion_generate(
    model, examples, tokenizer, config, *, batch_size, max_new_tokens
):
  """Generated ids (before EOS), tokens per call, timed seconds."""
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

  np.asarray(batch(0).tokens)  # warm-up: compilation is not timed
  clock = time.perf_counter()
  generated, committed, calls = [], 0, 0
  for start in range(0, num, batch_size):
    result = batch(start)
    tokens = np.asarray(result.tokens)
    commit_step = np.asarray(result.commit_step)
    trace_step = np.asarray(result.trace_commit_step)
    for b in range(min(batch_size, num - start)):
      generated.append(
          _until_eos(tokens[b], tokenizer.eos_id(), tokenizer.pad_id())
      )
      committed += int(np.sum(commit_step[b] >= 0))
      calls += int(trace_step[b].max(initial=-1)) + 1
  return generated, committed / max(calls, 1), time.perf_counter() - clock


def evaluate_converted(run_dir, cfg, tokenizer, rows, sizes, log) -> dict:
  """The converted checkpoint of an sft run over thresholds and schedules."""
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
    )
    point = {
        kind: value,
        "tokens_per_call": tokens_per_call,
        "seconds": seconds,
        **score(generated, rows, tokenizer),
    }
    log(f"{run_dir.name} {kind}={value}: {point}")
    points.append(point)
  return {
      "points": points,
      "samples": [
          {"prompt": r["prompt"], "reference": r["completion"]}
          for r in rows[:3]
      ],
  }


def ar_peer(cfg, hf_tokenizer, tokenizer, rows, sizes, log) -> dict:
  """Causal fine-tuning of `cfg.model.path` with the sft recipe's budget.

  `cfg` is the full fine-tuning sft recipe: the same steps, batch size,
  learning-rate schedule and sequence length as the converted model's run.
  """
  model = checkpoints.load_qwen3(cfg.model.path)
  pairs = [
      common.encode_pair(tokenizer, r["prompt"], r["completion"])
      for r in rows["train"]
  ]
  steps = int(cfg.training.max_steps)
  clock = time.perf_counter()
  losses = _causal_lm.train(
      model,
      common.make_optimizer(cfg.training),
      _causal_lm.sft_batches(
          pairs,
          seq_len=int(cfg.data.seq_len),
          batch_size=int(cfg.data.batch_size),
          pad_id=tokenizer.pad_id(),
          seed=int(cfg.seed),
      ),
      max_steps=steps,
      pad_id=tokenizer.pad_id(),
  )
  train_seconds = time.perf_counter() - clock
  log(
      f"AR peer: {steps} causal steps in {train_seconds:.0f}s, final loss"
      f" {np.mean(losses[-10:]):.3f}"
  )
  prompts = [r["prompt"] for r in rows["eval"]]
  kwargs = dict(
      max_new_tokens=COMPARED_TOKENS,
      max_prompt_length=sizes.prompt_tokens + 1,
      batch_size=sizes.eval_batch,
  )
  _causal_lm.greedy_generate(model, hf_tokenizer, prompts[:1], **kwargs)
  generated, seconds = _causal_lm.greedy_generate(
      model, hf_tokenizer, prompts, **kwargs
  )
  point = {
      "tokens_per_call": 1.0,
      "seconds": seconds,
      **score(generated, rows["eval"], tokenizer),
  }
  log(f"AR peer (Tunix Sampler, greedy): {point}")
  return {
      "points": [point],
      "train_seconds": train_seconds,
      "final_train_loss": float(np.mean(losses[-10:])),
      "learning_rate": float(cfg.training.learning_rate),
      "batch_size": int(cfg.data.batch_size),
      "steps": steps,
  }


def summarize(results: dict, **extra: Any) -> dict:
  """Adds the target verdict per converted model to the results."""
  ar = results["ar_peer"]["points"][0]["edit_similarity"]
  verdicts = {}
  for name, result in results.items():
    if name == "ar_peer":
      continue
    fast = [
        p
        for p in result["points"]
        if p["tokens_per_call"] >= TARGET_TOKENS_PER_CALL
    ]
    best = max(fast, key=lambda p: p["edit_similarity"], default=None)
    kept = best["edit_similarity"] / ar if best and ar > 0 else None
    verdicts[name] = {
        "best_at_2_tokens_per_call": best,
        "fraction_of_ar_edit_similarity": kept,
        "reached": bool(kept is not None and kept >= TARGET_FRACTION),
    }
  return {"results": results, "target": verdicts, **extra}


def _label(point: dict) -> str:
  if "threshold" in point:
    return f"threshold {point['threshold']:g}"
  if "steps_per_block" in point:
    return f"steps_per_block {point['steps_per_block']}"
  return "greedy"


def table(summary: dict) -> str:
  """The README table (markdown)."""
  lines = [
      (
          "| model | decoding | first-line EM | edit sim. (64 tok) |"
          " tokens / call | wall s |"
      ),
      "|---|---|---:|---:|---:|---:|",
  ]
  for name, result in summary["results"].items():
    for p in result["points"]:
      lines.append(
          f"| {name} | {_label(p)} | {p['first_line_em']:.3f} |"
          f" {p['edit_similarity']:.3f} | {p['tokens_per_call']:.2f} |"
          f" {p['seconds']:.1f} |"
      )
  return "\n".join(lines)


def figure_title(summary: dict) -> str:
  """The figure's title, naming the corpus the run used (`summary["corpus"]`)."""
  corpus = (summary.get("corpus") or {}).get("name")
  where = f"{corpus} held-out modules" if corpus else "held-out modules"
  return f"{where}: converted vs AR"


def plot(path, summary: dict) -> None:
  """Edit similarity against tokens per call; the AR point is a star."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  results = summary["results"]
  ar = results["ar_peer"]["points"][0]
  for (name, result), color in zip(
      [(n, r) for n, r in results.items() if n != "ar_peer"],
      ("tab:blue", "tab:orange", "tab:green"),
  ):
    for kind, marker in (("threshold", "o-"), ("steps_per_block", "s--")):
      pts = sorted(
          (p for p in result["points"] if kind in p),
          key=lambda p: p["tokens_per_call"],
      )
      if pts:
        ax.plot(
            [p["tokens_per_call"] for p in pts],
            [p["edit_similarity"] for p in pts],
            marker,
            color=color,
            label=f"{name} ({kind})",
            ms=4,
        )
        for p in pts:
          ax.annotate(
              f"{p[kind]:g}",
              (p["tokens_per_call"], p["edit_similarity"]),
              textcoords="offset points",
              xytext=(3, 4),
              fontsize=7,
          )
  ax.plot(
      [1.0],
      [ar["edit_similarity"]],
      "*",
      color="black",
      ms=14,
      label="AR peer (Tunix Sampler, greedy)",
  )
  ax.axhline(
      TARGET_FRACTION * ar["edit_similarity"],
      color="gray",
      ls=":",
      lw=1,
      label="90% of AR",
  )
  ax.axvline(TARGET_TOKENS_PER_CALL, color="gray", ls="-.", lw=1)
  ax.set_xlabel("committed tokens per model call")
  ax.set_ylabel("edit similarity, first 64 tokens")
  ax.set_title(figure_title(summary), fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
