"""Shared pieces of the `tunix-blockdiff` jobs (sft, generate, rl, opd).

Recipes are YAML files (bundled ones live in `tunix_blockdiff/recipes`)
merged with omegaconf dotlist overrides, as Tunix's own CLI does:
`tunix-blockdiff sft [RECIPE.yaml] [key=value ...]`. Unknown keys are errors,
so a typo in an override fails instead of being ignored.

The helpers below build what a recipe names (tokenizer, synthetic task data,
mesh, optimizer; the model, LoRA and their placement come from
`runs.model_setup`), evaluate generation with `generate`, and write the
run's outputs (resolved recipe, `summary.json`, figures).
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import sys
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import omegaconf
import optax
import yaml

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import tasks as tasks_lib

# pylint: disable=g-importing-member,unused-import
from tunix_blockdiff.runs.evaluation import GenerationEval
from tunix_blockdiff.runs.evaluation import evaluate_generation
from tunix_blockdiff.runs.model_setup import apply_lora
from tunix_blockdiff.runs.model_setup import attention_config_from
from tunix_blockdiff.runs.model_setup import check_released_settings
from tunix_blockdiff.runs.model_setup import mesh_for_attention
from tunix_blockdiff.runs.model_setup import head_chunk_from
from tunix_blockdiff.runs.model_setup import remat_policy_from
from tunix_blockdiff.runs.model_setup import training_mask_mode
from tunix_blockdiff.runs.model_setup import training_attention
from tunix_blockdiff.runs.model_setup import build_model
from tunix_blockdiff.runs.model_setup import check_model_fits_mesh
from tunix_blockdiff.runs.model_setup import lora_enabled
from tunix_blockdiff.runs.model_setup import model_vocab_size
from tunix_blockdiff.runs.model_setup import shard_model
from tunix_blockdiff.runs.model_setup import traced_lora
from tunix_blockdiff.runs import outputs
from tunix_blockdiff.runs.outputs import _jsonable
from tunix_blockdiff.runs.outputs import make_training_config
from tunix_blockdiff.runs.outputs import plot_training_figure
from tunix_blockdiff.runs.outputs import prepare_output_dir
from tunix_blockdiff.runs.outputs import show_progress
from tunix_blockdiff.runs.outputs import RECIPE_FILE
from tunix_blockdiff.runs.outputs import Stopwatch
from tunix_blockdiff.runs.outputs import SUMMARY_FILE
from tunix_blockdiff.runs.outputs import write_summary
# pylint: enable=g-importing-member,unused-import

RECIPES_DIR = pathlib.Path(__file__).resolve().parents[1] / "recipes"


# Recipes.


def recipe_path(name: str) -> pathlib.Path:
  """A recipe file: a path, or the name of a bundled recipe (`tiny.yaml`)."""
  path = pathlib.Path(name).expanduser()
  if path.is_file():
    return path
  bundled = RECIPES_DIR / path.name
  if bundled.is_file():
    return bundled
  available = sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))
  raise errors.MissingFileError(
      f"recipe {name!r} is neither a file nor a bundled recipe {available}"
  )


def split_argv(
    argv: Sequence[str], default_recipe: str
) -> tuple[str, list[str]]:
  """(recipe, overrides) from `[RECIPE.yaml] [key=value ...]`."""
  argv = list(argv)
  recipe = default_recipe
  if argv and "=" not in argv[0]:
    recipe = argv.pop(0)
  bad = [arg for arg in argv if "=" not in arg or arg.startswith("=")]
  if bad:
    raise errors.UsageError(
        f"overrides must look like key=value, got {bad}; usage:"
        " [RECIPE.yaml] [key=value ...]"
    )
  return recipe, argv


def load_recipe(
    argv: Sequence[str], default_recipe: str = "tiny.yaml"
) -> omegaconf.DictConfig:
  """The recipe named in `argv` (or the default) with its overrides applied.

  Args:
    argv: `[RECIPE.yaml] [key=value ...]` (omegaconf dotlist overrides).
    default_recipe: Bundled recipe used when argv names none.

  Returns:
    A resolved, struct-mode `DictConfig` (unknown keys raise).

  Raises:
    UsageError: A missing recipe, a malformed override, an unknown key (the
      nearest valid key is suggested), or a value whose type differs from
      the recipe's (`training.max_steps=abc`).
  """
  recipe, overrides = split_argv(argv, default_recipe)
  base = omegaconf.OmegaConf.load(recipe_path(recipe))
  omegaconf.OmegaConf.set_struct(base, True)
  try:
    cfg = omegaconf.OmegaConf.merge(
        base, omegaconf.OmegaConf.from_dotlist(overrides)
    )
  except omegaconf.errors.ConfigKeyError as e:
    key = str(getattr(e, "full_key", "") or e)
    raise errors.UsageError(
        f"unknown recipe key {key!r}" + errors.nearest(key, _dotted_keys(base))
    ) from None
  except (omegaconf.errors.OmegaConfBaseException, yaml.YAMLError) as e:
    # A malformed override value.
    raise errors.UsageError(
        f"cannot parse the overrides {overrides}: {errors.one_line(e)}"
    ) from None
  for override in overrides:
    _check_override_type(base, cfg, override)
  omegaconf.OmegaConf.resolve(cfg)
  return cfg


def _dotted_keys(cfg, prefix: str = "") -> list[str]:
  """Every key of a recipe, dotted (`training.max_steps`)."""
  keys = []
  for key, value in cfg.items():
    name = f"{prefix}{key}"
    keys.append(name)
    if isinstance(value, omegaconf.DictConfig):
      keys.extend(_dotted_keys(value, name + "."))
  return keys


_KINDS = (
    (bool, (bool,), "true or false"),
    (int, (int,), "an int"),
    (float, (int, float), "a number"),
    (list, (list,), "a list [a, b, ...]"),
)


# Keys whose recipes document a meaning for null (the override may set it).
NULLABLE_KEYS = ("model.num_experts", "rollout.max_prompt_length",
                 "rollout.steps_per_block")


def _check_override_type(base, cfg, override: str) -> None:
  """A `key=value` override must keep the recipe value's type.

  `null` is also accepted for the keys in `NULLABLE_KEYS`.
  """
  key, raw = override.split("=", 1)
  key = key.lstrip("+~")
  if key in NULLABLE_KEYS and raw.strip() == "null":
    return
  before = omegaconf.OmegaConf.select(base, key, default=None)
  after = to_dict(omegaconf.OmegaConf.select(cfg, key, default=None))
  before = to_dict(before)
  for kind, allowed, words in _KINDS:
    if isinstance(before, kind):
      ok = isinstance(after, allowed) and not (
          kind is not bool and isinstance(after, bool)
      )
      if not ok:
        raise errors.UsageError(
            f"{key}={raw} is not valid: {key} must be {words} (the recipe has"
            f" {before!r})"
        )
      return


def to_dict(cfg: Any) -> Any:
  """A plain-Python copy of an omegaconf node (dicts, lists, scalars)."""
  if isinstance(cfg, omegaconf.DictConfig | omegaconf.ListConfig):
    return omegaconf.OmegaConf.to_container(cfg, resolve=True)
  return cfg


# What a recipe names: tokenizer, task data, model, LoRA, optimizer.


def build_tokenizer(tokenizer_cfg, model_cfg=None):
  """`tokenizer.kind`: `char` (in code) or `hf` (from `model.path`)."""
  kind = tokenizer_cfg.kind
  if kind == "char":
    return tasks_lib.CharTokenizer()
  if kind == "hf":
    from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

    path = tokenizer_cfg.get("path") or (model_cfg.path if model_cfg else None)
    if not path:
      raise ValueError("tokenizer.kind=hf needs tokenizer.path or model.path")
    return checkpoints.HFTokenizer(
        path, eos_token=tokenizer_cfg.get("eos_token")
    )
  raise ValueError(f"tokenizer.kind must be 'char' or 'hf', got {kind!r}")


def encode_pair(
    tokenizer, prompt: str, answer: str
) -> tuple[list[int], list[int]]:
  """(prompt ids, answer ids + EOS); BOS first when the tokenizer has one."""
  return data_lib.rows.encode_pair(tokenizer, prompt, answer)


class TaskData(NamedTuple):
  """Encoded synthetic-task data.

  Attributes:
    task: The `tasks.Task`.
    train: Training `data.Example`s.
    eval: Held-out `data.Example`s.
    eval_pairs: (prompt, answer) strings of the held-out examples.
  """

  task: tasks_lib.Task
  train: list[data_lib.Example]
  eval: list[data_lib.Example]
  eval_pairs: list[tuple[str, str]]


def build_task_data(
    task_cfg,
    tokenizer,
    *,
    seq_len: int,
    vocab_size: int,
    mask_token_id: int,
    train: bool = True,
) -> TaskData:
  """Train and held-out examples of `task.name` (disjoint seeds and prompts).

  `train=False` leaves the training split empty (neither drawn nor encoded),
  for jobs that read only the held-out one; the held-out split is the same.
  """
  task = tasks_lib.get_task(
      task_cfg.name, **to_dict(task_cfg.get("kwargs") or {})
  )
  eval_pairs = task.sample(task_cfg.num_eval, seed=task_cfg.seed + 1)
  held_out = {prompt for prompt, _ in eval_pairs}
  # Held-out prompts never appear in training.
  train_pairs = [
      pair
      for pair in task.sample(task_cfg.num_train, seed=task_cfg.seed)
      if pair[0] not in held_out
  ] if train else []

  def encode(pairs):
    return data_lib.as_examples(
        [encode_pair(tokenizer, p, a) for p, a in pairs],
        seq_len=seq_len,
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
    )

  return TaskData(task, encode(train_pairs), encode(eval_pairs), eval_pairs)


def build_mesh(mesh_cfg) -> jax.sharding.Mesh | None:
  """The (fsdp, sp, tp) mesh over every process's devices (`distributed`)."""
  return distributed.build_mesh(None if mesh_cfg is None else to_dict(mesh_cfg))


