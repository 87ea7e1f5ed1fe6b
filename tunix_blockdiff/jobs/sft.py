"""`tunix-blockdiff sft [RECIPE.yaml] [key=value ...]`: block-diffusion SFT.

With no recipe it runs the bundled `tiny.yaml`: a small Tunix Qwen3 trained
from scratch on a synthetic task, then evaluated with `generate`. Writes to
`output_dir`: the resolved recipe, Orbax checkpoints (`checkpoints/`),
TensorBoard metrics (`tensorboard/`), `summary.json` and `sft.png` (loss
curves; exact match against tokens per model call over a threshold sweep).

`dataset.train=FILES [dataset.eval=FILES]` trains on your jsonl, parquet or
save_to_disk files instead of the task (`runs/sft_data.py`,
docs/sft_data.md); on them the eval adds edit similarity and prints samples coloured
by commit step, and `summary.json` counts the bad rows.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

from flax import nnx

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import models
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import outputs
from tunix_blockdiff.runs import sft_data as sft_data_lib

FIGURE_FILE = "sft.png"

ProgressLines = outputs.ProgressLines


def _data_config(cfg, tokenizer, vocab_size: int) -> data_lib.DataConfig:
  """The recipe's `data` section; a bad value is a `UsageError`."""
  try:
    return data_lib.DataConfig(
        seq_len=int(cfg.data.seq_len),
        batch_size=int(cfg.data.batch_size),
        vocab_size=vocab_size,
        seed=int(cfg.seed),
        packing=cfg.data.packing,
        cp_size=int(cfg.data.cp_size),
        pad_token_id=tokenizer.pad_id(),
        completion_fill_id=(
            tokenizer.eos_id() if cfg.data.fill_completion_with_eos else None
        ),
    )
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"recipe section data: {e}") from None


def _datasets(task_data, diffusion, data_config, cfg, mesh):
  """(train batches, eval batches or None); global arrays under a mesh.

  Under a mesh, `data.cp_size` follows `mesh.sp`, each process builds only
  the rows of every training batch its devices hold, and the batches are
  global arrays: the same global batch as one process builds alone.
  """
  eval_size = int(cfg.eval.batch_size)
  rows = None
  if mesh is not None:
    data_config = dataclasses.replace(
        data_config,
        cp_size=distributed.check_cp_size(mesh, data_config.cp_size),
    )
    rows = distributed.process_rows(mesh, data_config.batch_size)
  train_ds = data_lib.SFTBatches(
      task_data.train, diffusion, data_config, rows=rows
  )
  eval_ds = None
  if task_data.eval is not None:
    eval_ds = data_lib.eval_batches(
        task_data.eval,
        diffusion,
        dataclasses.replace(data_config, batch_size=eval_size),
    )
  if mesh is None:
    return train_ds, eval_ds
  train_ds = distributed.GlobalBatches(
      train_ds, mesh, data_config.batch_size
  )
  if eval_ds is not None:
    eval_ds = distributed.GlobalBatches(eval_ds, mesh, eval_size, sliced=True)
  return train_ds, eval_ds


def _cp_size(cfg) -> int:
  """The rows' context-parallel order: `data.cp_size`, or `mesh.sp`."""
  mesh_cfg = cfg.get("mesh")
  sp = int(mesh_cfg.get("sp", 1)) if mesh_cfg is not None else 1
  return max(int(cfg.data.cp_size), sp)


def _check_cp_window(cfg, model) -> None:
  """Context-parallel reordering moves slots: refuse a window it would cut."""
  if _cp_size(cfg) > 1:
    try:
      models.check_window(
          model,
          int(cfg.data.seq_len),
          what="context-parallel reordering (data.cp_size or mesh.sp > 1)",
          fix="Use data.cp_size=1 and mesh.sp=1, or data.seq_len <= window.",
      )
    except ValueError as e:
      raise errors.UsageError(str(e)) from None


def run(cfg) -> dict[str, Any]:
  """Runs the recipe with its model kind's SFT; returns the summary."""
  return kinds.of_recipe(cfg).call("sft", cfg)


