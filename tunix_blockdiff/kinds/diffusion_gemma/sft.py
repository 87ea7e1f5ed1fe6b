"""DiffusionGemma in the `tunix-blockdiff` jobs: `sft` and `generate`.

`tunix-blockdiff sft diffusion_gemma_tiny.yaml` trains a DiffusionGemma
(`model.kind: tiny_diffusion_gemma` from scratch, or `diffusion_gemma_hf`
with `model.path` an HF checkpoint directory) on the DiffusionGemma
objective (`kinds.diffusion_gemma.objective`) with `DiffusionGemmaTrainer`
(Orbax checkpoints, exact resume, LoRA), then samples every held-out prompt
with the entropy-bound sampler and reports exact match and forward passes
per token. `sft` and `generate` hand a recipe or directory of this family
to this module.

`tunix-blockdiff generate RUN_OR_HF_DIR [key=value ...]` on this family is
`kinds/diffusion_gemma/generate.py`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence

from flax import nnx
import jax
import numpy as np
import omegaconf

from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.kinds.diffusion_gemma import data as dg_data
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import outputs
from tunix_blockdiff.runs import sft_data as sft_data_lib
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import objective as dg_objective
from tunix_blockdiff.kinds.diffusion_gemma import recipe_schema
from tunix_blockdiff.kinds.diffusion_gemma import trainer as dg_trainer
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout

_TINY_KEYS = recipe_schema.TINY_SIZES
_SAMPLER_KEYS = recipe_schema.SAMPLER_KEYS
FIGURE_FILE = "sft.png"


def is_recipe(cfg) -> bool:
  """Whether a recipe's model is a DiffusionGemma (by the kind registry)."""
  return kinds.of_recipe(cfg).name == "diffusion_gemma"


def is_hf_dir(path: str | pathlib.Path) -> bool:
  """Whether `path` is an HF DiffusionGemma checkpoint directory."""
  config = pathlib.Path(path).expanduser() / "config.json"
  if not config.is_file():
    return False
  try:
    return json.loads(config.read_text()).get("model_type") == (
        "diffusion_gemma")
  except json.JSONDecodeError:
    return False


def build_model(model_cfg, *, seed: int):
  """(model, sampler defaults or None) of a recipe's `model` section."""
  kind = model_cfg.kind
  if kind == "diffusion_gemma_hf":
    if not model_cfg.get("path"):
      raise errors.UsageError(
          "model.kind=diffusion_gemma_hf needs model.path (an HF dir)")
    try:
      model, sampler, _ = dg.load(model_cfg.path, dtype=model_cfg.dtype,
                                  param_dtype=model_cfg.get("param_dtype"))
    except FileNotFoundError as e:
      raise errors.MissingFileError(str(e)) from None
    except ValueError as e:
      raise errors.UsageError(f"model.path={model_cfg.path}: {e}") from None
    return model, sampler
  try:
    sizes = {k: int(model_cfg[k]) for k in _TINY_KEYS}
    moe = model_cfg.get("num_experts")
    config = dg.DiffusionGemmaConfig(
        layer_types=tuple(model_cfg.layer_types),
        num_experts=None if moe is None else int(moe),
        top_k_experts=(None if moe is None
                       else int(model_cfg.top_k_experts)),
        moe_intermediate_size=(None if moe is None
                               else int(model_cfg.moe_intermediate_size)),
        final_logit_softcap=float(model_cfg.final_logit_softcap),
        dtype=model_cfg.dtype,
        **sizes,
    )
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"recipe section model: {e}") from None
  return dg.DiffusionGemma(config, rngs=nnx.Rngs(seed)), None


