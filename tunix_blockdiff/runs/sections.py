"""The recipe sections every job shares, and the block-diffusion sft schema.

Each section states its keys (`runs.schema`) and its cross-key rules; where
a frozen config dataclass defines a section (`BlockDiffusionConfig` for
`diffusion`, `DataConfig` for `data`, `AttentionConfig` for the attention
keys), the rule builds it, so its `__post_init__` stays the one place those
checks live. `check_devices` compares `mesh` with the devices once JAX's
runtime is up (after `distributed`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.data import examples as examples_lib
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.models import hf_configs
from tunix_blockdiff.models import registry
from tunix_blockdiff.models import remat
from tunix_blockdiff.runs import recipe_paths
from tunix_blockdiff.runs import schema as s

DTYPES = tuple(hf_configs.DTYPES)
MESH_AXES = distributed.MESH_AXES
# A placeholder vocabulary for dataclass checks made before the model exists.
_ANY_VOCAB = 2**31 - 1


def output_dir_rule(value: Mapping[str, Any], key: str) -> None:
  """`output_dir` names a directory (absent, or an existing one)."""
  del key
  out = value.get("output_dir")
  if out is not None and (not str(out).strip()
                          or os.path.isfile(os.path.expanduser(str(out)))):
    raise s.refuse("output_dir", out,
                   "must name a directory (it exists as a file, or is empty)")


SEED = s.integer(0)
OUTPUT_DIR = s.text(required=True)
MESH = s.section({axis: s.integer(1) for axis in MESH_AXES}, null=True)


def _distributed(value, key):
  n, i = value.get("num_processes"), value.get("process_id")
  if n is not None and i is not None and i >= n:
    raise s.refuse(f"{key}.process_id", i,
                   f"must be < {key}.num_processes={n}")


DISTRIBUTED = s.section({
    "coordinator_address": s.text(null=True),
    "num_processes": s.integer(1, null=True),
    "process_id": s.integer(0, null=True),
    "initialization_timeout": s.number(0, low_open=True, null=True),
    "heartbeat_timeout": s.number(0, low_open=True, null=True),
}, _distributed, null=True)

LORA = s.section({
    "module_path": s.text(required=True),
    "rank": s.integer(1, required=True),
    "alpha": s.number(0, low_open=True, required=True),
    "enabled": s.boolean(),
}, null=True)


def _task(value, key):
  s.wrap(key, lambda: tasks_lib.get_task(
      value["name"], **dict(value.get("kwargs") or {})))


TASK = s.section({
    "name": s.choice(*tasks_lib.TASKS, required=True),
    "kwargs": s.mapping(null=True),
    "num_train": s.integer(1, required=True),
    "num_eval": s.integer(1, required=True),
    "seed": s.integer(0, required=True),
}, _task, null=True)


def dataset_paths(value, key):
  """Every path `dataset.train` / `dataset.eval` names exists."""
  for split in ("train", "eval"):
    if value.get(split) is not None:
      recipe_paths.check_paths(f"{key}.{split}", value[split])


def _sft_rows(value, key):
  """The sft files open and hold a row of a known form (`data.rows`)."""
  fields = rows_lib.RowFields(**(value.get("fields") or {}))

  def check(location, row):
    rows_lib.row_form(row, fields, location)

  for split in ("train", "eval"):
    if value.get(split) is not None:
      try:
        sources_lib.check_rows(value[split], check,
                               format=value.get("format", "auto"),
                               bad_rows=value.get("bad_rows", "skip"))
      except errors.UsageError as e:
        raise errors.UsageError(f"{key}.{split}: {e}") from None


_PATHS = s.Key("any", null=True)  # a path, a glob or a list of them
DATASET = s.section({
    "train": _PATHS,
    "eval": _PATHS,
    "format": s.choice(*sources_lib.FORMATS),
    "fields": s.section(
        {name: s.text() for name in rows_lib.RowFields().__dict__},
        null=True),
    "bad_rows": s.choice(*rows_lib.BAD_ROW_POLICIES),
    "seed": s.integer(0),
    "num_eval": s.integer(1, null=True),
}, dataset_paths, null=True)
SFT_DATASET = s.Section(DATASET.keys, (*DATASET.rules, _sft_rows),
                        null=True)

TOKENIZER = s.section({
    "kind": s.choice("char", "hf", required=True),
    "path": s.text(null=True),
    "eos_token": s.text(null=True),
}, required=True)


def attention_keys(value, key):
  """`attention`, `attention_tile`, `attention_mask_mode` (AttentionConfig)."""
  if value.get("attention") is None:
    return
  s.wrap(key, lambda: config_lib.AttentionConfig(
      str(value["attention"]), tile=value.get("attention_tile"),
      mask_mode=str(value.get("attention_mask_mode", "auto"))))


def _block_diffusion_model(value, key):
  kind = value["kind"]
  if kind.startswith("tiny_"):
    for name in ("vocab_size", "num_layers", "embed_dim", "hidden_dim",
                 "num_heads", "head_dim", "num_kv_heads"):
      if value.get(name) is None:
        raise errors.UsageError(
            f"{key}.kind={kind} needs {key}.{name} (an int >= 1)")
    if value["num_heads"] % value["num_kv_heads"]:
      raise s.refuse(f"{key}.num_kv_heads", value["num_kv_heads"],
                     f"must divide {key}.num_heads={value['num_heads']}")
  elif value.get("path") is None:
    raise s.refuse(f"{key}.path", None, f"must be set for {key}.kind={kind}"
                   " (a Hugging Face model directory)")
  else:
    recipe_paths.check_hf_dir(f"{key}.path", value["path"])


MODEL_ATTENTION = {
    "attention": s.choice(*config_lib.ATTENTION_IMPLEMENTATIONS),
    "attention_tile": s.integer(128, null=True),
    "attention_mask_mode": s.choice(*config_lib.SPLASH_MASK_MODES),
}
MODEL = s.section({
    "kind": s.choice(*registry.KINDS, required=True),
    "random_mlp": s.boolean(),
    "mlp_out_scale": s.number(0),
    "vocab_size": s.integer(1),
    "num_layers": s.integer(1),
    "embed_dim": s.integer(1),
    "hidden_dim": s.integer(1),
    "num_heads": s.integer(1),
    "head_dim": s.integer(1),
    "num_kv_heads": s.integer(1),
    "sliding_window_size": s.integer(1, null=True),
    "path": s.text(null=True),
    "dtype": s.choice(*DTYPES),
    "param_dtype": s.choice(*DTYPES, null=True),
    "remat": s.choice(*remat.REMAT_POLICIES),
    "head_chunk": s.integer(1, null=True),
    **MODEL_ATTENTION,
}, attention_keys, _block_diffusion_model, required=True)


def _diffusion(value, key):
  s.wrap(key, lambda: config_lib.BlockDiffusionConfig(**value))


DIFFUSION = s.section({
    "block_size": s.integer(1, required=True),
    "mask_token_id": s.integer(0, required=True),
    "alignment": s.choice(*config_lib.ALIGNMENTS),
    "canvas": s.choice(*config_lib.CANVASES),
    "stream": s.choice(*config_lib.STREAMS),
    "min_noise": s.number(0, 1, low_open=True),
    "loss_weighting": s.choice(*config_lib.LOSS_WEIGHTINGS),
    "certainty_weight": s.number(0),
    "certainty_temperature": s.number(0, low_open=True),
}, _diffusion, required=True)


def _data(value, key):
  s.wrap(key, lambda: examples_lib.DataConfig(
      seq_len=value["seq_len"], batch_size=value["batch_size"],
      vocab_size=_ANY_VOCAB, packing=value.get("packing", "none"),
      cp_size=value.get("cp_size", 1)))


DATA = s.section({
    "seq_len": s.integer(1, required=True),
    "batch_size": s.integer(1, required=True),
    "packing": s.choice(*examples_lib.PACKINGS),
    "cp_size": s.integer(1),
    "fill_completion_with_eos": s.boolean(),
}, _data, required=True)

TRAINING = s.section({
    "max_steps": s.integer(1, required=True),
    "gradient_accumulation_steps": s.integer(1),
    "learning_rate": s.number(0, low_open=True, required=True),
    "warmup_steps": s.integer(0),
    "final_lr_fraction": s.number(0, 1),
    "weight_decay": s.number(0),
    "adam_b2": s.number(0, 1, high_open=True),
    "grad_clip": s.number(0),
    "eval_every_n_steps": s.integer(1, required=True),
    "checkpoint_every_n_steps": s.integer(1, required=True),
    "max_checkpoints": s.integer(1),
}, required=True)

THRESHOLD = s.probability(low_open=True)
# The decoding keys of `generate`'s options and the rl/opd `rollout` section.
DECODING = {
    "threshold": THRESHOLD,
    "steps_per_block": s.integer(1, null=True),
    "sub_block_size": s.integer(1, null=True),
    "cache_phases": s.integer(1),
    "lockstep": s.boolean(),
    "ragged_cache": s.boolean(),
    "fused_head": s.boolean(),
    "one_program": s.boolean(),
    "temperature": s.number(0),
}
EVAL = s.section({
    "threshold": THRESHOLD,
    "thresholds": s.sequence(THRESHOLD),
    "batch_size": s.integer(1, required=True),
    "use_cache": s.boolean(),
}, required=True)


# Rules between sections.


def task_or_dataset(value, key):
  del key
  dataset = value.get("dataset")
  if dataset is not None and dataset.get("train") is None:
    raise s.refuse("dataset.train", None, "must name your training files when"
                   " dataset is set (a path, a glob or a list of them)")
  if dataset is None and value.get("task") is None:
    raise errors.UsageError("the recipe has no data: set dataset.train (your"
                            " files) or task")


def tokenizer_source(value, key):
  del key
  tokenizer, model = value.get("tokenizer") or {}, value.get("model") or {}
  if tokenizer.get("kind") == "hf" and not (tokenizer.get("path")
                                            or model.get("path")):
    raise s.refuse("tokenizer.path", None, "must be set when tokenizer.kind=hf"
                   " and model.path is not (the tokenizer's directory)")


def token_ids_fit(value, key):
  """A tiny model's vocabulary holds the tokenizer's and the mask id."""
  del key
  model, tokenizer = value["model"], value["tokenizer"]
  vocab = model.get("vocab_size")
  if not str(model["kind"]).startswith("tiny_") or vocab is None:
    return
  if tokenizer["kind"] == "char":
    need = tasks_lib.CharTokenizer().vocab_size
    if vocab < need:
      raise s.refuse("model.vocab_size", vocab, f"must be >= {need}, the"
                     " character tokenizer's vocabulary")
  mask = value.get("diffusion", {}).get("mask_token_id")
  if mask is not None and mask >= vocab:
    raise s.refuse("diffusion.mask_token_id", mask,
                   f"must be < model.vocab_size={vocab}")


def context_parallel_fits(value, key):
  """`data.cp_size` is 1 or `mesh.sp`."""
  del key
  sp = (value.get("mesh") or {}).get("sp", 1)
  cp = value["data"].get("cp_size", 1)
  if cp not in (1, sp):
    raise s.refuse("data.cp_size", cp,
                   f"must equal mesh.sp={sp} or be 1 (follow mesh.sp)")
  if sp > 1:
    s.wrap("data", lambda: examples_lib.DataConfig(
        seq_len=value["data"]["seq_len"], batch_size=1,
        vocab_size=_ANY_VOCAB, cp_size=sp))


BASE = {
    "seed": SEED,
    "output_dir": OUTPUT_DIR,
    "mesh": MESH,
    "distributed": DISTRIBUTED,
}
SFT_DATA = {
    "task": TASK,
    "dataset": SFT_DATASET,
    "tokenizer": TOKENIZER,
    "lora": LORA,
    "data": DATA,
    "training": TRAINING,
}
# The rules of every kind's sft recipe.
SFT_RULES = (output_dir_rule, task_or_dataset, tokenizer_source)
SFT = s.section(
    {**BASE, **SFT_DATA, "model": MODEL, "diffusion": DIFFUSION,
     "eval": EVAL},
    *SFT_RULES, token_ids_fit, context_parallel_fits)


def check_devices(recipe: Mapping[str, Any], *, sequence: bool = True) -> None:
  """The recipe's `mesh` fits the devices of every process (JAX is up).

  `sequence=False`: the job has no context parallelism (`mesh.sp` must be 1).
  """
  import jax  # pylint: disable=g-import-not-at-top

  mesh = recipe.get("mesh")
  if mesh is None:
    return
  shape = distributed.mesh_shape(mesh)  # its values passed the schema
  if not sequence and shape["sp"] > 1:
    raise s.refuse("mesh.sp", shape["sp"], "must be 1: the rl and opd"
                   " rollouts shard prompts over mesh.fsdp; context"
                   " parallelism (sp) is for sft only")
  size = shape["fsdp"] * shape["sp"] * shape["tp"]
  devices, processes = jax.device_count(), jax.process_count()
  if size > devices or (processes > 1 and size != devices):
    raise errors.UsageError(
        f"mesh={shape} is not valid: mesh.fsdp * mesh.sp * mesh.tp = {size}"
        f" must be {'=' if processes > 1 else '<='} the {devices} device(s)"
        f" of {processes} process(es)")


__all__ = [
    "BASE",
    "DATA",
    "DATASET",
    "DECODING",
    "DIFFUSION",
    "DISTRIBUTED",
    "DTYPES",
    "EVAL",
    "LORA",
    "MESH",
    "MODEL",
    "MODEL_ATTENTION",
    "SEED",
    "SFT",
    "SFT_DATA",
    "SFT_RULES",
    "TASK",
    "THRESHOLD",
    "TOKENIZER",
    "TRAINING",
    "attention_keys",
    "check_devices",
    "dataset_paths",
    "output_dir_rule",
    "task_or_dataset",
    "tokenizer_source",
]