def run_block_diffusion(cfg) -> dict[str, Any]:
  """Block-diffusion SFT of a Tunix causal LM (the summary it writes)."""
  attention = common.attention_config_from(cfg.model)
  remat = common.remat_policy_from(cfg.model)
  head_chunk = common.head_chunk_from(cfg.model)
  mesh = common.mesh_for_attention(common.build_mesh(cfg.get("mesh")),
                                   attention)
  with common.mesh_scope(mesh):
    return _run(cfg, mesh, attention, remat, head_chunk)


def _run(cfg, mesh, attention, remat, head_chunk) -> dict[str, Any]:
  clock = common.Stopwatch()
  diffusion = common.diffusion_config_from(cfg.diffusion)
  common.check_released_settings(cfg.model, diffusion)
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  model = common.build_model(cfg.model, seed=int(cfg.seed), mesh=mesh)
  vocab_size = common.model_vocab_size(model)
  _check_cp_window(cfg, model)
  # Splash or dense masks for the training logits (`model.attention`).
  span = int(cfg.data.seq_len) * (2 if diffusion.stream == "two_stream" else 1)
  attention = common.training_mask_mode(
      common.training_attention(attention, model, span),
      str(cfg.data.packing), _cp_size(cfg))
  print("training attention:"
        f" {f'splash ({attention.mask_mode} mask)' if attention else 'dense'}",
        flush=True)
  # The built-in task, or the user's files when `dataset` is set.
  task_data = sft_data_lib.build_sft_data(
      cfg,
      tokenizer,
      seq_len=int(cfg.data.seq_len),
      vocab_size=vocab_size,
      mask_token_id=diffusion.mask_token_id,
  )
  # After the data: a bad row stops the job with nothing written.
  out = common.prepare_output_dir(cfg)
  base_model = model
  model = common.apply_lora(model, cfg.lora, seed=int(cfg.seed))
  model = common.shard_model(model, mesh)
  data_config = _data_config(cfg, tokenizer, vocab_size)
  train_ds, eval_ds = _datasets(task_data, diffusion, data_config, cfg, mesh)
  trainer = trainer_lib.BlockDiffusionTrainer(
      model,
      common.make_optimizer(cfg.training),
      outputs.make_training_config(cfg, out),
      diffusion,
      attention=attention,
      remat=remat,
      head_chunk=head_chunk,
  )
  outputs.show_progress(
      trainer,
      int(cfg.training.eval_every_n_steps) // 2 or 1,
      int(cfg.training.max_steps),
      out,
  )
  start_step = trainer.train_steps
  trainer.train(train_ds, eval_ds)
  train_seconds = clock()

  report = dict(
      cfg=cfg,
      out=out,
      trainer=trainer,
      task_data=task_data,
      start_step=start_step,
      train_seconds=train_seconds,
      clock=clock,
  )
  if eval_ds is None:
    # A dataset without `eval`: training only.
    return _finish(**report)
  final_eval_loss = outputs.eval_loss(trainer, eval_ds)
  # Generation runs on the LoRA-merged weights: the same function, without
  # qwix's interception inside the jitted denoising loop.
  eval_model = trainer.model
  # LoRA-ness comes from the recipe: sharding makes a new model object, so
  # `model is not base_model` holds with or without LoRA.
  if common.lora_enabled(cfg.lora):
    eval_model = checkpoints.merge_lora(
        trainer.model,
        base_model,
        rank=int(cfg.lora.rank),
        alpha=float(cfg.lora.alpha),
    )
  max_new_tokens = max(ex.completion.size for ex in task_data.eval)
  sweep = []
  main_eval = None
  main_threshold = float(cfg.eval.threshold)
  thresholds = sorted(
      {float(t) for t in cfg.eval.thresholds} | {main_threshold}
  )
  for threshold in thresholds:
    result = common.evaluate_generation(
        eval_model,
        task_data.eval,
        task_data.eval_pairs,
        task_data.task,
        tokenizer,
        config_lib.DenoiseConfig(
            block_size=diffusion.block_size,
            mask_token_id=diffusion.mask_token_id,
            threshold=threshold,
            alignment=diffusion.alignment,
            eos_token_id=tokenizer.eos_id(),
            pad_token_id=tokenizer.pad_id(),
        ),
        max_new_tokens=max_new_tokens,
        batch_size=int(cfg.eval.batch_size),
        use_cache=bool(cfg.eval.use_cache),
        mesh=mesh,
    )
    sweep.append(result.row())
    if threshold == main_threshold:
      main_eval = result
  if task_data.bad_rows is not None:
    print(
        sft_data_lib.render_samples(
            main_eval,
            task_data.eval_pairs,
            tokenizer,
            diffusion.block_size,
            color=sys.stdout.isatty(),
        )
    )
  return _finish(
      **report, eval_loss=final_eval_loss, main_eval=main_eval, sweep=sweep
  )