def sampler_config(sampler_cfg, defaults, tokenizer) -> dg.SamplerConfig:
  """Recipe/option sampler keys over the checkpoint's (or reference) defaults.

  EOS and pad come from the tokenizer.
  """
  base = defaults or dg.SamplerConfig()
  values = dict(base.__dict__)
  for key in _SAMPLER_KEYS:
    value = None if sampler_cfg is None else sampler_cfg.get(key)
    if value is not None:
      values[key] = type(values[key])(value)
  values["eos_token_id"] = tokenizer.eos_id()
  values["pad_token_id"] = tokenizer.pad_id()
  try:
    return dg.SamplerConfig(**values)
  except ValueError as e:
    raise errors.UsageError(f"sampler: {e}") from None


def evaluate(model, examples, pairs, task, tokenizer, config, *,
             max_new_tokens: int, batch_size: int, seed: int):
  """Samples every example's completion; exact match and forward passes.

  Returns:
    dict(exact_match, tokens_per_forward, forward_passes_per_token,
    completions, seconds, tokens [N, T], changed_at [N, T]).
  """
  clock = common.Stopwatch()
  sampler = dg_rollout.DiffusionGemmaSampler(model, config)
  prompts, lengths = data_lib.left_padded_prompts(examples,
                                                  tokenizer.pad_id())
  num = len(examples)
  tokens, changed, completions = [], [], []
  kept = passes = 0
  for start in range(0, num, batch_size):
    index = np.minimum(np.arange(start, start + batch_size), num - 1)
    result = sampler.generate(prompts[index], lengths[index],
                              max_new_tokens=max_new_tokens,
                              rng=jax.random.key(seed + start))
    real = min(batch_size, num - start)
    tokens.append(result.tokens[:real])
    changed.append(result.changed_at[:real])
    kept += int((result.tokens[:real] != config.pad_token_id).sum())
    passes += int(result.forward_passes[:real].sum())
    completions += [tokenizer.decode(row) for row in result.tokens[:real]]
  correct = [task.check(p, c, a) if task is not None else c == a
             for (p, a), c in zip(pairs, completions)]
  return dict(
      exact_match=float(np.mean(correct)),
      tokens_per_forward=kept / max(passes, 1),
      forward_passes_per_token=passes / max(kept, 1),
      completions=completions,
      seconds=clock(),
      tokens=np.concatenate(tokens),
      changed_at=np.concatenate(changed),
  )


def _objective(cfg, model, tokenizer) -> dg_objective.DiffusionGemmaObjective:
  section = cfg.objective
  try:
    return dg_objective.DiffusionGemmaObjective(
        canvas_length=model.config.canvas_length,
        vocab_size=model.config.vocab_size,
        min_noise=float(section.min_noise),
        self_conditioning_prob=float(section.self_conditioning_prob),
        fill_id=tokenizer.pad_id(),
    )
  except ValueError as e:
    raise errors.UsageError(f"recipe section objective: {e}") from None


def run_sft(cfg) -> dict[str, Any]:
  """The DiffusionGemma `sft` job; returns the summary it writes."""
  if cfg.get("distributed") is not None:
    raise errors.UsageError(
        "DiffusionGemma sft runs on one process (a mesh over its devices is"
        " fine): set distributed to null"
    )
  try:
    mesh = common.build_mesh(cfg.get("mesh"))
  except ValueError as e:
    raise errors.UsageError(f"mesh: {e}") from None
  if mesh is not None and mesh.shape["sp"] > 1:
    raise errors.UsageError(
        "DiffusionGemma sft does not take context parallelism: mesh.sp must"
        " be 1")
  splash_tile = _splash_tile(cfg, mesh)
  with common.mesh_scope(mesh):
    return _run_sft(cfg, mesh, splash_tile)


def _splash_tile(cfg, mesh) -> int | None:
  """The Splash tile the training attention runs with, or None (dense).

  `model.attention` (`splash_tile_for`) over `data.seq_len`: the encoder
  attends [L, L], the decoder [L, 2L].

  Raises:
    UsageError: `splash` where it cannot run, in one line.
  """
  length = int(cfg.data.seq_len)
  return splash_tile_for(common.attention_config_from(cfg.model), length,
                         mesh, key="model.attention",
                         lengths=f"data.seq_len ({length})")


