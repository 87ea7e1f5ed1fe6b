"""What the `rl` and `opd` jobs share: Tunix RL plumbing and reward metrics.

The mesh, the rollout engine, rollout configs, the cluster config, the
optimizer and the held-out reward evaluation are built the same way for
GRPO and OPD. The policy is loaded by `jobs.rl_policy`; prompts and rewards
are in `runs.rl_data`.
"""

from __future__ import annotations

import dataclasses

import functools
import pathlib
from typing import Sequence

import jax
import numpy as np
import optax
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger as metrics_lib

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.rl import engine as engine_lib

Mode = rl_cluster_lib.Mode


def rl_mesh(mesh_cfg) -> jax.sharding.Mesh:
  """The mesh of the rl and opd jobs, over every process's devices.

  Rollouts, scores and teacher logits shard their rows over `fsdp` (results
  gathered on every process); parameters follow the model's partition specs
  (`fsdp`, `tp`). Context parallelism (`sp`) is for SFT only.

  Args:
    mesh_cfg: The recipe's `mesh` ({fsdp, tp}) or None: one device with one
      process, `fsdp` over every device with several.

  Raises:
    errors.UsageError: `mesh.sp` > 1, or a mesh the devices do not fit.
  """
  try:
    shape = distributed.mesh_shape(common.to_dict(mesh_cfg or {}))
    if shape["sp"] > 1:
      raise ValueError(
          f"mesh.sp={shape['sp']}: the rl and opd rollouts shard prompts over"
          " mesh.fsdp and parameters over mesh.fsdp/mesh.tp; context"
          " parallelism (sp) is for sft only"
      )
    mesh = common.build_mesh(mesh_cfg)
  except ValueError as e:
    raise errors.UsageError(str(e)) from e
  if mesh is None:  # One process, no mesh asked for: one device.
    mesh = distributed.build_mesh({})
  return mesh


def rollout_configs(cfg, max_new_tokens: int, **extra) -> dict:
  """TRAIN (sampling) and EVAL (greedy, for exact match) `RolloutConfig`s.

  Args:
    cfg: The job recipe (`rollout.temperature`, `rollout.max_prompt_length`).
    max_new_tokens: Tokens to generate per completion.
    **extra: Further `RolloutConfig` fields for both modes (for example
      `kv_cache_size` for Tunix's vanilla engine).
  """
  common_args = dict(
      max_tokens_to_generate=max_new_tokens,
      max_prompt_length=int(cfg.rollout.max_prompt_length),
      top_p=None,
      top_k=None,
      **extra,
  )
  return {
      Mode.TRAIN: base_rollout.RolloutConfig(
          temperature=float(cfg.rollout.temperature), **common_args
      ),
      Mode.EVAL: base_rollout.RolloutConfig(temperature=0.0, **common_args),
  }


def recipe_scoring_attention(cfg, sft_cfg) -> config_lib.AttentionConfig:
  """`rollout.attention` (with `rollout.attention_tile`) when set, else the
  SFT recipe's `model.attention`; the per-example (`dynamic`) Splash mask.

  Raises:
    UsageError: a bad value, named by its recipe key.
  """
  section = cfg.rollout
  if section.get("attention") is not None:
    attention = common.attention_config_from(
        {"attention": section.attention,
         "attention_tile": section.get("attention_tile")},
        key="rollout.attention")
  else:
    attention = common.attention_config_from(sft_cfg.model)
  # Rollout rows are laid out by the engine, not by the SFT packing the
  # recipe's mask mode was chosen for: the per-example mask, always right.
  return dataclasses.replace(attention, mask_mode="dynamic")


def scoring_attention(cfg, sft_cfg, policy):
  """The trajectory scorers' attention: `rollout.attention`, else the policy's.

  `rollout.attention` (`auto|dense|splash`, with `rollout.attention_tile`)
  when set, else the SFT recipe's `model.attention`. Scored rows hold
  `rollout.max_prompt_length + rollout.max_tokens_to_generate` slots and
  the scorers call the model two-stream over them (twice that); a `splash`
  that cannot tile it is refused here, in one line, before any rollout.

  Returns:
    The `AttentionConfig` where the scorers run Splash (`splash`, or
    `auto` on a TPU at a length it tiles), else None: dense, the default.

  Raises:
    UsageError: a bad value, or `splash` where it cannot run.
  """
  section = cfg.rollout
  attention = recipe_scoring_attention(cfg, sft_cfg)
  # The scorers' one model call is two-stream over the scored rows.
  length = 2 * (int(section.max_prompt_length) + int(
      section.max_tokens_to_generate))
  return common.training_attention(attention, policy, length)


