"""The autoregressive teacher of the `opd` job, with Tunix's own pieces.

A Tunix Qwen3 trained causally with `PeftTrainer` and its default next-token
loss on (prompt, answer) pairs, and its greedy exact match measured with
Tunix's `Sampler`. The RL-vs-AR benchmark's autoregressive peer is trained
from the same batches.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from tunix.generate import sampler as sampler_lib
from tunix.sft import peft_trainer

from tunix_blockdiff import distributed
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_data


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
    teacher_cfg,
    tokenizer,
    vocab_size: int,
    pairs,
    *,
    seq_len: int,
    seed: int,
    mesh: jax.sharding.Mesh | None = None,
    checkpoint_dir: str | None = None,
):
  """A Tunix Qwen3 trained causally (next-token loss) with `PeftTrainer`.

  On a `mesh` of several devices the model is sharded by its partition specs
  and trained data-parallel: each process places only its rows of every
  batch (the global batches equal one process's). With `checkpoint_dir`
  the trained teacher is saved there (its last step); a later call with
  the same directory restores it instead of training again (the losses it
  returns are then those of the steps it ran: none).
  """
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
  if bool(teacher_cfg.get("random_mlp", False)):
    # Tunix zero-initialises feed-forward kernels: a saddle they never leave.
    model = tiny_models.random_mlps(model, seed=seed)
  if distributed.shards_rows(mesh):
    model = common.shard_model(model, mesh)
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
          checkpoint_root_directory=checkpoint_dir,
          checkpointing_options=ocp.CheckpointManagerOptions(
              save_interval_steps=steps, max_to_keep=1
          ),
      ),
  )
  prior = _track_losses(trainer, checkpoint_dir)
  batch_size = int(teacher_cfg.batch_size)
  batches = causal_lm_batches(
      pairs, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed
  )
  if distributed.shards_rows(mesh):
    lo, hi = distributed.process_rows(mesh, batch_size)
    batches = (
        distributed.global_batch(
            {k: v[lo:hi] for k, v in batch.items()}, mesh, batch_size
        )
        for batch in batches
    )
  with common.mesh_scope(mesh):
    trainer.train(batches)
  return trainer.model, np.asarray(prior + _losses(trainer), np.float64)


def _losses(trainer) -> list[float]:
  """The training losses the trainer logged in this process."""
  logger = trainer.metrics_logger
  if not logger.metric_exists(trainer.metrics_prefix, "loss", "train"):
    return []
  return np.asarray(logger.get_metric_history(
      trainer.metrics_prefix, "loss", "train"), np.float64).tolist()


def _track_losses(trainer, checkpoint_dir: str | None) -> list[float]:
  """Saves the loss history with each teacher checkpoint; returns the
  history up to the restored step (empty for a fresh start).

  Beside `checkpoint_dir` (in `<checkpoint_dir>_losses/<step>.json`), so a
  teacher restored from any of its checkpoints reports every step's loss,
  as one that trained without a stop.
  """
  if checkpoint_dir is None:
    return []
  state_dir = pathlib.Path(f"{checkpoint_dir}_losses")
  prior = []
  state = state_dir / f"{int(trainer.train_steps)}.json"
  if trainer.train_steps and state.is_file():
    prior = list(json.loads(state.read_text())["losses"])
  trainer.checkpoint_manager = rl_checkpoints.StatefulCheckpointManager(
      trainer.checkpoint_manager, state_dir,
      lambda: {"losses": prior + _losses(trainer)})
  return prior


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


__all__ = ["causal_lm_batches", "teacher_exact_match", "train_ar_teacher"]
