"""`tunix-blockdiff rl [RECIPE.yaml] [key=value ...]`: GRPO, block diffusion.

With no recipe it runs the bundled `rl_tiny.yaml`: a block-diffusion policy
from an SFT checkpoint (`init.checkpoint`, an SFT `output_dir`; when null, a
short, deliberately partial SFT warm start is run first with the SFT job's
Python API) is trained with GRPO inside Tunix's RL loop:
`BlockDiffusionRLCluster` + `BlockDiffusionRollout` + `BlockDiffusionGRPOLearner`
(policy loss `bd_grpo`), with an exactly-checked reward (1 if the completion
equals the task's answer, else 0). Policy, reference and old-policy
log-probs are trajectory-exact.

Your own prompts and reward: `dataset.train=prompts.jsonl` (rows
`{"prompt", "answer", ...}`; `dataset.eval` for held-out rows, else some are
split off) and `reward=package.module:function` (Tunix's reward signature
`fn(prompts, completions, **kwargs) -> list[float]`; the rows' other columns
arrive as keyword arguments). See `runs.rl_data`.

Writes to `output_dir`: the resolved recipe, `summary.json` (`reward_start`,
`reward_end`, `steps`, `seconds`, greedy exact match before and after, ...),
`rl.png` (the reward curve), `tensorboard/`, the trained policy in
`policy/` (what `generate`, `rl init.checkpoint=` and `opd
student.checkpoint=` take), and with `grpo.checkpoint_every_n_steps`
`checkpoints/`, from which relaunching the same command resumes exactly
(`runs.rl_checkpoints`).
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Sequence

from flax import nnx
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff import distributed
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.jobs import rl_policy
from tunix_blockdiff.runs import rl_reward
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import learners

FIGURE_FILE = "rl.png"
NUM_SAMPLES = 8
Mode = rl_cluster_lib.Mode


def plot_reward_curve(
    path: pathlib.Path,
    batch_rewards: Sequence[float],
    evals: dict[str, tuple[float, float]],
    title: str,
) -> pathlib.Path:
  """Mean training reward per GRPO step (and a moving average), eval ends."""
  if not distributed.is_main_process():  # Process 0 writes figures.
    return pathlib.Path(path)
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4))
  x = np.arange(1, len(batch_rewards) + 1)
  ax.plot(
      x, batch_rewards, lw=0.8, alpha=0.5, label="train rollouts (step mean)"
  )
  if len(batch_rewards) >= 3:
    window = max(3, len(batch_rewards) // 10)
    kernel = np.ones(window) / window
    smooth = np.convolve(batch_rewards, kernel, mode="valid")
    ax.plot(x[window - 1 :], smooth, lw=2, label=f"moving average ({window})")
  last = max(len(batch_rewards), 1)
  for (name, (start, end)), marker in zip(evals.items(), ("o", "s", "^")):
    ax.plot(
        [0, last],
        [start, end],
        marker=marker,
        ls="--",
        label=f"held-out {name}",
    )
  ax.set_xlabel("GRPO step")
  ax.set_ylabel("exact-match reward")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return pathlib.Path(path)


def run(cfg) -> dict[str, Any]:
  """Runs the recipe; returns the summary (also written to `output_dir`).

  The `init` checkpoint's model kind runs it (`runs.kinds`).
  """
  return kinds.of_policy(cfg.get("init")).call("rl", cfg)


def run_block_diffusion(cfg) -> dict[str, Any]:
  """GRPO on a block-diffusion policy (the summary it writes)."""
  clock = common.Stopwatch()
  out = common.prepare_output_dir(cfg)
  if cfg.get("reward"):  # A bad spec fails before the warm start.
    rl_reward.load_reward_fn(str(cfg.reward), columns=None)
  every, keep = rl_checkpoints.checkpoint_every(
      cfg.grpo, "grpo", int(cfg.grpo.num_iterations)
  )
  resume = rl_checkpoints.load_resume(out) if every else None
  mesh = rl_common.rl_mesh(cfg.get("mesh"))
  policy, sft_cfg, sft_summary = rl_policy.load_policy(
      cfg.init, out, mesh, cfg.get("mesh")
  )
  warm_start_seconds = clock()
  tokenizer = common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model)
  grpo_cfg = cfg.grpo
  steps = int(grpo_cfg.steps)
  prompts_per_step = int(grpo_cfg.prompts_per_step)
  prompts = rl_data.recipe_prompts(
      cfg,
      sft_cfg,
      tokenizer,
      num_train=steps * prompts_per_step,
      num_held_out=int(cfg.eval.num_prompts),
      seed=int(cfg.seed) + 1000,
  )
  cfg.rollout.max_prompt_length, prompt_truncation = rl_data.size_prompts(
      cfg, tokenizer, prompts, job="rl"
  )
  held_out = prompts.held_out
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  reward_fn = rl_reward.recipe_reward(cfg, prompts)
  train_rewards: list[float] = list(resume[1]["train_rewards"]) if resume else []

  reference = None
  if float(grpo_cfg.beta) != 0.0:
    reference = nnx.clone(policy)
  cluster = cluster_lib.BlockDiffusionRLCluster(
      actor=policy,
      reference=reference,
      tokenizer=tokenizer,
      cluster_config=rl_common.cluster_config(
          grpo_cfg, out, mesh,
          rl_common.engine_factory(
              cfg, sft_cfg,
              rl_common.scoring_attention(cfg, sft_cfg, policy)),
          rl_common.rollout_configs(cfg, max_new_tokens),
          max_steps=steps * int(grpo_cfg.num_iterations),
          description="block-diffusion GRPO",
          checkpoints=(every, keep),
      ),
  )
  learner = learners.BlockDiffusionGRPOLearner(
      cluster,
      grpo.BlockDiffusionGRPOConfig(
          num_generations=int(grpo_cfg.num_generations),
          num_iterations=int(grpo_cfg.num_iterations),
          beta=float(grpo_cfg.beta),
          epsilon=float(grpo_cfg.epsilon),
          loss_agg_mode=str(grpo_cfg.loss_agg_mode),
          likelihood=str(grpo_cfg.get("likelihood", "exact")),
      ),
      reward_fns=[rl_common.tracked_reward(reward_fn, train_rewards)],
  )
  eval_batch = int(cfg.eval.batch_size)
  samples = int(cfg.eval.samples_per_prompt)
  base_cost = dict(resume[1]["cost"]) if resume else {}
  recorded: list = []

  def job_state():
    return {
        "rollout_calls": cluster.rollout.calls,
        "train_rewards": list(train_rewards),
        "cost": rl_checkpoints.add_costs(
            base_cost,
            rl_common.block_diffusion_rollout_cost(recorded, max_new_tokens),
        ),
    }

  rl_checkpoints.track_state(cluster.actor_trainer, out, every, job_state)
  total = steps * int(grpo_cfg.num_iterations)
  common.show_progress(cluster.actor_trainer, max(1, total // 10), total, out)

  def evaluate():
    greedy = []
    with mesh:
      return {
          "sampled": rl_common.evaluate_rewards(
              cluster,
              held_out,
              reward_fn,
              samples=samples,
              mode=Mode.TRAIN,
              batch_size=eval_batch,
          ),
          "greedy": rl_common.evaluate_rewards(
              cluster,
              held_out,
              reward_fn,
              samples=1,
              mode=Mode.EVAL,
              batch_size=eval_batch,
              completions=greedy,
          ),
          "completions": greedy,
      }

  start = rl_checkpoints.start_evaluation(
      out, resume, every, cluster.rollout, evaluate
  )
  rl_clock = common.Stopwatch()
  with mesh, cluster.rollout.record_outputs() as rollouts:
    recorded = rollouts
    learner.train(list(rl_data.prompt_batches(prompts.train, prompts_per_step)))
  rl_seconds = rl_clock()
  # Training rollouts only (evaluation runs outside the recorder).
  cost = job_state()["cost"]
  recorded = []
  del rollouts
  with mesh:
    rl_checkpoints.save_policy(
        out, cluster.actor_trainer.model, sft_cfg, cluster.actor_trainer.train_steps
    )
  end = evaluate()
  per_step = prompts_per_step * int(grpo_cfg.num_generations)
  batch_rewards = rl_common.per_step_means(train_rewards, per_step)
  window = max(1, len(batch_rewards) // 10)
  summary = {
      "prompt_truncation": prompt_truncation,
      "scoring_attention": "splash" if cluster.rollout.attention else "dense",
      "reward_start": start["sampled"],
      "reward_end": end["sampled"],
      "greedy_exact_match_start": start["greedy"],
      "greedy_exact_match_end": end["greedy"],
      # Mean training reward over the first and last tenth of the steps.
      "train_reward_first_steps": float(np.mean(batch_rewards[:window])),
      "train_reward_last_steps": float(np.mean(batch_rewards[-window:])),
      "train_step_rewards": batch_rewards,
      # Greedy held-out completions after training (the first 8).
      "greedy_samples_end": end["completions"][:NUM_SAMPLES],
      # Groups whose rollouts' rewards differ: the others give no gradient.
      "train_groups_with_signal": rl_common.groups_with_signal(
          train_rewards, int(grpo_cfg.num_generations)
      ),
      "steps": steps,
      "optimizer_steps": cluster.actor_trainer.train_steps,
      "rollouts": steps * prompts_per_step * int(grpo_cfg.num_generations),
      "rollout_tokens": cost["rollout_tokens"],
      "rollout_model_calls": cost["rollout_model_calls"],
      "rollout_row_calls": cost["rollout_row_calls"],
      "held_out_prompts": len(held_out),
      "prompts_source": prompts.source,
      "skipped_prompt_rows": prompts.skipped_rows,
      "reward_fn": str(cfg.get("reward") or "exact_match"),
      "warm_start_seconds": warm_start_seconds,
      "rl_seconds": rl_seconds,
      "seconds": clock(),
      "sft": {
          "checkpoint": str(
              cfg.init.checkpoint
              or out / str(cfg.init.get("output_subdir", "sft"))
          ),
          "eval_exact_match": (sft_summary or {}).get("eval_exact_match"),
          "train_steps": (sft_summary or {}).get("train_steps"),
      },
      "recipe": common.to_dict(cfg),
  }
  plot_reward_curve(
      out / FIGURE_FILE,
      batch_rewards,
      {
          "sampled": (start["sampled"], end["sampled"]),
          "greedy": (start["greedy"], end["greedy"]),
      },
      title=(
          f"GRPO ({prompts.source}), block {sft_cfg.diffusion.block_size}:"
          f" held-out reward {start['sampled']:.3f} -> {end['sampled']:.3f}"
      ),
  )
  common.write_summary(out, summary)
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  return common.job_main(
      argv,
      command="rl",
      doc=__doc__,
      default_recipe="rl_tiny.yaml",
      run=run,
      keys=(
          "reward_start",
          "reward_end",
          "greedy_exact_match_start",
          "greedy_exact_match_end",
          "steps",
          "seconds",
      ),
  )


if __name__ == "__main__":
  sys.exit(main())