def engine_factory(cfg, sft_cfg, attention=None):
  """`functools.partial(BlockDiffusionRollout, ...)` from the SFT objective.

  `attention`: the scorers' (`scoring_attention`), None for dense.
  """
  return functools.partial(
      engine_lib.BlockDiffusionRollout,
      block_size=int(sft_cfg.diffusion.block_size),
      mask_token_id=int(sft_cfg.diffusion.mask_token_id),
      alignment=str(sft_cfg.diffusion.alignment),
      threshold=float(cfg.rollout.threshold),
      steps_per_block=cfg.rollout.get("steps_per_block"),
      sub_block_size=cfg.rollout.get("sub_block_size"),
      cache_phases=cfg.rollout.get("cache_phases"),
      lockstep=cfg.rollout.get("lockstep", False),
      ragged_cache=cfg.rollout.get("ragged_cache", False),
      fused_head=cfg.rollout.get("fused_head", False),
      one_program=cfg.rollout.get("one_program", False),
      seed=int(cfg.seed),
      attention=attention,
  )


def cluster_config(
    algo_cfg,
    out: pathlib.Path,
    mesh: jax.sharding.Mesh,
    rollout_engine,
    rollout_config: dict,
    *,
    max_steps: int,
    description: str,
    checkpoints: tuple[int | None, int] = (None, 3),
) -> rl_cluster_lib.ClusterConfig:
  """The `ClusterConfig` of an rl/opd job (every role on `mesh`).

  Args:
    algo_cfg: The recipe's `grpo` or `opd` section (learning rate, ...,
      `prompts_per_step`, `micro_batch_prompts`).
    out: The job's output_dir (TensorBoard logs, checkpoints).
    mesh: The job's mesh.
    rollout_engine: A `BaseRollout` factory (`engine_factory`, ...).
    rollout_config: `rollout_configs(...)`.
    max_steps: Optimizer steps.
    description: The progress bar's label.
    checkpoints: (every n steps or None, max to keep) from
      `rl_checkpoints.checkpoint_every`.
  """
  every, keep = checkpoints
  return rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in (
          rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
          rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine=rollout_engine,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=make_rl_optimizer(algo_cfg),
          eval_every_n_steps=10**9,
          max_steps=max_steps,
          mini_batch_size=int(algo_cfg.prompts_per_step),
          train_micro_batch_size=int(algo_cfg.micro_batch_prompts),
          metrics_logging_options=metrics_lib.MetricsLoggerOptions(
              log_dir=str(out / "tensorboard"), flush_every_n_steps=20
          ),
          pbar_description=description,
          **rl_checkpoints.training_config_kwargs(out, every, keep),
      ),
      rollout_config=rollout_config,
  )


def tracked_reward(reward_fn, rewards: list[float]):
  """`reward_fn` that also appends its training-mode rewards to `rewards`."""

  @functools.wraps(reward_fn)
  def tracked(prompts, completions, **kwargs):
    values = reward_fn(prompts=prompts, completions=completions, **kwargs)
    if kwargs.get("mode", "train") == "train":
      rewards.extend(np.asarray(values, np.float64).tolist())
    return values

  return tracked


def per_step_means(values: Sequence[float], per_step: int) -> list[float]:
  """Means of consecutive `per_step` values (one per optimizer step)."""
  return [float(np.mean(values[i:i + per_step]))
          for i in range(0, len(values), per_step)]


def make_rl_optimizer(algo_cfg) -> optax.GradientTransformation:
  """AdamW at a constant learning rate, gradients clipped by global norm."""
  adamw = optax.adamw(
      float(algo_cfg.learning_rate),
      b1=0.9,
      b2=float(algo_cfg.get("adam_b2", 0.99)),
      weight_decay=float(algo_cfg.get("weight_decay", 0.0)),
  )
  clip = float(algo_cfg.get("grad_clip", 0.0) or 0.0)
  return (
      optax.chain(optax.clip_by_global_norm(clip), adamw) if clip > 0 else adamw
  )