def _finish(
    *,
    cfg,
    out,
    trainer,
    task_data,
    start_step,
    train_seconds,
    clock,
    eval_loss=None,
    main_eval=None,
    sweep=(),
) -> dict[str, Any]:
  """Writes the summary and figure; generation metrics when evaluated."""
  evaluated = main_eval is not None
  train_loss = outputs.metric_history(trainer, "loss", "train")
  eval_history = outputs.metric_history(trainer, "loss", "eval")
  eval_every = int(cfg.training.eval_every_n_steps)
  eval_steps = [start_step + i * eval_every for i in range(len(eval_history))]
  summary = {
      "recipe": common.to_dict(cfg),
      "train_steps": trainer.train_steps,
      "attention": "splash" if trainer.attention else "dense",
      "attention_mask_mode": (trainer.attention.mask_mode
                              if trainer.attention else None),
      "head_chunk": trainer.head_chunk,
      "final_train_loss": float(train_loss[-1]) if train_loss.size else None,
      # Per optimizer step of this run (from its start or resume step).
      "train_losses": train_loss.tolist(),
      "eval_loss": eval_loss,
      "eval_exact_match": main_eval.exact_match if evaluated else None,
      "tokens_per_step": main_eval.tokens_per_step if evaluated else None,
      "threshold": main_eval.threshold if evaluated else None,
      "threshold_sweep": list(sweep),
      "eval_examples": len(task_data.eval) if evaluated else 0,
      "train_examples": len(task_data.train),
      "num_params": outputs.num_params(trainer.model),
      "num_lora_params": outputs.num_params(trainer.model, nnx.LoRAParam),
      "train_seconds": train_seconds,
      "seconds": clock(),
      "sample_completions": [
          {"prompt": p, "answer": a, "completion": c}
          for (p, a), c in list(
              zip(
                  task_data.eval_pairs,
                  main_eval.completions if evaluated else (),
              )
          )[:5]
      ],
  }
  if task_data.bad_rows is not None:
    summary["bad_rows"] = task_data.bad_rows
    if evaluated:
      summary["eval_edit_similarity"] = sft_data_lib.mean_edit_similarity(
          main_eval.completions, task_data.eval_pairs
      )
  common.plot_training_figure(
      out / FIGURE_FILE,
      train_loss=train_loss,
      eval_steps=eval_steps,
      eval_loss=eval_history,
      sweep=sweep,
      title=(
          f"{task_data.name}: stream={cfg.diffusion.stream},"
          f" block={cfg.diffusion.block_size}"
          + (
              f", EM {main_eval.exact_match:.3f} at"
              f" {main_eval.tokens_per_step:.2f} tokens/call (threshold"
              f" {main_eval.threshold:g})"
              if evaluated
              else ""
          )
      ),
  )
  common.write_summary(out, summary)
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  return common.job_main(
      argv,
      command="sft",
      doc=__doc__,
      default_recipe="tiny.yaml",
      run=run,
      keys=(
          "train_steps",
          "final_train_loss",
          "eval_loss",
          "eval_exact_match",
          "tokens_per_step",
          "seconds",
      ),
  )


if __name__ == "__main__":
  sys.exit(main())
