"""A Hugging Face checkpoint as the `opd` job's autoregressive teacher.

`teacher.kind: hf` loads `teacher.path` (a Hugging Face directory of any
family `models.checkpoints.load_hf` reads: Qwen3, Qwen2, Llama3, Gemma3)
instead of training a tiny teacher in the job (`teacher.kind: ar`, the
default). The teacher is frozen: nothing in the job trains it. It is placed
on the job's mesh as the in-job teacher is (by the model's partition specs
when the mesh has several devices) and scores the student's tokens causally
(`teacher_kind='ar'` of `rl.opd`).

Everything here that checks runs before any compute: the `teacher` section
(`check_teacher_section`) and the tokenizers (`check_tokenizers_agree`: OPD
compares the two distributions token id by token id, so both sides must
mean the same thing by every id).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import jax
import omegaconf

from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import recipe_paths
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_configs

KINDS = ("ar", "hf")
# Keys of the in-job teacher (`kind: ar`): its sizes and its training.
IN_JOB_KEYS = (
    "random_mlp",
    "num_layers",
    "embed_dim",
    "hidden_dim",
    "num_heads",
    "head_dim",
    "num_kv_heads",
    "steps",
    "batch_size",
    "learning_rate",
    "warmup_steps",
    "num_train",
)
# Keys of an HF teacher (`kind: hf`).
HF_KEYS = ("path", "dtype")
_BUNDLED_RECIPE = "opd_tiny.yaml"
# Files that make a directory hold a Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def teacher_kind(teacher_cfg) -> str:
  """The `teacher.kind` (`ar` when absent)."""
  return str(teacher_cfg.get("kind") or "ar")


def _bundled_teacher() -> dict[str, Any]:
  base = omegaconf.OmegaConf.load(common.recipe_path(_BUNDLED_RECIPE))
  return common.to_dict(base.teacher)


def check_teacher_section(teacher_cfg) -> None:
  """Raises a one-line `UsageError` for a `teacher` section that cannot run.

  `kind` must be one of `KINDS`. With `kind: hf`, `path` must be a Hugging
  Face model directory (`config.json` of a supported family, with fields
  and `dtype` its loader takes, and `*.safetensors`), and no key of the
  in-job teacher (`IN_JOB_KEYS`: its sizes and training) may be set: each
  must be null or keep the bundled recipe's value, since the checkpoint's
  `config.json` sizes the model and nothing trains it. With `kind: ar`,
  `path` must be null.

  Args:
    teacher_cfg: The recipe's `teacher` section.
  """
  kind = teacher_kind(teacher_cfg)
  if kind not in KINDS:
    raise errors.UsageError(
        f"teacher.kind must be one of {list(KINDS)}, got {kind!r}"
    )
  path = teacher_cfg.get("path")
  if kind == "ar":
    if path:
      raise errors.UsageError(
          f"teacher.path={path} is for teacher.kind=hf; teacher.kind=ar"
          " trains a tiny teacher in the job: set teacher.kind=hf or drop"
          " teacher.path"
      )
    return
  defaults = _bundled_teacher()
  given = [
      key
      for key in IN_JOB_KEYS
      if teacher_cfg.get(key) is not None
      and common.to_dict(teacher_cfg.get(key)) != defaults.get(key)
  ]
  if given:
    key = given[0]
    raise errors.UsageError(
        f"teacher.{key}={common.to_dict(teacher_cfg.get(key))} is a key of"
        " the in-job teacher (teacher.kind=ar); teacher.kind=hf takes its"
        " sizes from teacher.path's config.json and is never trained: drop"
        f" teacher.{key} (keep {defaults.get(key)!r} or null)"
    )
  hf_config = _read_config(check_hf_dir(path))
  try:  # The model config the loader will build: unsupported fields, dtype.
    hf_configs.CONFIG_FROM_HF[hf_configs.family_of(hf_config)](
        hf_config, dtype=str(teacher_cfg.get("dtype") or "float32")
    )
  except (KeyError, TypeError, ValueError) as e:
    raise errors.UsageError(
        f"teacher.path={path}: {errors.one_line(e)}"
    ) from None


def check_hf_dir(path) -> pathlib.Path:
  """`teacher.path` as a Hugging Face model directory, or a `UsageError`."""
  directory = recipe_paths.check_hf_dir("teacher.path", path)
  try:
    hf_configs.family_of(_read_config(directory))
  except ValueError as e:
    raise errors.UsageError(
        f"teacher.path={path}: {errors.one_line(e)}"
    ) from None
  return directory


def _read_config(directory: pathlib.Path) -> dict[str, Any]:
  try:
    return json.loads((directory / "config.json").read_text())
  except json.JSONDecodeError as e:
    raise errors.UsageError(
        f"{directory / 'config.json'} is not valid JSON: {errors.one_line(e)}"
    ) from None


def config_vocab_size(hf_config: Mapping[str, Any]) -> int:
  """The logits width V a `config.json` declares (Gemma3: its text part)."""
  text = hf_configs.gemma3_text_config(hf_config)
  return int(text["vocab_size"])


def _config_id(hf_config: Mapping[str, Any], key: str):
  """`key` of the config or of its `text_config` (int, list or None)."""
  value = hf_config.get(key)
  if value is None and isinstance(hf_config.get("text_config"), Mapping):
    value = hf_config["text_config"].get(key)
  return value


def teacher_ids(path) -> dict[str, Any]:
  """What the HF teacher at `path` says about its vocabulary.

  Returns:
    `vocab_size` (the logits width, from `config.json`), `pad`, `eos`, `bos`
    (each a set of the ids `config.json` and the directory's tokenizer, if
    it has one, give; empty where neither does), and `tokenizer_size` (the
    tokenizer's length, or None without a tokenizer).
  """
  directory = pathlib.Path(str(path)).expanduser()
  hf_config = _read_config(directory)
  ids = {"pad": set(), "eos": set(), "bos": set()}
  for name in ids:
    value = _config_id(hf_config, f"{name}_token_id")
    values = value if isinstance(value, list) else [value]
    ids[name] |= {int(v) for v in values if v is not None}
  tokenizer_size = None
  if any((directory / f).is_file() for f in _TOKENIZER_FILES):
    tokenizer = checkpoints.HFTokenizer(directory)
    tokenizer_size = int(tokenizer.vocab_size)
    for name, value in (
        ("pad", tokenizer.pad_id()),
        ("eos", tokenizer.eos_id()),
        ("bos", tokenizer.bos_id()),
    ):
      if value is not None and not ids[name]:
        ids[name].add(int(value))
  return {
      "vocab_size": config_vocab_size(hf_config),
      "tokenizer_size": tokenizer_size,
      **ids,
  }


def recipe_vocab_size(model_cfg) -> int:
  """The logits width V of an SFT recipe's `model`, without building it."""
  if str(model_cfg.kind).endswith("_hf"):
    return config_vocab_size(checkpoints.read_hf_config(model_cfg.path))
  return int(model_cfg.vocab_size)


def check_tokenizers_agree(
    path,
    tokenizer,
    *,
    vocab_size: int,
    mask_token_id: int | None,
) -> None:
  """Raises a one-line `UsageError` unless teacher and student share ids.

  Checks, naming both values: the logits widths (teacher `config.json`
  `vocab_size` vs the student model's), the tokenizer lengths (when the
  teacher directory has a tokenizer and the student's tokenizer tells its
  size), the pad, EOS and BOS ids wherever the teacher declares them, and
  that the student's mask id is a valid teacher id.

  Args:
    path: The HF teacher directory.
    tokenizer: The student's tokenizer (`pad_id`, `eos_id`, `bos_id`).
    vocab_size: The student model's logits width.
    mask_token_id: The student's mask id (`diffusion.mask_token_id`), or
      None for a student without one (DiffusionGemma).
  """
  teacher = teacher_ids(path)
  where = f"teacher.path={path}"
  if teacher["vocab_size"] != int(vocab_size):
    raise errors.UsageError(
        f"{where}: the teacher's vocabulary size {teacher['vocab_size']}"
        f" (config.json vocab_size) differs from the student's {vocab_size};"
        " OPD compares the two distributions token by token and needs one"
        " shared tokenizer"
    )
  student_size = getattr(tokenizer, "vocab_size", None)
  if teacher["tokenizer_size"] is not None and student_size is not None:
    if teacher["tokenizer_size"] != int(student_size):
      raise errors.UsageError(
          f"{where}: the teacher's tokenizer has {teacher['tokenizer_size']}"
          f" ids, the student's {student_size}; OPD needs one shared"
          " tokenizer"
      )
  for name, student_id in (
      ("pad", tokenizer.pad_id()),
      ("eos", tokenizer.eos_id()),
      ("bos", tokenizer.bos_id()),
  ):
    allowed = teacher[name]
    if not allowed or student_id is None:
      continue  # Declared on one side only: nothing to compare.
    if int(student_id) not in allowed:
      shown = sorted(allowed)
      raise errors.UsageError(
          f"{where}: the teacher's {name} id"
          f" {shown[0] if len(shown) == 1 else shown} differs from the"
          f" student's {int(student_id)}; OPD needs one shared tokenizer"
      )
  if mask_token_id is not None and not 0 <= int(mask_token_id) < teacher[
      "vocab_size"]:
    raise errors.UsageError(
        f"{where}: the student's mask id {mask_token_id}"
        " (diffusion.mask_token_id) is not an id of the teacher's vocabulary"
        f" of {teacher['vocab_size']}"
    )


def check_student(teacher_cfg, sft_cfg) -> None:
  """`check_tokenizers_agree` for the student an SFT recipe describes."""
  check_tokenizers_agree(
      teacher_cfg.path,
      common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model),
      vocab_size=recipe_vocab_size(sft_cfg.model),
      mask_token_id=int(sft_cfg.diffusion.mask_token_id),
  )