def splash_tile_for(attention, length: int, mesh, *, key: str,
                    lengths: str) -> int | None:
  """The Splash tile of a DiffusionGemma job's attention, or None (dense).

  `splash` needs one device (no mesh over several) and a tile that divides
  `length` (every attended length is a multiple of it); `auto` takes
  Splash on a one-device TPU where it tiles, `dense` never.

  Args:
    attention: The recipe's `AttentionConfig`.
    length: A length every attention call's query and key lengths are
      multiples of.
    mesh: The job's mesh, or None.
    key: The recipe key an error names.
    lengths: The recipe values `length` comes from, as an error says them.

  Raises:
    UsageError: `splash` where it cannot run, in one line.
  """
  if attention.implementation == "dense":
    return None
  one_device = mesh is None or mesh.devices.size == 1
  backend = jax.default_backend()
  tile = attention.tile_for(length, backend)
  if attention.implementation == "auto":
    return tile if backend == "tpu" and one_device else None
  if not one_device:
    raise errors.UsageError(
        f"{key}: DiffusionGemma runs 'splash' on one device; drop the mesh"
        " or use 'dense' (or 'auto')")
  if tile is None:
    raise errors.UsageError(
        f"{key}: 'splash' needs {lengths} to be a multiple of the tile"
        f" ({attention.tile or 128}); change it or use 'dense'")
  return tile