def mesh_scope(mesh: jax.sharding.Mesh | None):
  """Tunix's trainers and models read the legacy `with mesh:` context."""
  return contextlib.nullcontext() if mesh is None else mesh


def make_optimizer(training_cfg) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay, clipped; LR is logged.

  Only the learning rate is an injected (array) hyperparameter, kept in
  float32: injecting b2 as well would store it in the parameter dtype, and in
  bfloat16 0.999 rounds to 1, which turns Adam's bias correction into 0/0.
  """
  steps = int(training_cfg.max_steps)
  warmup = min(int(training_cfg.warmup_steps), max(steps - 1, 0))
  peak = float(training_cfg.learning_rate)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1),
      end_value=peak * float(training_cfg.get("final_lr_fraction", 0.1)),
  )
  clip = float(training_cfg.get("grad_clip", 0.0) or 0.0)
  b2 = float(training_cfg.get("adam_b2", 0.99))
  weight_decay = float(training_cfg.weight_decay)

  def chain(learning_rate):
    adamw = optax.adamw(learning_rate, b1=0.9, b2=b2, weight_decay=weight_decay)
    if clip > 0:
      return optax.chain(optax.clip_by_global_norm(clip), adamw)
    return adamw

  return optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)(
      learning_rate=schedule
  )


def diffusion_config_from(cfg) -> config_lib.BlockDiffusionConfig:
  """The recipe's `diffusion` section; a bad value is a `UsageError`."""
  try:
    return config_lib.BlockDiffusionConfig(**to_dict(cfg))
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"recipe section diffusion: {e}") from None


