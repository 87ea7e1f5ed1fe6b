"""`tunix-blockdiff rl [RECIPE.yaml] [key=value ...]`: GRPO, block diffusion.

With no recipe it runs the bundled `rl_tiny.yaml`: a block-diffusion policy
from an SFT checkpoint (`init.checkpoint`, an SFT `output_dir`; when null, a
short, deliberately partial SFT warm start is run first with the SFT job's
Python API) is trained with GRPO inside Tunix's RL loop:
`BlockDiffusionRLCluster` + `BlockDiffusionRollout` + `BlockDiffusionGRPOLearner`
(policy loss `bd_grpo`), with an exactly-checked reward (1 if the completion
equals the task's answer, else 0). Policy, reference and old-policy
log-probs are trajectory-exact.

Writes to `output_dir`: the resolved recipe, `summary.json` (`reward_start`,
`reward_end`, `steps`, `seconds`, greedy exact match before and after, ...)
and `rl.png` (the reward curve).
"""

from __future__ import annotations

import functools
import pathlib
import sys
from typing import Any, Callable, Sequence

from flax import nnx
import jax
from jax.sharding import AxisType
import numpy as np
import omegaconf
import optax
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout
from tunix.sft import checkpoint_manager as checkpoint_lib
from tunix.sft import metrics_logger as metrics_lib

from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.jobs import common
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rollout import engine as engine_lib

FIGURE_FILE = "rl.png"
Role = rl_cluster_lib.Role
Mode = rl_cluster_lib.Mode


# -----------------------------------------------------------------------------
# The SFT policy (shared with the OPD job).
# -----------------------------------------------------------------------------


def load_sft_policy(directory: str | pathlib.Path):
  """(model, SFT recipe) restored from an SFT job's `output_dir`.

  The model is rebuilt from the saved recipe and its parameters (or LoRA
  parameters, on top of the seed-determined base) restored from the latest
  Orbax checkpoint in `checkpoints/`.
  """
  directory = pathlib.Path(directory).expanduser()
  recipe_file = directory / common.RECIPE_FILE
  if not recipe_file.is_file():
    raise FileNotFoundError(
        f"{recipe_file} not found: init.checkpoint must be an SFT output_dir"
    )
  sft_cfg = omegaconf.OmegaConf.load(recipe_file)
  model = common.build_model(sft_cfg.model, seed=int(sft_cfg.seed))
  model = common.apply_lora(model, sft_cfg.lora, seed=int(sft_cfg.seed))
  manager = checkpoint_lib.CheckpointManager(str(directory / "checkpoints"))
  step, _ = manager.maybe_restore(
      model, restore_only_lora_params=sft_cfg.lora is not None
  )
  manager.close()
  if step == 0:
    raise FileNotFoundError(f"no checkpoint under {directory / 'checkpoints'}")
  return model, sft_cfg


def sft_warm_start(init_cfg, out: pathlib.Path) -> tuple[pathlib.Path, dict]:
  """Runs the SFT job (its Python API) into `out/<name>`; returns (dir, summary)."""
  from tunix_blockdiff.jobs import sft as sft_job  # pylint: disable=g-import-not-at-top

  directory = out / str(init_cfg.get("output_subdir", "sft"))
  overrides = [str(o) for o in init_cfg.sft_overrides or []]
  sft_cfg = common.load_recipe(
      [str(init_cfg.sft_recipe), *overrides, f"output_dir={directory}"]
  )
  summary = sft_job.run(sft_cfg)
  return directory, summary


def load_policy(init_cfg, out: pathlib.Path):
  """(model, SFT recipe, SFT summary or None) for an `init` recipe section.

  `init.checkpoint` names an SFT output_dir; when null, the SFT job runs
  `init.sft_recipe` with `init.sft_overrides` into `out/init.output_subdir`.
  """
  if init_cfg.checkpoint:
    model, sft_cfg = load_sft_policy(init_cfg.checkpoint)
    return model, sft_cfg, None
  directory, summary = sft_warm_start(init_cfg, out)
  model, sft_cfg = load_sft_policy(directory)
  return model, sft_cfg, summary


def single_device_mesh() -> jax.sharding.Mesh:
  """A 1x1 (`fsdp`, `tp`) mesh on the first device (Auto axes)."""
  return jax.make_mesh(
      (1, 1),
      ("fsdp", "tp"),
      axis_types=(AxisType.Auto, AxisType.Auto),
      devices=jax.devices()[:1],
  )