def _run_sft(cfg, mesh, splash_tile) -> dict[str, Any]:
  clock = common.Stopwatch()
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  model, defaults = build_model(cfg.model, seed=int(cfg.seed))
  vocab = model.config.vocab_size
  task_data = sft_data_lib.build_sft_data(
      cfg, tokenizer, seq_len=int(cfg.data.seq_len), vocab_size=vocab,
      mask_token_id=None)
  # After the data: a bad row stops the job with nothing written.
  out = common.prepare_output_dir(cfg)
  base_model = model
  model = common.apply_lora(model, cfg.lora, seed=int(cfg.seed))
  try:
    model = common.shard_model(model, mesh)
  except ValueError as e:
    raise errors.UsageError(str(e)) from None
  objective = _objective(cfg, model, tokenizer)
  try:
    data_config = data_lib.DataConfig(
        seq_len=int(cfg.data.seq_len), batch_size=int(cfg.data.batch_size),
        vocab_size=vocab, seed=int(cfg.seed),
        pad_token_id=tokenizer.pad_id())
    train_ds = dg_data.DiffusionGemmaBatches(task_data.train, objective,
                                                  data_config)
    eval_ds = None
    if task_data.eval is not None:
      eval_ds = dg_data.eval_batches(
          task_data.eval, objective,
          data_lib.DataConfig(
              seq_len=data_config.seq_len,
              batch_size=int(cfg.eval.batch_size), vocab_size=vocab,
              seed=int(cfg.seed), pad_token_id=tokenizer.pad_id()))
  except ValueError as e:
    raise errors.UsageError(f"data: {e}") from None
  if mesh is not None:
    # Rows over fsdp; every process builds the whole batch and keeps its rows.
    train_ds = distributed.GlobalBatches(
        train_ds, mesh, data_config.batch_size, sliced=True)
    if eval_ds is not None:
      eval_ds = distributed.GlobalBatches(
          eval_ds, mesh, int(cfg.eval.batch_size), sliced=True)
  training_config = dataclasses.replace(
      common.make_training_config(cfg, out),
      pbar_description="DiffusionGemma SFT")
  trainer = dg_trainer.DiffusionGemmaTrainer(
      model, common.make_optimizer(cfg.training), training_config, objective,
      splash_tile=splash_tile)
  outputs.show_progress(trainer, int(cfg.training.eval_every_n_steps) // 2 or 1,
                        int(cfg.training.max_steps), out)
  trainer.train(train_ds, eval_ds)
  train_seconds = clock()
  summary = {
      "recipe": common.to_dict(cfg),
      "model_kind": cfg.model.kind,
      "train_steps": trainer.train_steps,
      "train_losses": outputs.metric_history(trainer, "loss", "train").tolist(),
      "num_params": outputs.num_params(trainer.model),
      "num_lora_params": outputs.num_params(trainer.model, nnx.LoRAParam),
      "train_examples": len(task_data.train),
      "train_seconds": train_seconds,
      "attention": "splash" if splash_tile else "dense",
      "attention_tile": splash_tile,
  }
  losses = summary["train_losses"]
  summary["final_train_loss"] = losses[-1] if losses else None
  summary.update(eval_loss=None, eval_exact_match=None,
                 tokens_per_forward=None, tokens_per_step=None, forward_passes_per_token=None)
  if eval_ds is not None:
    summary["eval_loss"] = outputs.eval_loss(trainer, eval_ds)
    eval_model = trainer.model
    if common.lora_enabled(cfg.lora):
      eval_model = checkpoints.merge_lora(
          trainer.model, base_model, rank=int(cfg.lora.rank),
          alpha=float(cfg.lora.alpha))
    config = sampler_config(cfg.get("sampler"), defaults, tokenizer)
    result = evaluate(
        eval_model, task_data.eval, task_data.eval_pairs, task_data.task,
        tokenizer, config,
        max_new_tokens=max(ex.completion.size for ex in task_data.eval),
        batch_size=int(cfg.eval.batch_size), seed=int(cfg.seed))
    summary.update(
        eval_exact_match=result["exact_match"],
        tokens_per_forward=result["tokens_per_forward"],
        # The key every sft summary has (tokens per model call).
        tokens_per_step=result["tokens_per_forward"],
        forward_passes_per_token=result["forward_passes_per_token"],
        eval_examples=len(task_data.eval),
        eval_seconds=result["seconds"],
        sampler=dict(config.__dict__),
        sample_completions=[
            {"prompt": p, "answer": a, "completion": c}
            for (p, a), c in list(zip(task_data.eval_pairs,
                                      result["completions"]))[:5]
        ],
    )
  summary["seconds"] = clock()
  common.plot_training_figure(
      out / FIGURE_FILE,
      train_loss=np.asarray(losses),
      eval_steps=[],
      eval_loss=np.zeros((0,)),
      sweep=(),
      title=(f"{task_data.name}: DiffusionGemma, canvas"
             f" {model.config.canvas_length}"
             + ("" if summary["eval_exact_match"] is None else
                f", EM {summary['eval_exact_match']:.3f} at"
                f" {summary['tokens_per_forward']:.2f} tokens/forward")),
  )
  common.write_summary(out, summary)
  return summary


# Options of `generate` on a DiffusionGemma run or HF directory
# (`kinds/diffusion_gemma/generate.py`).
DEFAULTS = {
    "prompts": None,
    "chat": False,
    "max_new_tokens": None,
    "seed": 0,
    "png": None,
    "color": True,
    **{k: None for k in _SAMPLER_KEYS},
}


def handles_generate(argv: Sequence[str]) -> bool:
  """Whether `generate argv` names a DiffusionGemma run or HF directory.

  An rl/opd run counts by its trained policy (`policy/`).
  """
  from tunix_blockdiff.runs import rl_checkpoints  # pylint: disable=g-import-not-at-top

  if not argv or "=" in argv[0] or argv[0].startswith("-"):
    return False
  path = pathlib.Path(argv[0]).expanduser()
  if is_hf_dir(path):
    return True
  recipe = rl_checkpoints.policy_dir(path) / common.RECIPE_FILE
  if not recipe.is_file():
    return False
  return is_recipe(omegaconf.OmegaConf.load(recipe))
