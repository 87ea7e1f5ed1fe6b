"""`tunix-blockdiff rl` on a DiffusionGemma policy: GRPO with `dg_grpo`.

`jobs/rl.py` hands a recipe here when `init.checkpoint` is a DiffusionGemma
sft run's `output_dir` (or an rl run on one: its `policy/`), or an HF
DiffusionGemma directory (with the rl recipe's `dataset` for prompts). The
policy is that run's latest checkpoint (LoRA merged, then trained in full)
or the directory's weights, sampled
by `DiffusionGemmaRollout` with the run's `sampler` section, inside
`DiffusionGemmaRLCluster` and trained by `DiffusionGemmaGRPOLearner`
(`dg_grpo`, the sequence-level exact likelihood ratio). Prompts and the
reward are the rl job's (`runs.rl_data`, `runs.rl_reward`): the run's task,
or `dataset` and `reward`.

Recipe keys that do not apply here: `rollout.threshold`,
`rollout.temperature` (the sampler's temperature schedule applies),
`grpo.loss_agg_mode` and `grpo.likelihood` (dg_grpo is sequence-level and
exact).

Checkpoints and resume are the rl job's (`runs.rl_checkpoints`):
`grpo.checkpoint_every_n_steps` saves the actor through Tunix and the job
state (the rollout engine's call counter, the training rewards) beside it;
relaunching the same command continues from the latest checkpoint to the
uninterrupted run's result.

Runs on any number of processes (`distributed`, `tunix-blockdiff launch`):
rollouts, scores and the held-out evaluation shard their rows over
`mesh.fsdp` and gather them on every process, the training examples are
global arrays, and process 0 writes the outputs.

Writes to `output_dir`: the resolved recipe, `summary.json`
(`reward_start`, `reward_end`: mean held-out reward of sampled rollouts
before and after, with standard errors over the held-out prompts and the
paired `reward_gain` +- `reward_gain_se`; `steps`, `seconds`, ...) and the
trained policy in
`policy/` (a DiffusionGemma sft layout: `generate` and `rl
init.checkpoint=` take it).
"""

from __future__ import annotations

import functools
import math
import pathlib
from typing import Any

from flax import nnx
import numpy as np
import omegaconf
from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.kinds.diffusion_gemma import sft as dg_job
from tunix_blockdiff.kinds.diffusion_gemma import generate as dg_generate
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.runs import rl_reward
from tunix_blockdiff.kinds.diffusion_gemma import cluster as cluster_lib
from tunix_blockdiff.kinds.diffusion_gemma import grpo as dg_grpo
from tunix_blockdiff.kinds.diffusion_gemma import learner as learner_lib
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib
from tunix_blockdiff.kinds.diffusion_gemma import evaluation

Role = rl_cluster_lib.Role
Mode = rl_cluster_lib.Mode
# The recipe an HF DiffusionGemma policy's `policy/recipe.yaml` starts from.
HF_BASE_RECIPE = "diffusion_gemma_tiny.yaml"


def hf_policy_recipe(path: str | pathlib.Path) -> omegaconf.DictConfig:
  """The policy recipe of an HF DiffusionGemma directory (no sft run).

  The bundled tiny DiffusionGemma recipe with `model.kind:
  diffusion_gemma_hf`, `model.path` the directory, its own tokenizer and
  its `generation_config.json` sampler defaults (`sampler: null`), and no
  task: the rl recipe's `dataset` gives the prompts.
  """
  cfg = omegaconf.OmegaConf.load(common.recipe_path(HF_BASE_RECIPE))
  return omegaconf.OmegaConf.merge(cfg, omegaconf.OmegaConf.from_dotlist([
      "model.kind=diffusion_gemma_hf",
      f"model.path={pathlib.Path(path).expanduser().resolve()}",
      "tokenizer.kind=hf", "task=null", "sampler=null", "lora=null",
  ]))


def policy_recipe(init_cfg) -> omegaconf.DictConfig | None:
  """The DiffusionGemma policy recipe `init.checkpoint` names, else None.

  `init.checkpoint` is a DiffusionGemma sft run (or an rl run on one) or
  an HF DiffusionGemma directory (`hf_policy_recipe`).
  """
  checkpoint = init_cfg.get("checkpoint") if init_cfg is not None else None
  if not checkpoint:
    return None
  if dg_job.is_hf_dir(str(checkpoint)):
    return hf_policy_recipe(str(checkpoint))
  recipe = rl_checkpoints.policy_dir(str(checkpoint)) / common.RECIPE_FILE
  if not recipe.is_file():
    return None
  cfg = omegaconf.OmegaConf.load(recipe)
  return cfg if dg_job.is_recipe(cfg) else None


def is_policy(init_cfg) -> bool:
  """Whether an rl recipe's `init` section names a DiffusionGemma policy."""
  return policy_recipe(init_cfg) is not None