def load_teacher(teacher_cfg, mesh: jax.sharding.Mesh | None = None):
  """The frozen HF teacher, placed on `mesh` like the in-job teacher.

  Args:
    teacher_cfg: The `teacher` section (`path`, optional `dtype`, default
      float32); `check_teacher_section` has passed.
    mesh: The job's mesh: with several devices the parameters are sharded
      by the model's partition specs (Tunix's rules).

  Returns:
    The Tunix model of the checkpoint's family.
  """
  shards = distributed.shards_rows(mesh)
  try:
    model = checkpoints.load_hf(
        check_hf_dir(teacher_cfg.get("path")),
        dtype=str(teacher_cfg.get("dtype") or "float32"),
        mesh=mesh if shards else None,
    )
  except ValueError as e:
    if isinstance(e, errors.UsageError):
      raise
    raise errors.UsageError(
        f"teacher.path={teacher_cfg.get('path')}: {errors.one_line(e)}"
    ) from None
  if shards:
    model = common.shard_model(model, mesh)
  return model


__all__ = [
    "HF_KEYS",
    "IN_JOB_KEYS",
    "KINDS",
    "check_hf_dir",
    "check_student",
    "check_teacher_section",
    "check_tokenizers_agree",
    "config_vocab_size",
    "load_teacher",
    "recipe_vocab_size",
    "teacher_ids",
    "teacher_kind",
]
