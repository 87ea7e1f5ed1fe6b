"""Shared pieces of the `tunix-blockdiff` jobs (sft, generate, rl, opd).

Recipes are YAML files (bundled ones live in `tunix_blockdiff/recipes`)
merged with omegaconf dotlist overrides, as Tunix's own CLI does:
`tunix-blockdiff sft [RECIPE.yaml] [key=value ...]`. Unknown keys are errors,
so a typo in an override fails instead of being ignored.

The helpers below build what a recipe names (tokenizer, synthetic task data,
model, LoRA, optimizer), evaluate generation with `generate`, and write the
run's outputs (resolved recipe, `summary.json`, figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any, Mapping, NamedTuple, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import omegaconf
import optax
import yaml

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import models as models_lib
from tunix_blockdiff import tasks as tasks_lib

RECIPES_DIR = pathlib.Path(__file__).resolve().parents[1] / "recipes"
RECIPE_FILE = "recipe.yaml"
SUMMARY_FILE = "summary.json"


# Recipes and output directories.


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


def _check_override_type(base, cfg, override: str) -> None:
  """A `key=value` override must keep the recipe value's type."""
  key, raw = override.split("=", 1)
  key = key.lstrip("+~")
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


def prepare_output_dir(cfg: omegaconf.DictConfig) -> pathlib.Path:
  """Creates `cfg.output_dir` and saves the resolved recipe in it."""
  out = pathlib.Path(cfg.output_dir).expanduser().resolve()
  out.mkdir(parents=True, exist_ok=True)
  if distributed.is_main_process():
    omegaconf.OmegaConf.save(cfg, out / RECIPE_FILE)
  return out


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.generic, jax.Array, np.ndarray)):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def write_summary(
    out: pathlib.Path, summary: Mapping[str, Any]
) -> pathlib.Path:
  """Writes `summary.json` (NumPy/JAX scalars become numbers; process 0)."""
  path = pathlib.Path(out) / SUMMARY_FILE
  if not distributed.is_main_process():
    return path
  path.write_text(
      json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n"
  )
  return path


class Stopwatch:
  """Wall-clock seconds since construction."""

  def __init__(self):
    self._start = time.perf_counter()

  def __call__(self) -> float:
    return time.perf_counter() - self._start


# Figures.


def plot_training_figure(
    path: pathlib.Path,
    *,
    train_loss: Sequence[float],
    eval_steps: Sequence[int] = (),
    eval_loss: Sequence[float] = (),
    sweep: Sequence[Mapping[str, float]] = (),
    title: str = "",
) -> pathlib.Path:
  """Loss curves (left) and exact match vs tokens per step (right).

  Args:
    path: PNG file to write.
    train_loss: Train loss per optimizer step (steps 1..n).
    eval_steps: Steps at which eval loss was measured.
    eval_loss: Eval loss at those steps.
    sweep: Rows with `threshold`, `tokens_per_step`, `exact_match`.
    title: Figure title.

  Returns:
    `path` (written by process 0 only).
  """
  if not distributed.is_main_process():
    return pathlib.Path(path)
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_sweep) = plt.subplots(1, 2, figsize=(11, 4))
  steps = np.arange(1, len(train_loss) + 1)
  ax_loss.plot(steps, train_loss, lw=1, label="train (token mean)")
  if len(eval_steps):
    ax_loss.plot(eval_steps, eval_loss, "o-", label="eval (token mean)")
  ax_loss.set_xlabel("optimizer step")
  ax_loss.set_ylabel("block-diffusion loss")
  ax_loss.set_yscale("log")
  ax_loss.legend()
  ax_loss.grid(alpha=0.3)
  if sweep:
    tps = [row["tokens_per_step"] for row in sweep]
    em = [row["exact_match"] for row in sweep]
    ax_sweep.plot(tps, em, "o-")
    for i, row in enumerate(sweep):
      # Alternate label heights: neighbouring thresholds often overlap.
      ax_sweep.annotate(
          f"{row['threshold']:g}",
          (row["tokens_per_step"], row["exact_match"]),
          textcoords="offset points",
          xytext=(3, 6 if i % 2 else -12),
          fontsize=8,
      )
  ax_sweep.set_xlabel("committed tokens per model call")
  ax_sweep.set_ylabel("exact match")
  ax_sweep.set_ylim(-0.02, 1.02)
  ax_sweep.set_title("threshold sweep (labels: threshold)", fontsize=9)
  ax_sweep.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return pathlib.Path(path)


# What a recipe names: tokenizer, task data, model, LoRA, optimizer.


def build_tokenizer(tokenizer_cfg, model_cfg=None):
  """`tokenizer.kind`: `char` (in code) or `hf` (from `model.path`)."""
  kind = tokenizer_cfg.kind
  if kind == "char":
    return tasks_lib.CharTokenizer()
  if kind == "hf":
    from tunix_blockdiff import checkpoints  # pylint: disable=g-import-not-at-top

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
    task_cfg, tokenizer, *, seq_len: int, vocab_size: int, mask_token_id: int
) -> TaskData:
  """Train and held-out examples of `task.name` (disjoint seeds and prompts)."""
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
  ]

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


def shard_model(model, mesh: jax.sharding.Mesh | None):
  """Places the parameters by the model's own partition specs (Tunix rules)."""
  if mesh is None:
    return model
  from tunix.rl import reshard  # pylint: disable=g-import-not-at-top

  return reshard.reshard_model_to_mesh(model, mesh)


