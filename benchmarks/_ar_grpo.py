"""The autoregressive side of `rl_vs_ar.py`: causal SFT to a target exact
match, then Tunix's own GRPO (`GRPOLearner`, `RLCluster`, vanilla `Sampler`
rollout) with rollout accounting. Tunix's pieces only; nothing here is
block diffusion.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.sft import metrics_logger as metrics_lib
from tunix.sft import peft_trainer

from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import ar_teacher
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data

Mode = rl_cluster_lib.Mode
Role = rl_cluster_lib.Role


class CountingRLCluster(rl_cluster_lib.RLCluster):
  """Tunix's `RLCluster`, recording rollout row lengths while `recording`."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.recording = False
    self.rollout_records: list[tuple[list[int], int]] = []

  def generate(self, prompts, *args, **kwargs):
    output = super().generate(prompts, *args, **kwargs)
    if self.recording:
      lengths = [len(t) for t in output.tokens]
      self.rollout_records.append(
          (lengths, kwargs.get("micro_batch_size") or len(lengths))
      )
    return output


def ar_rollout_cost(records, max_new_tokens: int) -> dict[str, int]:
  """Rollouts, tokens and model calls of recorded AR rollouts.

  Tunix's sampler prefills (sampling the first token) and then decodes one
  token per call until every row of the micro-batch has emitted EOS or the
  budget is spent: `max(min(length + 1, budget))` calls per micro-batch.
  """
  lengths = [n for row_lengths, _ in records for n in row_lengths]
  calls = row_calls = 0
  for row_lengths, micro in records:
    for start in range(0, len(row_lengths), micro):
      chunk = row_lengths[start : start + micro]
      chunk_calls = max(min(n + 1, max_new_tokens) for n in chunk)
      calls += chunk_calls
      row_calls += chunk_calls * len(chunk)
  return {
      "rollouts": len(lengths),
      "rollout_tokens": rl_common.generated_tokens(lengths, max_new_tokens),
      "rollout_model_calls": calls,
      "rollout_row_calls": row_calls,
  }


def ar_model(sft_cfg, seed: int):
  """A Tunix Qwen3 with the block-diffusion policy's shape."""
  m = sft_cfg.model
  return tiny_models.tiny_qwen3(
      int(m.vocab_size),
      seed=seed,
      num_layers=int(m.num_layers),
      embed_dim=int(m.embed_dim),
      hidden_dim=int(m.hidden_dim),
      num_heads=int(m.num_heads),
      head_dim=int(m.head_dim),
      num_kv_heads=int(m.num_kv_heads),
  )


def sft_pairs(sft_cfg, held_out_rows):
  """The block-diffusion SFT job's training pairs (held-out prompts removed)."""
  task = rl_data.task_prompts(sft_cfg, 0, seed=0).task
  held = {row["prompt"] for row in held_out_rows}
  pairs = task.sample(int(sft_cfg.task.num_train), seed=int(sft_cfg.task.seed))
  return [pair for pair in pairs if pair[0] not in held]


def ar_warm_start(model, tokenizer, sft_cfg, rows, reward_fn, target, opts):
  """Causal SFT of `model` until held-out greedy EM >= `target`.

  Evaluates every `opts.ar_eval_every` steps (and at step 0) and stops at the
  first evaluation reaching `target`, or after `opts.ar_max_steps`; the
  model is then set to the evaluated parameters closest to `target` (the
  last evaluation can overshoot it).

  Returns:
    (greedy EM history [(step, em)], (step, em) of the parameters kept).
  """
  cache = int(opts.max_prompt_length) + int(opts.max_new_tokens) + 8
  sampler = sampler_lib.Sampler(
      model,
      tokenizer,
      sampler_lib.CacheConfig(
          cache_size=cache,
          num_layers=model.config.num_layers,
          num_kv_heads=model.config.num_kv_heads,
          head_dim=model.config.head_dim,
      ),
  )
  batch = next(rl_data.prompt_batches(rows, len(rows)))
  prompts = list(batch.pop("prompts"))

  def greedy_em() -> float:
    sampler.transformer_state = nnx.variables(model)
    output = sampler(
        prompts,
        max_generation_steps=int(opts.max_new_tokens),
        max_prompt_length=int(opts.max_prompt_length),
        temperature=0.0,
    )
    return float(
        np.mean(
            reward_fn(
                prompts=prompts, completions=output.text, mode="eval", **batch
            )
        )
    )

  history = [(0, greedy_em())]
  kept = [history[0], jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))]
  trainer = peft_trainer.PeftTrainer(
      model,
      optax.chain(
          optax.clip_by_global_norm(1.0),
          optax.adamw(
              optax.linear_schedule(0.0, opts.ar_learning_rate, 20), b2=0.99
          ),
      ),
      peft_trainer.TrainingConfig(
          eval_every_n_steps=10**9,
          max_steps=int(opts.ar_max_steps),
          pbar_description="AR causal SFT",
      ),
  )
  batches = ar_teacher.causal_lm_batches(
      sft_pairs(sft_cfg, rows),
      tokenizer,
      seq_len=int(sft_cfg.data.seq_len),
      batch_size=int(sft_cfg.data.batch_size),
      seed=int(sft_cfg.seed) + 11,
  )

  def until_target():
    step = 0
    while history[-1][1] < target and step < int(opts.ar_max_steps):
      for _ in range(int(opts.ar_eval_every)):
        yield next(batches)
        step += 1
      history.append((step, greedy_em()))
      if abs(history[-1][1] - target) < abs(kept[0][1] - target):
        kept[:] = [
            history[-1],
            jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)),
        ]

  if history[-1][1] < target:
    trainer.train(until_target())
  nnx.update(model, kept[1])
  return history, kept[0]