def load_policy(init_cfg):
  """(model, policy recipe with lora null, sampler defaults, step or None)."""
  sft_cfg = policy_recipe(init_cfg)
  if dg_job.is_hf_dir(str(init_cfg.checkpoint)):
    model, defaults = dg_job.build_model(sft_cfg.model, seed=int(sft_cfg.seed))
    return model, sft_cfg, defaults, None
  directory = rl_checkpoints.policy_dir(str(init_cfg.checkpoint))
  model, defaults, step = dg_generate.load_run(directory, sft_cfg)
  policy_cfg = omegaconf.OmegaConf.create(common.to_dict(sft_cfg))
  policy_cfg.lora = None  # LoRA is merged: the policy trains in full.
  return model, policy_cfg, defaults, step


def scoring_splash_tile(cfg, policy_cfg, mesh, policy) -> int | None:
  """The Splash tile of the trajectory scorers, or None (dense).

  `rollout.attention` (else the policy's SFT `model.attention`), as for
  block diffusion. The scorers attend over `rollout.max_prompt_length` plus
  whole canvases, so the tile must divide both (`dg_job.splash_tile_for`).

  Raises:
    UsageError: a bad value, or `splash` where it cannot run.
  """
  width = int(cfg.rollout.max_prompt_length)
  canvas = int(policy.config.canvas_length)
  return dg_job.splash_tile_for(
      rl_common.recipe_scoring_attention(cfg, policy_cfg),
      math.gcd(width, canvas), mesh, key="rollout.attention",
      lengths=(f"rollout.max_prompt_length ({width}) and the canvas length"
               f" ({canvas}) each"))


def grpo_learner(cfg, algo_cfg, out, mesh, policy, tokenizer, sampler,
                 reward_fn, *, generations: int, iterations: int, beta: float,
                 epsilon: float, max_steps: int, description: str,
                 checkpoints: tuple[int | None, int],
                 splash_tile: int | None = None):
  """(`DiffusionGemmaRLCluster`, `DiffusionGemmaGRPOLearner`) of a job.

  The rl and opd jobs on a DiffusionGemma policy share it: every role on
  `mesh`, the policy sampled by `DiffusionGemmaRollout` with `sampler`,
  trained with `dg_grpo` on `reward_fn`; a reference copy of the policy
  only when `beta` (the KL weight) is nonzero. `splash_tile`
  (`scoring_splash_tile`): the engine's scorers run Splash, and the
  learner gives the loss the engine's tile; None: dense.
  """
  reference = nnx.clone(policy) if beta != 0.0 else None
  cluster = cluster_lib.DiffusionGemmaRLCluster(
      actor=policy,
      reference=reference,
      tokenizer=tokenizer,
      cluster_config=rl_common.cluster_config(
          algo_cfg, out, mesh,
          functools.partial(engine_lib.DiffusionGemmaRollout,
                            sampler_config=sampler, seed=int(cfg.seed),
                            splash_tile=splash_tile),
          rl_common.rollout_configs(cfg, int(cfg.rollout.max_tokens_to_generate)),
          max_steps=max_steps,
          description=description,
          checkpoints=checkpoints,
      ),
  )
  learner = learner_lib.DiffusionGemmaGRPOLearner(
      cluster,
      dg_grpo.DiffusionGemmaGRPOConfig(
          num_generations=generations, num_iterations=iterations, beta=beta,
          epsilon=epsilon),
      reward_fns=[reward_fn],
  )
  return cluster, learner


def _check(cfg) -> None:
  if cfg.get("reward"):
    rl_reward.load_reward_fn(str(cfg.reward), columns=None)
  init = cfg.get("init")
  checkpoint = init.get("checkpoint") if init is not None else None
  if checkpoint and dg_job.is_hf_dir(str(checkpoint)) and (
      cfg.get("dataset") is None):
    raise errors.UsageError(
        "rl on an HF DiffusionGemma directory needs dataset (prompt rows):"
        " the directory has no task to draw prompts from")