def task_prompts(sft_cfg, num_train: int, seed: int):
  """(task, `num_train` training pairs, held-out pairs).

  Held-out = the SFT job's eval set; training pairs never share a prompt
  with it.
  """
  task = tasks_lib.get_task(
      sft_cfg.task.name, **common.to_dict(sft_cfg.task.get("kwargs") or {})
  )
  held_out = task.sample(
      int(sft_cfg.task.num_eval), seed=int(sft_cfg.task.seed) + 1
  )
  held_out_prompts = {p for p, _ in held_out}
  # Oversample: some draws repeat a held-out prompt and are dropped.
  candidates = task.sample(2 * num_train + 256, seed=seed)
  train = [pair for pair in candidates if pair[0] not in held_out_prompts]
  if len(train) < num_train:
    raise ValueError(
        f"task {task.name!r} yields only {len(train)} training prompts outside"
        f" the held-out set; {num_train} are needed"
    )
  return task, train[:num_train], held_out


def exact_match_reward(task: tasks_lib.Task) -> Callable[..., list[float]]:
  """Tunix reward fn: 1.0 where the completion is exactly the answer."""

  def exact_match(prompts, completions, answer, **unused_kwargs):
    del unused_kwargs
    return [
        float(task.check(p, c, a))
        for p, c, a in zip(prompts, completions, answer)
    ]

  return exact_match


def prompt_batches(pairs, batch_size: int):
  """Tunix RL inputs: dicts of NumPy arrays `prompts` and `answer`."""
  for start in range(0, len(pairs) - batch_size + 1, batch_size):
    chunk = pairs[start : start + batch_size]
    yield {
        "prompts": np.array([p for p, _ in chunk]),
        "answer": np.array([a for _, a in chunk]),
    }


def rollout_configs(cfg, max_new_tokens: int) -> dict:
  """TRAIN (sampling) and EVAL (greedy, for exact match) `RolloutConfig`s."""
  common_args = dict(
      max_tokens_to_generate=max_new_tokens,
      max_prompt_length=int(cfg.rollout.max_prompt_length),
      top_p=None,
      top_k=None,
  )
  return {
      Mode.TRAIN: base_rollout.RolloutConfig(
          temperature=float(cfg.rollout.temperature), **common_args
      ),
      Mode.EVAL: base_rollout.RolloutConfig(temperature=0.0, **common_args),
  }


def engine_factory(cfg, sft_cfg):
  """`functools.partial(BlockDiffusionRollout, ...)` from the SFT objective."""
  return functools.partial(
      engine_lib.BlockDiffusionRollout,
      block_size=int(sft_cfg.diffusion.block_size),
      mask_token_id=int(sft_cfg.diffusion.mask_token_id),
      alignment=str(sft_cfg.diffusion.alignment),
      threshold=float(cfg.rollout.threshold),
      seed=int(cfg.seed),
  )


def evaluate_rewards(
    cluster, pairs, reward_fn, *, samples: int, mode: Mode, batch_size: int
) -> float:
  """Mean reward of `samples` rollouts per held-out prompt in `mode`."""
  rewards = []
  repeated = [pair for pair in pairs for _ in range(samples)]
  for batch in prompt_batches(repeated, batch_size):
    output = cluster.generate(list(batch["prompts"]), mode=mode)
    rewards.extend(
        reward_fn(
            prompts=list(batch["prompts"]),
            completions=output.text,
            answer=list(batch["answer"]),
        )
    )
  return float(np.mean(rewards))


