"""`tunix-blockdiff opd [RECIPE.yaml] [key=value ...]`: on-policy distillation.

With no recipe it runs the bundled `opd_tiny.yaml`:

1. An autoregressive teacher (a Tunix Qwen3, causal) is trained on the tiny
   task with Tunix's `PeftTrainer` and its standard next-token loss; its
   greedy exact match is measured with Tunix's `Sampler`.
2. A weaker block-diffusion student comes from an SFT checkpoint
   (`student.checkpoint`) or a short SFT warm start (the SFT job's API).
3. On-policy distillation inside Tunix's RL loop: the student generates with
   `BlockDiffusionRollout`, the teacher scores the student's tokens in its
   own (causal) context, and the actor trainer minimises the per-token
   divergence (`bd_opd`, reverse KL by default) of the student's
   trajectory-exact distributions to the teacher's.

Prompts are the SFT task's, or rows `{"prompt", "answer"}` of the recipe's
`dataset.train` / `dataset.eval` files (`jobs.rl_data`); the teacher then
trains on the first `teacher.num_train` training rows and OPD uses the rest.

Writes `summary.json` (student exact match and the divergence on held-out
prompts before and after, teacher exact match, `seconds`) and `opd.png`.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Sequence

import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.sft import metrics_logger as metrics_lib
from tunix.sft import peft_trainer

from tunix_blockdiff import tiny_models
from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import rl_common
from tunix_blockdiff.jobs import rl_data
from tunix_blockdiff.jobs import rl_reward
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import opd
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rollout import engine as engine_lib

FIGURE_FILE = "opd.png"
Role = rl_cluster_lib.Role
Mode = rl_cluster_lib.Mode


# -----------------------------------------------------------------------------
# The autoregressive teacher.
# -----------------------------------------------------------------------------


def causal_lm_batches(
    pairs, tokenizer, *, seq_len: int, batch_size: int, seed: int
):
  """Endless next-token batches for Tunix's default PeftTrainer loss.

  Rows are `[BOS prompt answer EOS]`, right-padded; `input_mask` marks the
  answer and EOS (the loss's targets); the attention mask is causal over
  real tokens.
  """
  rows, targets = [], []
  for prompt, answer in pairs:
    prompt_ids, answer_ids = common.encode_pair(tokenizer, prompt, answer)
    ids = prompt_ids + answer_ids
    if len(ids) > seq_len:
      raise ValueError(
          f"example of {len(ids)} tokens exceeds seq_len={seq_len}"
      )
    rows.append(ids + [tokenizer.pad_id()] * (seq_len - len(ids)))
    targets.append(
        [0] * len(prompt_ids)
        + [1] * len(answer_ids)
        + [0] * (seq_len - len(ids))
    )
  rows = np.asarray(rows, np.int32)
  targets = np.asarray(targets, bool)
  valid = rows != tokenizer.pad_id()
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), rows.shape)
  causal = np.tril(np.ones((seq_len, seq_len), bool))
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(rows))
    for start in range(0, len(order) - batch_size + 1, batch_size):
      index = order[start : start + batch_size]
      yield {
          "input_tokens": rows[index],
          "input_mask": targets[index],
          "positions": positions[index],
          "attention_mask": causal[None] & valid[index][:, None, :],
      }


def train_ar_teacher(
    teacher_cfg, tokenizer, vocab_size: int, pairs, *, seq_len: int, seed: int
):
  """A Tunix Qwen3 trained causally (next-token loss) with `PeftTrainer`."""
  model = tiny_models.tiny_qwen3(
      vocab_size,
      seed=seed,
      num_layers=int(teacher_cfg.num_layers),
      embed_dim=int(teacher_cfg.embed_dim),
      hidden_dim=int(teacher_cfg.hidden_dim),
      num_heads=int(teacher_cfg.num_heads),
      head_dim=int(teacher_cfg.head_dim),
      num_kv_heads=int(teacher_cfg.num_kv_heads),
  )
  steps = int(teacher_cfg.steps)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0,
      float(teacher_cfg.learning_rate),
      warmup_steps=min(int(teacher_cfg.warmup_steps), steps - 1),
      decay_steps=steps,
      end_value=0.1 * float(teacher_cfg.learning_rate),
  )
  trainer = peft_trainer.PeftTrainer(
      model,
      optax.chain(
          optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99)
      ),
      peft_trainer.TrainingConfig(
          eval_every_n_steps=10**9,
          max_steps=steps,
          pbar_description="AR teacher",
      ),
  )
  trainer.train(
      causal_lm_batches(
          pairs,
          tokenizer,
          seq_len=seq_len,
          batch_size=int(teacher_cfg.batch_size),
          seed=seed,
      )
  )
  logger = trainer.metrics_logger
  losses = (
      np.asarray(
          logger.get_metric_history(trainer.metrics_prefix, "loss", "train")
      )
      if logger.metric_exists(trainer.metrics_prefix, "loss", "train")
      else np.zeros((0,))
  )
  return trainer.model, losses


def teacher_exact_match(
    teacher,
    tokenizer,
    reward_fn,
    rows,
    *,
    max_new_tokens: int,
    max_prompt_length: int,
) -> float:
  """Mean `reward_fn` (exact match) of the AR teacher's greedy completions.

  Generated with Tunix's `Sampler`.
  """
  config = teacher.config
  sampler = sampler_lib.Sampler(
      teacher,
      tokenizer,
      sampler_lib.CacheConfig(
          cache_size=max_prompt_length + max_new_tokens + 8,
          num_layers=config.num_layers,
          num_kv_heads=config.num_kv_heads,
          head_dim=config.head_dim,
      ),
  )
  batch = next(rl_data.prompt_batches(rows, len(rows)))
  prompts = list(batch.pop("prompts"))
  output = sampler(
      prompts,
      max_generation_steps=max_new_tokens,
      max_prompt_length=max_prompt_length,
      temperature=0.0,
  )
  return float(
      np.mean(
          reward_fn(
              prompts=prompts, completions=output.text, mode="eval", **batch
          )
      )
  )


# -----------------------------------------------------------------------------
# Evaluation of the student.
# -----------------------------------------------------------------------------


def evaluate_student(
    cluster, teacher, rows, reward_fn, algo_config, batch_size: int
):
  """(greedy exact match, mean divergence to the teacher on sampled rollouts)."""
  exact = rl_common.evaluate_rewards(
      cluster,
      rows,
      reward_fn,
      samples=1,
      mode=Mode.EVAL,
      batch_size=batch_size,
  )
  config = cluster.rollout.score_config
  totals = []
  for batch in rl_data.prompt_batches(rows, batch_size):
    output = cluster.generate(list(batch["prompts"]), mode=Mode.TRAIN)
    prompt_ids = np.asarray(output.left_padded_prompt_tokens)
    scored = opd.through_first_eos(
        output.commit_steps, output.trace_tokens, config.eos_token_id
    )
    student_batch = scoring.prepare_trajectory_batch(
        prompt_ids,
        engine_lib.prompt_mask_from_tokens(
            prompt_ids, cluster.rollout.pad_id()
        ),
        output.trace_tokens,
        output.commit_steps,
        mask_token_id=config.mask_token_id,
        loss_weights=scored.astype(np.float32),
    )
    mean = opd.evaluate_divergence(
        cluster.rollout.model(),
        teacher,
        "ar",
        student_batch,
        config,
        divergence=algo_config.divergence,
        beta=algo_config.beta,
        temperature=algo_config.temperature,
    )
    totals.append((mean * scored.sum(), scored.sum()))
  divergence = sum(t for t, _ in totals) / max(sum(n for _, n in totals), 1)
  return exact, float(divergence)


def plot_opd(path, divergences, start, end, title):
  """Training divergence per optimizer step; held-out before/after."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_div, ax_em) = plt.subplots(1, 2, figsize=(10, 4))
  ax_div.plot(
      np.arange(1, len(divergences) + 1),
      divergences,
      lw=1,
      label="train (token mean)",
  )
  ax_div.plot(
      [0, max(len(divergences), 1)],
      [start["divergence"], end["divergence"]],
      "o--",
      label="held-out",
  )
  ax_div.set_xlabel("optimizer step")
  ax_div.set_ylabel("divergence to the teacher")
  ax_div.grid(alpha=0.3)
  ax_div.legend(fontsize=8)
  ax_em.bar(
      ["before", "after"],
      [start["exact_match"], end["exact_match"]],
      color=["tab:gray", "tab:blue"],
  )
  ax_em.set_ylim(0, 1)
  ax_em.set_ylabel("student greedy exact match (held-out)")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return pathlib.Path(path)


def run(cfg) -> dict[str, Any]:
  """Runs the recipe; returns the summary (also written to `output_dir`)."""
  clock = common.Stopwatch()
  out = common.prepare_output_dir(cfg)
  student, sft_cfg, sft_summary = rl_common.load_policy(cfg.student, out)
  tokenizer = common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model)
  vocab_size = opd.model_vocab_size(student)
  opd_cfg = cfg.opd
  steps = int(opd_cfg.steps)
  prompts_per_step = int(opd_cfg.prompts_per_step)
  num_teacher = int(cfg.teacher.num_train)
  prompts = rl_data.recipe_prompts(
      cfg,
      sft_cfg,
      tokenizer,
      num_train=num_teacher + steps * prompts_per_step,
      num_held_out=int(cfg.eval.num_prompts),
      seed=int(cfg.seed) + 2000,
  )
  held_out = prompts.held_out
  reward_fn = rl_reward.recipe_reward(cfg, prompts)
  teacher_pairs = rl_data.prompt_pairs(prompts.train[:num_teacher])
  opd_rows = prompts.train[num_teacher:]

  teacher_clock = common.Stopwatch()
  teacher, teacher_losses = train_ar_teacher(
      cfg.teacher,
      tokenizer,
      vocab_size,
      teacher_pairs,
      seq_len=int(sft_cfg.data.seq_len),
      seed=int(cfg.seed) + 7,
  )
  teacher_seconds = teacher_clock()
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  teacher_em = teacher_exact_match(
      teacher,
      tokenizer,
      reward_fn,
      held_out,
      max_new_tokens=max_new_tokens,
      max_prompt_length=int(cfg.rollout.max_prompt_length),
  )

  mesh = rl_common.single_device_mesh()
  cluster = cluster_lib.BlockDiffusionRLCluster(
      actor=student,
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              Role.ACTOR: mesh,
              Role.REFERENCE: mesh,
              Role.ROLLOUT: mesh,
          },
          rollout_engine=rl_common.engine_factory(cfg, sft_cfg),
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=rl_common.make_rl_optimizer(opd_cfg),
              eval_every_n_steps=10**9,
              max_steps=steps,
              mini_batch_size=prompts_per_step,
              train_micro_batch_size=int(opd_cfg.micro_batch_prompts),
              metrics_logging_options=metrics_lib.MetricsLoggerOptions(
                  log_dir=str(out / "tensorboard"), flush_every_n_steps=20
              ),
              pbar_description="block-diffusion OPD",
          ),
          rollout_config=rl_common.rollout_configs(cfg, max_new_tokens),
      ),
  )
  algo_config = opd.BlockDiffusionOPDConfig(
      divergence=str(opd_cfg.divergence),
      estimator=str(opd_cfg.estimator),
      beta=float(opd_cfg.beta),
      temperature=float(opd_cfg.temperature),
      likelihood=str(opd_cfg.get("likelihood", "exact")),
  )
  learner = opd.BlockDiffusionOPDLearner(
      cluster, algo_config, teacher, teacher_kind="ar", reward_fns=[reward_fn]
  )
  batch_size = int(cfg.eval.batch_size)

  def evaluate():
    with mesh:
      exact, divergence = evaluate_student(
          cluster, teacher, held_out, reward_fn, algo_config, batch_size
      )
    return {"exact_match": exact, "divergence": divergence}

  start = evaluate()
  opd_clock = common.Stopwatch()
  with mesh:
    learner.train(list(rl_data.prompt_batches(opd_rows, prompts_per_step)))
  opd_seconds = opd_clock()
  end = evaluate()
  trainer = cluster.actor_trainer
  logger = trainer.metrics_logger
  train_divergence = (
      np.asarray(
          logger.get_metric_history(
              trainer.metrics_prefix, "divergence", "train"
          )
      )
      if logger.metric_exists(trainer.metrics_prefix, "divergence", "train")
      else np.zeros((0,))
  )
  summary = {
      "student_exact_match_start": start["exact_match"],
      "student_exact_match_end": end["exact_match"],
      "divergence_start": start["divergence"],
      "divergence_end": end["divergence"],
      "divergence": algo_config.divergence,
      "estimator": algo_config.estimator,
      "teacher_exact_match": teacher_em,
      "teacher_final_loss": (
          float(teacher_losses[-1]) if teacher_losses.size else None
      ),
      "train_divergence": train_divergence.tolist(),
      "steps": steps,
      "optimizer_steps": trainer.train_steps,
      "held_out_prompts": len(held_out),
      "prompts_source": prompts.source,
      "skipped_prompt_rows": prompts.skipped_rows,
      "teacher_seconds": teacher_seconds,
      "opd_seconds": opd_seconds,
      "seconds": clock(),
      "student_sft": {
          "eval_exact_match": (sft_summary or {}).get("eval_exact_match"),
          "train_steps": (sft_summary or {}).get("train_steps"),
      },
      "recipe": common.to_dict(cfg),
  }
  plot_opd(
      out / FIGURE_FILE,
      train_divergence,
      start,
      end,
      title=(
          f"OPD ({algo_config.divergence}, {algo_config.estimator}): student EM"
          f" {start['exact_match']:.3f} -> {end['exact_match']:.3f}, divergence"
          f" {start['divergence']:.3f} -> {end['divergence']:.3f} (teacher EM"
          f" {teacher_em:.3f})"
      ),
  )
  common.write_summary(out, summary)
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  return common.job_main(
      argv,
      command="opd",
      doc=__doc__,
      default_recipe="opd_tiny.yaml",
      run=run,
      keys=(
          "student_exact_match_start",
          "student_exact_match_end",
          "divergence_start",
          "divergence_end",
          "teacher_exact_match",
          "seconds",
      ),
  )


if __name__ == "__main__":
  sys.exit(main())