def run(cfg) -> dict[str, Any]:
  """The rl job on a DiffusionGemma policy; returns the summary it writes."""
  clock = common.Stopwatch()
  _check(cfg)
  out = common.prepare_output_dir(cfg)
  mesh = rl_common.rl_mesh(cfg.get("mesh"))
  policy, policy_cfg, defaults, sft_step = load_policy(cfg.init)
  policy = common.shard_model(policy, mesh)
  tokenizer = common.build_tokenizer(policy_cfg.tokenizer, policy_cfg.model)
  sampler = dg_job.sampler_config(policy_cfg.get("sampler"), defaults,
                                  tokenizer)
  grpo_cfg = cfg.grpo
  iterations = int(grpo_cfg.num_iterations)
  every, keep = rl_checkpoints.checkpoint_every(grpo_cfg, "grpo", iterations)
  resume = rl_checkpoints.load_resume(out) if every else None
  steps = int(grpo_cfg.steps)
  prompts_per_step = int(grpo_cfg.prompts_per_step)
  generations = int(grpo_cfg.num_generations)
  prompts = rl_data.recipe_prompts(
      cfg, policy_cfg, tokenizer, num_train=steps * prompts_per_step,
      num_held_out=int(cfg.eval.num_prompts), seed=int(cfg.seed) + 1000)
  cfg.rollout.max_prompt_length, prompt_truncation = rl_data.size_prompts(
      cfg, tokenizer, prompts, job="rl")
  splash_tile = scoring_splash_tile(cfg, policy_cfg, mesh, policy)
  reward_fn = rl_reward.recipe_reward(cfg, prompts)
  train_rewards: list[float] = list(resume[1]["train_rewards"]) if resume else []
  cluster, learner = grpo_learner(
      cfg, grpo_cfg, out, mesh, policy, tokenizer, sampler,
      rl_common.tracked_reward(reward_fn, train_rewards),
      generations=generations, iterations=iterations,
      beta=float(grpo_cfg.beta), epsilon=float(grpo_cfg.epsilon),
      max_steps=steps * iterations, description="DiffusionGemma GRPO",
      checkpoints=(every, keep), splash_tile=splash_tile)
  trainer = cluster.actor_trainer
  done_ratios = list(resume[1]["is_ratio_mean"]) if resume else []

  def ratios() -> list[float]:
    return done_ratios + trainer.metric_history("is_ratio/mean")

  rl_checkpoints.track_state(trainer, out, every, lambda: {
      "rollout_calls": cluster.rollout.calls,
      "train_rewards": list(train_rewards),
      "is_ratio_mean": ratios(),
  })
  common.show_progress(trainer, max(1, steps * iterations // 10),
                       steps * iterations, out)

  samples = int(cfg.eval.samples_per_prompt)
  greedy = evaluation.greedy_rewards(
      trainer.model, sampler, tokenizer, mesh, prompts.held_out, reward_fn,
      max_prompt_length=int(cfg.rollout.max_prompt_length),
      max_new_tokens=int(cfg.rollout.max_tokens_to_generate),
      batch_size=int(cfg.eval.batch_size), seed=int(cfg.seed) + 2000)

  def evaluate() -> dict[str, list[float]]:
    """Each held-out prompt's mean sampled reward, and its greedy reward."""
    rewards: list[float] = []
    with mesh:
      rl_common.evaluate_rewards(
          cluster, prompts.held_out, reward_fn, samples=samples,
          mode=Mode.EVAL, batch_size=int(cfg.eval.batch_size),
          per_rollout=rewards)
      return {"sampled": np.reshape(rewards, (-1, samples)).mean(1).tolist(),
              "greedy": greedy()}

  start = rl_checkpoints.start_evaluation(out, resume, every, cluster.rollout,
                                         evaluate)
  rl_clock = common.Stopwatch()
  with mesh:
    learner.train(list(rl_data.prompt_batches(prompts.train,
                                              prompts_per_step)))
  rl_seconds = rl_clock()
  with mesh:
    rl_checkpoints.save_policy(out, trainer.model, policy_cfg,
                               trainer.train_steps)
  end = evaluate()
  per_step = prompts_per_step * generations
  batch_rewards = rl_common.per_step_means(train_rewards, per_step)
  summary = {
      "policy_family": "diffusion_gemma",
      "scoring_attention": "splash" if splash_tile else "dense",
      "scoring_attention_tile": splash_tile,
      "prompt_truncation": prompt_truncation,
      **evaluation.reward_gain(start["sampled"], end["sampled"]),
      **evaluation.reward_gain(start["greedy"], end["greedy"],
                               name="greedy_reward"),
      # The recipe reward of the greedy sampler (as the block-diffusion
      # rl job names it).
      "greedy_exact_match_start": float(np.mean(start["greedy"])),
      "greedy_exact_match_end": float(np.mean(end["greedy"])),
      "train_step_rewards": batch_rewards,
      "train_groups_with_signal": rl_common.groups_with_signal(
          train_rewards, generations),
      "is_ratio_mean": ratios(),
      "steps": steps,
      "optimizer_steps": trainer.train_steps,
      "rollouts": steps * per_step,
      "held_out_prompts": len(prompts.held_out),
      "prompts_source": prompts.source,
      "reward_fn": str(cfg.get("reward") or "exact_match"),
      "sampler": dict(sampler.__dict__),
      "rl_seconds": rl_seconds,
      "seconds": clock(),
      "sft": {"checkpoint": str(cfg.init.checkpoint),
              "checkpoint_step": sft_step},
      "recipe": common.to_dict(cfg),
  }
  common.write_summary(out, summary)
  return summary


__all__ = ["grpo_learner", "hf_policy_recipe", "is_policy", "load_policy",
           "greedy_rewards", "policy_recipe", "reward_gain", "run"]