def plot_reward_curve(
    path: pathlib.Path,
    batch_rewards: Sequence[float],
    evals: dict[str, tuple[float, float]],
    title: str,
) -> pathlib.Path:
  """Mean training reward per GRPO step (and a moving average), eval ends."""
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
  """Runs the recipe; returns the summary (also written to `output_dir`)."""
  clock = common.Stopwatch()
  out = common.prepare_output_dir(cfg)
  policy, sft_cfg, sft_summary = load_policy(cfg.init, out)
  warm_start_seconds = clock()
  tokenizer = common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model)
  grpo_cfg = cfg.grpo
  steps = int(grpo_cfg.steps)
  prompts_per_step = int(grpo_cfg.prompts_per_step)
  task, train_pairs, held_out = task_prompts(
      sft_cfg, steps * prompts_per_step + 64, seed=int(cfg.seed) + 1000
  )
  held_out = held_out[: int(cfg.eval.num_prompts)]
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  reward_fn = exact_match_reward(task)
  train_rewards: list[float] = []

  def tracked_reward(prompts, completions, answer, **kwargs):
    rewards = reward_fn(prompts, completions, answer, **kwargs)
    if kwargs.get("mode", "train") == "train":
      train_rewards.extend(rewards)
    return rewards

  mesh = single_device_mesh()
  micro = int(grpo_cfg.micro_batch_prompts)
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=make_rl_optimizer(grpo_cfg),
      eval_every_n_steps=10**9,
      max_steps=steps * int(grpo_cfg.num_iterations),
      mini_batch_size=prompts_per_step,
      train_micro_batch_size=micro,
      metrics_logging_options=metrics_lib.MetricsLoggerOptions(
          log_dir=str(out / "tensorboard"), flush_every_n_steps=20
      ),
      pbar_description="block-diffusion GRPO",
  )
  reference = None
  if float(grpo_cfg.beta) != 0.0:
    reference = nnx.clone(policy)
  cluster = cluster_lib.BlockDiffusionRLCluster(
      actor=policy,
      reference=reference,
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              Role.ACTOR: mesh,
              Role.REFERENCE: mesh,
              Role.ROLLOUT: mesh,
          },
          rollout_engine=engine_factory(cfg, sft_cfg),
          training_config=training_config,
          rollout_config=rollout_configs(cfg, max_new_tokens),
      ),
  )
  learner = grpo.BlockDiffusionGRPOLearner(
      cluster,
      grpo.BlockDiffusionGRPOConfig(
          num_generations=int(grpo_cfg.num_generations),
          num_iterations=int(grpo_cfg.num_iterations),
          beta=float(grpo_cfg.beta),
          epsilon=float(grpo_cfg.epsilon),
          loss_agg_mode=str(grpo_cfg.loss_agg_mode),
      ),
      reward_fns=[tracked_reward],
  )
  eval_batch = int(cfg.eval.batch_size)
  samples = int(cfg.eval.samples_per_prompt)

  def evaluate():
    with mesh:
      return {
          "sampled": evaluate_rewards(
              cluster,
              held_out,
              reward_fn,
              samples=samples,
              mode=Mode.TRAIN,
              batch_size=eval_batch,
          ),
          "greedy": evaluate_rewards(
              cluster,
              held_out,
              reward_fn,
              samples=1,
              mode=Mode.EVAL,
              batch_size=eval_batch,
          ),
      }

  start = evaluate()
  rl_clock = common.Stopwatch()
  with mesh:
    learner.train(list(prompt_batches(train_pairs, prompts_per_step))[:steps])
  rl_seconds = rl_clock()
  end = evaluate()
  per_step = prompts_per_step * int(grpo_cfg.num_generations)
  batch_rewards = [
      float(np.mean(train_rewards[i : i + per_step]))
      for i in range(0, len(train_rewards), per_step)
  ]
  window = max(1, len(batch_rewards) // 10)
  summary = {
      "reward_start": start["sampled"],
      "reward_end": end["sampled"],
      "greedy_exact_match_start": start["greedy"],
      "greedy_exact_match_end": end["greedy"],
      # Mean training reward over the first and last tenth of the steps.
      "train_reward_first_steps": float(np.mean(batch_rewards[:window])),
      "train_reward_last_steps": float(np.mean(batch_rewards[-window:])),
      "train_step_rewards": batch_rewards,
      "steps": steps,
      "optimizer_steps": cluster.actor_trainer.train_steps,
      "rollouts": steps * prompts_per_step * int(grpo_cfg.num_generations),
      "held_out_prompts": len(held_out),
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
          f"GRPO ({sft_cfg.task.name}), block {sft_cfg.diffusion.block_size}:"
          f" held-out reward {start['sampled']:.3f} -> {end['sampled']:.3f}"
      ),
  )
  common.write_summary(out, summary)
  return summary


def make_rl_optimizer(grpo_cfg) -> optax.GradientTransformation:
  """AdamW at a constant learning rate, gradients clipped by global norm."""
  adamw = optax.adamw(
      float(grpo_cfg.learning_rate),
      b1=0.9,
      b2=float(grpo_cfg.get("adam_b2", 0.99)),
      weight_decay=float(grpo_cfg.get("weight_decay", 0.0)),
  )
  clip = float(grpo_cfg.get("grad_clip", 0.0) or 0.0)
  return (
      optax.chain(optax.clip_by_global_norm(clip), adamw) if clip > 0 else adamw
  )


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