def build_model(model_cfg, *, seed: int, mesh: jax.sharding.Mesh | None = None):
  """The model of a recipe's `model` section (`models.build_model`)."""
  return models_lib.build_model(model_cfg, seed=seed, mesh=mesh)


model_vocab_size = models_lib.model_vocab_size


def lora_enabled(lora_cfg) -> bool:
  """Whether a recipe's `lora` section asks for LoRA (null: no)."""
  return lora_cfg is not None and bool(lora_cfg.get("enabled", True))


def apply_lora(model, lora_cfg, *, seed: int):
  """qwix LoRA on the modules matching `lora.module_path` (None: no LoRA)."""
  if not lora_enabled(lora_cfg):
    return model
  import qwix  # pylint: disable=g-import-not-at-top

  provider = qwix.LoraProvider(
      module_path=lora_cfg.module_path, rank=lora_cfg.rank, alpha=lora_cfg.alpha
  )
  return qwix.apply_lora_to_model(
      model, provider, rngs=nnx.Rngs(seed), **model.get_model_input()
  )


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


# Generation evaluation.


@dataclasses.dataclass(frozen=True)
class GenerationEval:
  """Exact match and parallelism of block-diffusion generation.

  Attributes:
    threshold: The denoising confidence threshold.
    exact_match: Fraction of examples whose completion (text before EOS)
      equals the answer.
    tokens_per_step: Committed tokens (up to and including EOS) per model
      call, summed over rows: a row takes part in every step until it
      finishes, so its calls are its last commit step + 1.
    completions: Decoded completions, in example order.
    seconds: Wall time of the generation (including compilation).
    tokens: int32 [N, T] generated tokens, in example order.
    commit_step: int32 [N, T] step that committed each token (-1: never).
    prompt_lengths: int32 [N] prompt lengths (position of the first slot).
  """

  threshold: float
  exact_match: float
  tokens_per_step: float
  completions: tuple[str, ...]
  seconds: float
  tokens: np.ndarray | None = None
  commit_step: np.ndarray | None = None
  prompt_lengths: np.ndarray | None = None

  def row(self) -> dict[str, float]:
    return {
        "threshold": self.threshold,
        "exact_match": self.exact_match,
        "tokens_per_step": self.tokens_per_step,
    }


def evaluate_generation(
    model,
    examples: Sequence[data_lib.Example],
    pairs: Sequence[tuple[str, str]],
    task: tasks_lib.Task,
    tokenizer,
    denoise_config: config_lib.DenoiseConfig,
    *,
    max_new_tokens: int,
    batch_size: int,
    use_cache: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerationEval:
  """Generates every example's completion and scores it exactly.

  Batches are padded to `batch_size` (repeating the last example) so one
  compiled program serves all of them. Under a `mesh` (a multiple of
  mesh.fsdp rows) the prompts are sharded over fsdp, each process placing
  its own rows, and the results gathered: every process scores them all.
  """
  from tunix_blockdiff.rollout import cached  # pylint: disable=g-import-not-at-top

  clock = Stopwatch()
  prompts, lengths = data_lib.left_padded_prompts(examples, tokenizer.pad_id())
  num = len(examples)
  completions, tokens_committed, calls = [], 0, 0
  all_tokens, all_steps = [], []
  for start in range(0, num, batch_size):
    index = np.minimum(np.arange(start, start + batch_size), num - 1)
    batch = {"prompts": prompts[index], "lengths": lengths[index]}
    if mesh is not None:
      lo, hi = distributed.process_rows(mesh, batch_size)
      batch = distributed.global_batch(
          {k: v[lo:hi] for k, v in batch.items()}, mesh, batch_size
      )
    result = cached.generate(
        model,
        batch["prompts"],
        batch["lengths"],
        denoise_config,
        max_new_tokens=max_new_tokens,
        use_cache=use_cache,
    )
    tokens = distributed.gather(result.tokens)
    commit_step = distributed.gather(result.commit_step)
    trace_step = distributed.gather(result.trace_commit_step)
    real = min(batch_size, num - start)
    all_tokens.append(tokens[:real])
    all_steps.append(commit_step[:real])
    for b in range(real):
      completions.append(tokenizer.decode(tokens[b]))
      tokens_committed += int(np.sum(commit_step[b] >= 0))
      calls += int(trace_step[b].max(initial=-1)) + 1
  correct = [
      task.check(prompt, completion, answer)
      for (prompt, answer), completion in zip(pairs, completions)
  ]
  return GenerationEval(
      threshold=float(denoise_config.threshold),
      exact_match=float(np.mean(correct)),
      tokens_per_step=tokens_committed / max(calls, 1),
      completions=tuple(completions),
      seconds=clock(),
      tokens=np.concatenate(all_tokens),
      commit_step=np.concatenate(all_steps),
      prompt_lengths=lengths,
  )


__all__ = [
    "GenerationEval",
    "RECIPES_DIR",
    "Stopwatch",
    "TaskData",
    "apply_lora",
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
    "shard_model",
    "plot_training_figure",
    "prepare_output_dir",
    "recipe_path",
    "split_argv",
    "to_dict",
    "write_summary",
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
  # Before anything touches a JAX backend; no-op without `distributed`.
  distributed.initialize(to_dict(cfg.get("distributed")))
  summary = run(cfg)
  if distributed.is_main_process():
    print("\n".join(f"{k}: {summary[k]}" for k in keys))
    print(f"wrote {pathlib.Path(cfg.output_dir) / SUMMARY_FILE}")
  return 0