def ar_cluster(cfg, model, tokenizer, out) -> "CountingRLCluster":
  """Tunix's RLCluster with the vanilla Sampler rollout for the AR model.

  TRAIN rollouts sample at `rollout.temperature` from the full distribution
  (`top_p=1.0`: Tunix's Sampler decodes greedily when `top_p` is None);
  EVAL rollouts are greedy.
  """
  grpo_cfg = cfg.grpo
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  mesh = rl_common.rl_mesh(None)
  steps, per_step = int(grpo_cfg.steps), int(grpo_cfg.prompts_per_step)
  configs = rl_common.rollout_configs(
      cfg,
      max_new_tokens,
      kv_cache_size=int(cfg.rollout.max_prompt_length) + max_new_tokens + 8,
  )
  configs[Mode.TRAIN] = dataclasses.replace(configs[Mode.TRAIN], top_p=1.0)
  return CountingRLCluster(
      actor=model,
      reference=None,
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              Role.ACTOR: mesh,
              Role.REFERENCE: mesh,
              Role.ROLLOUT: mesh,
          },
          rollout_engine="vanilla",
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=rl_common.make_rl_optimizer(grpo_cfg),
              eval_every_n_steps=10**9,
              max_steps=steps * int(grpo_cfg.num_iterations),
              mini_batch_size=per_step,
              train_micro_batch_size=int(grpo_cfg.micro_batch_prompts),
              metrics_logging_options=metrics_lib.MetricsLoggerOptions(
                  log_dir=str(out / "ar" / "tensorboard"),
                  flush_every_n_steps=20,
              ),
              pbar_description="autoregressive GRPO",
          ),
          rollout_config=configs,
      ),
  )


def ar_grpo(cfg, model, tokenizer, prompts: rl_data.PromptSet, reward_fn, out):
  """Tunix's GRPO (vanilla Sampler rollout) on the AR model; a summary row."""
  grpo_cfg = cfg.grpo
  per_step = int(grpo_cfg.prompts_per_step)
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  mesh = rl_common.rl_mesh(None)
  train_rewards: list[float] = []

  def tracked_reward(prompts, completions, **kwargs):
    rewards = reward_fn(prompts=prompts, completions=completions, **kwargs)
    if kwargs.get("mode", "train") == "train":
      train_rewards.extend(np.asarray(rewards, np.float64).tolist())
    return rewards

  cluster = ar_cluster(cfg, model, tokenizer, out)
  learner = grpo_learner.GRPOLearner(
      cluster,
      grpo_learner.GRPOConfig(
          num_generations=int(grpo_cfg.num_generations),
          num_iterations=int(grpo_cfg.num_iterations),
          beta=float(grpo_cfg.beta),
          epsilon=float(grpo_cfg.epsilon),
          loss_agg_mode=str(grpo_cfg.loss_agg_mode),
      ),
      reward_fns=[tracked_reward],
  )

  def evaluate():
    with mesh:
      return [
          rl_common.evaluate_rewards(
              cluster,
              prompts.held_out,
              reward_fn,
              samples=samples,
              mode=mode,
              batch_size=int(cfg.eval.batch_size),
          )
          for samples, mode in (
              (int(cfg.eval.samples_per_prompt), Mode.TRAIN),
              (1, Mode.EVAL),
          )
      ]

  start = evaluate()
  clock = common.Stopwatch()
  cluster.recording = True  # Training rollouts only.
  with mesh:
    learner.train(list(rl_data.prompt_batches(prompts.train, per_step)))
  cluster.recording = False
  seconds = clock()
  end = evaluate()
  size = per_step * int(grpo_cfg.num_generations)
  cost = ar_rollout_cost(cluster.rollout_records, max_new_tokens)
  return {
      "reward_start": start[0],
      "reward_end": end[0],
      "greedy_exact_match_start": start[1],
      "greedy_exact_match_end": end[1],
      "rollout_tokens": cost["rollout_tokens"],
      "rollout_model_calls": cost["rollout_model_calls"],
      "rollout_row_calls": cost["rollout_row_calls"],
      "rl_seconds": seconds,
      "groups_with_signal": rl_common.groups_with_signal(
          train_rewards, int(grpo_cfg.num_generations)
      ),
      "train_step_rewards": [
          float(np.mean(train_rewards[i : i + size]))
          for i in range(0, len(train_rewards), size)
      ],
  }