__all__ = [
    "GenerationEval",
    "RECIPES_DIR",
    "Stopwatch",
    "TaskData",
    "apply_lora",
    "attention_config_from",
    "check_released_settings",
    "mesh_for_attention",
    "remat_policy_from",
    "training_mask_mode",
    "head_chunk_from",
    "training_attention",
    "build_mesh",
    "build_model",
    "build_task_data",
    "build_tokenizer",
    "diffusion_config_from",
    "encode_pair",
    "evaluate_generation",
    "load_recipe",
    "make_optimizer",
    "mesh_scope",
    "check_model_fits_mesh",
    "shard_model",
    "plot_training_figure",
    "prepare_output_dir",
    "show_progress",
    "recipe_path",
    "split_argv",
    "to_dict",
    "traced_lora",
    "write_summary",
    "make_training_config",
]


def job_main(
    argv: Sequence[str] | None,
    *,
    command: str,
    doc: str | None,
    default_recipe: str,
    run,
    keys: Sequence[str],
) -> int:
  """The `main` of a recipe job: help, recipe + overrides, run, report.

  Args:
    argv: `[RECIPE.yaml] [key=value ...]` (default: `sys.argv[1:]`).
    command: The subcommand name, for the usage line.
    doc: The job module's docstring, printed by `--help`.
    default_recipe: Bundled recipe used when argv names none.
    run: `run(cfg) -> summary dict`.
    keys: Summary keys printed at the end.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(doc)
    print(f"usage: tunix-blockdiff {command} [RECIPE.yaml] [key=value ...]")
    return 0
  cfg = load_recipe(argv, default_recipe=default_recipe)
  # One validation pass of the whole recipe, before any data, model or
  # device work (`runs.job_schemas`); then the mesh against the devices.
  from tunix_blockdiff.runs import job_schemas  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.runs import sections  # pylint: disable=g-import-not-at-top

  recipe = to_dict(cfg)
  job_schemas.check_recipe(recipe, command)
  # Before anything touches a JAX backend; no-op without `distributed`.
  distributed.initialize(to_dict(cfg.get("distributed")))
  sections.check_devices(recipe, sequence=command == "sft")
  summary = outputs.finished_summary(cfg)
  if summary is None:
    requested = copy.deepcopy(cfg)
    summary = run(cfg)
    outputs.mark_finished(requested)
  elif distributed.is_main_process():
    print(
        f"{cfg.output_dir} already holds a finished {command} run of this"
        " recipe: nothing to do (another output_dir, or changed keys such as"
        " more steps, run or resume it)",
        file=sys.stderr,
    )
  if distributed.is_main_process():
    print("\n".join(f"{k}: {summary[k]}" for k in keys))
    print(f"wrote {pathlib.Path(cfg.output_dir) / SUMMARY_FILE}")
  return 0
