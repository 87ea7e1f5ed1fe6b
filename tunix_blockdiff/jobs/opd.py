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

With `teacher.kind: hf` step 1 loads `teacher.path` instead, a Hugging Face
checkpoint of any family the package loads, frozen (`runs.hf_teacher`; its
tokenizer must agree with the student's, checked before anything runs).

Prompts are the SFT task's, or rows `{"prompt", "answer"}` of the recipe's
`dataset.train` / `dataset.eval` files (`runs.rl_data`); the teacher then
trains on the first `teacher.num_train` training rows and OPD uses the rest
(all of them with an HF teacher).

Writes `summary.json` (student exact match and the divergence on held-out
prompts before and after, teacher exact match, `seconds`), `opd.png`,
`tensorboard/` and the trained student in `policy/` (what `generate`, `rl
init.checkpoint=` and `opd student.checkpoint=` take).
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Sequence

import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.runs import ar_teacher
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import hf_teacher
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.jobs import rl_policy
from tunix_blockdiff.runs import rl_reward
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import opd
from tunix_blockdiff.rl import scoring
from tunix_blockdiff.rl import engine as engine_lib

FIGURE_FILE = "opd.png"
NUM_SAMPLES = 8
Mode = rl_cluster_lib.Mode


# -----------------------------------------------------------------------------
# Evaluation of the student.
# -----------------------------------------------------------------------------


def evaluate_student(
    cluster, teacher, rows, reward_fn, algo_config, batch_size: int
):
  """Greedy exact match and completions; divergence to the teacher.

  Returns:
    (exact match, `{"prompt", "completion"}` per greedy rollout, mean
    divergence to the teacher on sampled rollouts).
  """
  completions = []
  exact = rl_common.evaluate_rewards(
      cluster,
      rows,
      reward_fn,
      samples=1,
      mode=Mode.EVAL,
      batch_size=batch_size,
      completions=completions,
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
        attention=algo_config.attention,
    )
    totals.append((mean * scored.sum(), scored.sum()))
  divergence = sum(t for t, _ in totals) / max(sum(n for _, n in totals), 1)
  return exact, completions, float(divergence)


def plot_opd(path, divergences, start, end, title):
  """Training divergence per optimizer step; held-out before/after."""
  if not distributed.is_main_process():  # Process 0 writes figures.
    return pathlib.Path(path)
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


def _check_block_diffusion_keys(opd_cfg) -> None:
  """Keys of DiffusionGemma students that a block-diffusion one refuses."""
  if int(opd_cfg.get("num_generations", 1)) != 1:
    raise errors.UsageError(
        "opd.num_generations applies to DiffusionGemma students only (a"
        " block-diffusion student's per-token objective takes one rollout"
        f" per prompt): set it to 1, got {opd_cfg.num_generations}")
  if float(opd_cfg.get("reference_kl", 0.0)) != 0.0:
    raise errors.UsageError(
        "opd.reference_kl applies to DiffusionGemma students only: set it to"
        f" 0, got {opd_cfg.reference_kl}")


def run(cfg) -> dict[str, Any]:
  """Runs the recipe; returns the summary (also written to `output_dir`).

  The `student` checkpoint's model kind runs it (`runs.kinds`).
  """
  return kinds.of_policy(cfg.get("student")).call("opd", cfg)


def run_block_diffusion(cfg) -> dict[str, Any]:
  """OPD of a block-diffusion student (the summary it writes)."""
  _check_block_diffusion_keys(cfg.opd)
  clock = common.Stopwatch()
  hf_teacher.check_teacher_section(cfg.teacher)
  out = common.prepare_output_dir(cfg)
  every, keep = rl_checkpoints.checkpoint_every(cfg.opd, "opd")
  resume = rl_checkpoints.load_resume(out) if every else None
  kind = hf_teacher.teacher_kind(cfg.teacher)
  if kind == "hf":  # The tokenizers agree before anything runs.
    hf_teacher.check_student(
        cfg.teacher,
        rl_policy.policy_recipe(cfg.student, out, cfg.get("mesh")),
    )
  mesh = rl_common.rl_mesh(cfg.get("mesh"))
  student, sft_cfg, sft_summary = rl_policy.load_policy(
      cfg.student, out, mesh, cfg.get("mesh")
  )
  tokenizer = common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model)
  vocab_size = opd.model_vocab_size(student)
  opd_cfg = cfg.opd
  steps = int(opd_cfg.steps)
  prompts_per_step = int(opd_cfg.prompts_per_step)
  # An HF teacher trains on nothing: OPD gets every training prompt.
  num_teacher = int(cfg.teacher.num_train) if kind == "ar" else 0
  prompts = rl_data.recipe_prompts(
      cfg,
      sft_cfg,
      tokenizer,
      num_train=num_teacher + steps * prompts_per_step,
      num_held_out=int(cfg.eval.num_prompts),
      seed=int(cfg.seed) + 2000,
  )
  cfg.rollout.max_prompt_length, prompt_truncation = rl_data.size_prompts(
      cfg, tokenizer, prompts, job="opd"
  )
  held_out = prompts.held_out
  reward_fn = rl_reward.recipe_reward(cfg, prompts)
  teacher_pairs = rl_data.prompt_pairs(prompts.train[:num_teacher])
  opd_rows = prompts.train[num_teacher:]

  teacher_clock = common.Stopwatch()
  if kind == "hf":  # Loaded, placed on the mesh, frozen: no training.
    teacher, teacher_losses = hf_teacher.load_teacher(cfg.teacher, mesh), None
  else:
    teacher, teacher_losses = ar_teacher.train_ar_teacher(
        cfg.teacher,
        tokenizer,
        vocab_size,
        teacher_pairs,
        seq_len=int(sft_cfg.data.seq_len),
        seed=int(cfg.seed) + 7,
        mesh=mesh,
        # Saved with the checkpoints: a resumed run restores, not retrains.
        checkpoint_dir=(
            str(out / rl_checkpoints.CHECKPOINT_SUBDIR / "teacher")
            if every
            else None
        ),
    )
    if resume:
      teacher_losses = np.asarray(resume[0]["teacher_losses"], np.float64)
  teacher_seconds = teacher_clock()
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  teacher_em = ar_teacher.teacher_exact_match(
      teacher,
      tokenizer,
      reward_fn,
      held_out,
      max_new_tokens=max_new_tokens,
      max_prompt_length=int(cfg.rollout.max_prompt_length),
  )

  cluster = cluster_lib.BlockDiffusionRLCluster(
      actor=student,
      tokenizer=tokenizer,
      cluster_config=rl_common.cluster_config(
          opd_cfg, out, mesh,
          rl_common.engine_factory(
              cfg, sft_cfg,
              rl_common.scoring_attention(cfg, sft_cfg, student)),
          rl_common.rollout_configs(cfg, max_new_tokens),
          max_steps=steps,
          description="block-diffusion OPD",
          checkpoints=(every, keep),
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
      exact, completions, divergence = evaluate_student(
          cluster, teacher, held_out, reward_fn, algo_config, batch_size
      )
    return {
        "exact_match": exact,
        "completions": completions,
        "divergence": divergence,
    }

  trainer = cluster.actor_trainer
  done_divergence = list(resume[1]["train_divergence"]) if resume else []

  def job_state():
    return {
        "rollout_calls": cluster.rollout.calls,
        "train_divergence": done_divergence
        + trainer.metric_history("divergence"),
    }

  rl_checkpoints.track_state(trainer, out, every, job_state)
  common.show_progress(trainer, max(1, steps // 10), steps, out)
  start = rl_checkpoints.start_evaluation(
      out,
      resume,
      every,
      cluster.rollout,
      evaluate,
      teacher_losses=(
          [] if teacher_losses is None else teacher_losses.tolist()
      ),
  )
  opd_clock = common.Stopwatch()
  with mesh:
    learner.train(list(rl_data.prompt_batches(opd_rows, prompts_per_step)))
  opd_seconds = opd_clock()
  with mesh:  # The trained student: a run directory the next stage loads.
    rl_checkpoints.save_policy(
        out, cluster.actor_trainer.model, sft_cfg, cluster.actor_trainer.train_steps
    )
  end = evaluate()
  train_divergence = np.asarray(job_state()["train_divergence"], np.float64)
  summary = {
      "prompt_truncation": prompt_truncation,
      "scoring_attention": "splash" if cluster.rollout.attention else "dense",
      "student_exact_match_start": start["exact_match"],
      "student_exact_match_end": end["exact_match"],
      "divergence_start": start["divergence"],
      "divergence_end": end["divergence"],
      # Greedy held-out completions after training (the first 8).
      "greedy_samples_end": end["completions"][:NUM_SAMPLES],
      "divergence": algo_config.divergence,
      "estimator": algo_config.estimator,
      "teacher_exact_match": teacher_em,
      "teacher_kind": kind,
      "teacher_final_loss": (
          float(teacher_losses[-1])
          if teacher_losses is not None and teacher_losses.size
          else None
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