def evaluate_rewards(
    cluster,
    rows: Sequence[rl_data.Row],
    reward_fn,
    *,
    samples: int,
    mode: Mode,
    batch_size: int,
    completions: list[dict[str, str]] | None = None,
    per_rollout: list[float] | None = None,
) -> float:
  """Mean reward of `samples` rollouts per held-out row in `mode`.

  `cluster` is an `RLCluster` or anything with `generate(prompts, mode=)`
  returning an object with the completions as `.text`.

  The reward function is called as Tunix calls it (every row column as a
  keyword, `mode="eval"`). The last batch may be partial. When given,
  `completions` receives a `{"prompt", "completion"}` dict per rollout and
  `per_rollout` each rollout's reward (row-major: row i's samples at
  `i * samples ...`).
  """
  rewards = []
  repeated = [row for row in rows for _ in range(samples)]
  for start in range(0, len(repeated), batch_size):
    chunk = repeated[start : start + batch_size]
    batch = next(rl_data.prompt_batches(chunk, len(chunk)))
    prompts = list(batch.pop("prompts"))
    output = cluster.generate(prompts, mode=mode)
    if completions is not None:
      completions.extend(
          {"prompt": p, "completion": c} for p, c in zip(prompts, output.text)
      )
    rewards.extend(
        np.asarray(
            reward_fn(
                prompts=prompts,
                completions=output.text,
                mode=str(Mode.EVAL),
                **batch,
            ),
            np.float64,
        ).tolist()
    )
  if per_rollout is not None:
    per_rollout.extend(rewards)
  return float(np.mean(rewards))


def generated_tokens(lengths: Sequence[int], max_new_tokens: int) -> int:
  """Tokens generated for rows of `lengths` tokens before EOS (EOS counted).

  A row shorter than `max_new_tokens` stopped at an EOS, which counts; a row
  of `max_new_tokens` tokens ran out of room.
  """
  return int(
      sum(n + 1 if n < max_new_tokens else max_new_tokens for n in lengths)
  )


def groups_with_signal(rewards: Sequence[float], group_size: int) -> float:
  """Fraction of GRPO groups whose rewards differ (nonzero advantages).

  `rewards` lists each prompt's `group_size` rollouts consecutively, as
  Tunix's learners repeat prompts; a group of equal rewards gives every
  rollout advantage 0, so no gradient.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.size == 0:
    return float("nan")
  if rewards.size % group_size:
    raise ValueError(
        f"{rewards.size} rewards do not split into groups of {group_size}"
    )
  groups = rewards.reshape(-1, group_size)
  return float(np.mean(groups.max(axis=1) > groups.min(axis=1)))


def block_diffusion_rollout_cost(
    outputs: Sequence[engine_lib.BlockDiffusionRolloutOutput],
    max_new_tokens: int,
) -> dict[str, int]:
  """Rollouts, generated tokens and sequential model calls of rollouts.

  Args:
    outputs: `BlockDiffusionRollout.generate` outputs (one per micro-batch,
      e.g. from `rollout.record_outputs()`).
    max_new_tokens: The rollouts' completion budget.

  Returns:
    `rollouts`, `rollout_tokens` (to the first EOS, EOS included),
    `rollout_model_calls`: per micro-batch one prompt prefill plus its
    denoising steps (all rows step together; a finished block's keys and
    values are written by the next block's first step), and
    `rollout_row_calls`: the same calls times the micro-batch's rows.
  """
  calls = [2 + int(np.max(o.commit_steps)) for o in outputs]
  return {
      "rollouts": int(sum(len(o.tokens) for o in outputs)),
      "rollout_tokens": generated_tokens(
          [len(t) for o in outputs for t in o.tokens], max_new_tokens
      ),
      "rollout_model_calls": int(sum(calls)),
      "rollout_row_calls": int(
          sum(c * len(o.tokens) for c, o in zip(calls, outputs))
      ),
  }


__all__ = [
    "block_diffusion_rollout_cost",
    "cluster_config",
    "engine_factory",
    "evaluate_rewards",
    "generated_tokens",
    "groups_with_signal",
    "make_rl_optimizer",
    "per_step_means",
    "recipe_scoring_attention",
    "rollout_configs",
    "rl_mesh",
    "scoring_attention",
    "tracked_reward",
]
