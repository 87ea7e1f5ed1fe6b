"""`tunix-blockdiff export RUN OUT [options]`: an SFT run -> a Hugging Face dir.

Loads RUN's recipe and latest checkpoint (LoRA merged, as `generate` does;
an rl/opd output_dir exports its final `policy/`) and writes OUT, a new Hugging Face model directory that `checkpoints.load_hf`
and `tunix-blockdiff generate OUT` read on their own:

  config.json          the family's HF config plus a `block_diffusion`
                       section (block size, mask id, alignment, stream, the
                       decoding defaults, the tokenizer; docs/export.md)
  model.safetensors    the weights in the run's dtype, or
                       model-0000i-of-0000n.safetensors +
                       model.safetensors.index.json above --max-shard-size
  tokenizer files      tokenizer.json, ... when the run has an HF tokenizer

Options:
  --max-shard-size SIZE  largest weights file before sharding (default 5GB;
                         GB = 10^9 bytes, GiB = 2^30)
  --tokenizer-files      require the tokenizer files (an error for a run
                         with the in-code char tokenizer, whose spec the
                         `block_diffusion` section carries instead)

Every check runs before anything is written, and OUT is written into a
temporary directory beside it and renamed at the end, so a failed export
leaves nothing behind.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys
from typing import Any, NamedTuple, Sequence
import uuid

import omegaconf

from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import exported
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import released
from tunix_blockdiff.models import registry

USAGE = (
    "usage: tunix-blockdiff export RUN OUT [--max-shard-size SIZE]"
    " [--tokenizer-files]"
)
_FLAGS = ("--max-shard-size", "--tokenizer-files")


class Args(NamedTuple):
  """The parsed command line.

  Attributes:
    run_dir: The SFT output_dir.
    out: The Hugging Face directory to create.
    max_shard_bytes: Largest safetensors file before sharding.
    tokenizer_files: Whether the tokenizer files are required.
  """

  run_dir: pathlib.Path
  out: pathlib.Path
  max_shard_bytes: int
  tokenizer_files: bool


def parse_args(argv: Sequence[str]) -> Args:
  """`RUN OUT [--max-shard-size SIZE] [--tokenizer-files]` -> `Args`."""
  positional, max_shard, tokenizer_files = [], "5GB", False
  argv = list(argv)
  while argv:
    arg = argv.pop(0)
    if arg == "--tokenizer-files":
      tokenizer_files = True
    elif arg == "--max-shard-size" or arg.startswith("--max-shard-size="):
      if "=" in arg:
        max_shard = arg.split("=", 1)[1]
      elif argv:
        max_shard = argv.pop(0)
      else:
        raise errors.UsageError("--max-shard-size needs a size, e.g. 5GB")
    elif arg.startswith("-"):
      raise errors.UsageError(
          f"unknown export option {arg!r}{errors.nearest(arg, _FLAGS)}; {USAGE}"
      )
    else:
      positional.append(arg)
  if len(positional) != 2:
    raise errors.UsageError(
        f"{USAGE}; RUN is the output_dir of a `tunix-blockdiff sft` run, OUT"
        f" a new directory (got {len(positional)} paths)"
    )
  try:
    max_shard_bytes = hf_export.parse_size(max_shard)
  except ValueError as e:
    raise errors.UsageError(f"--max-shard-size: {e}") from None
  run_dir, out = (pathlib.Path(p).expanduser().resolve() for p in positional)
  # An rl/opd output_dir holds its final policy, in the SFT layout, below.
  return Args(
      rl_checkpoints.policy_dir(run_dir), out, max_shard_bytes, tokenizer_files
  )


def has_checkpoint(run_dir: pathlib.Path) -> bool:
  """Whether `run_dir/checkpoints` holds a step (Orbax's `<step>/` dirs)."""
  root = run_dir / "checkpoints"
  return root.is_dir() and any(
      p.is_dir() and p.name.isdigit() for p in root.iterdir()
  )


def family_of(model_kind: str) -> str:
  """`tiny_<family>` / `<family>_hf` -> family, or a `UsageError`."""
  if model_kind not in registry.KINDS:
    raise errors.UsageError(
        f"RUN's model.kind {model_kind!r} cannot be exported: export writes"
        f" {list(registry.FAMILIES)} models (model.kind one of"
        f" {list(registry.KINDS)})"
    )
  return model_kind.removeprefix("tiny_").removesuffix("_hf")


def tokenizer_source(cfg) -> pathlib.Path | None:
  """The directory of an HF tokenizer's files (None for the char one)."""
  if cfg.tokenizer.kind != "hf":
    return None
  path = cfg.tokenizer.get("path") or cfg.model.get("path")
  return None if not path else pathlib.Path(str(path)).expanduser()


# LoRA on these weights does not lay out as the weight (`merge_lora`).
_UNMERGEABLE = {"gemma3": ("q_einsum", "kv_einsum", "qkv_einsum")}


def check_lora_mergeable(cfg, family: str) -> None:
  """Refuses LoRA whose `module_path` reaches a weight merge cannot merge.

  qwix matches `lora.module_path` (a regex, full match) against module
  paths such as `layers/0/attn/q_einsum`.
  """
  lora = cfg.get("lora")
  if not common.lora_enabled(lora) or family not in _UNMERGEABLE:
    return
  num_layers = cfg.model.get("num_layers")
  if str(cfg.model.kind).endswith("_hf"):
    from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

    num_layers = checkpoints.read_hf_config(cfg.model.path).get(
        "num_hidden_layers"
    )
  for i in range(int(num_layers or 1)):
    for name in _UNMERGEABLE[family]:
      if re.fullmatch(str(lora.module_path), f"layers/{i}/attn/{name}"):
        raise errors.UsageError(
            f"RUN's LoRA cannot be merged into the exported weights:"
            f" lora.module_path {str(lora.module_path)!r} reaches {family}'s"
            f" layers/{i}/attn/{name}, an einsum weight whose LoRA factors do"
            " not lay out as the weight (LoRA on attn_vec_einsum and the MLP"
            " merges)"
        )


def check(args: Args):
  """Every refusal that needs no model: returns the run's recipe.

  Raises:
    UsageError: RUN is not an SFT run, has no checkpoint, a model kind or
      tokenizer export cannot write, or OUT exists and is not empty.
  """
  recipe = _recipe_file(args)
  if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
    raise errors.UsageError(
        f"OUT {args.out} exists and is not an empty directory: export writes"
        " a new directory"
    )
  if args.out == args.run_dir or args.run_dir in args.out.parents:
    raise errors.UsageError(f"OUT {args.out} must be outside RUN")
  cfg = omegaconf.OmegaConf.load(recipe)
  check_lora_mergeable(cfg, family_of(str(cfg.model.kind)))
  if not has_checkpoint(args.run_dir):
    raise errors.MissingFileError(
        f"no checkpoint under {args.run_dir / 'checkpoints'}: RUN has not"
        " saved a step yet"
    )
  source = tokenizer_source(cfg)
  if cfg.tokenizer.kind == "char" and args.tokenizer_files:
    raise errors.UsageError(
        "--tokenizer-files: RUN uses the in-code char tokenizer, which has no"
        " tokenizer files (leave the flag out: config.json's block_diffusion"
        " section records the char tokenizer)"
    )
  if cfg.tokenizer.kind == "hf":
    try:
      hf_export.tokenizer_files(source or "")
    except FileNotFoundError:
      raise errors.MissingFileError(
          f"RUN's HF tokenizer has no tokenizer.json at {source}"
          " (tokenizer.path or model.path)"
      ) from None
  return cfg


def _merged_model(args: Args, cfg):
  """RUN's model with its latest checkpoint, LoRA merged (as generate does)."""
  from tunix_blockdiff.jobs import generate  # pylint: disable=g-import-not-at-top

  try:
    return generate.load_trained_model(args.run_dir, cfg)
  except ValueError as e:
    if common.lora_enabled(cfg.get("lora")) and "merge" in str(e):
      raise errors.UsageError(
          f"RUN's LoRA cannot be merged into the exported weights: {e}"
      ) from None
    raise


def _with_base_config(cfg, hf_config: dict[str, Any]) -> dict[str, Any]:
  """`hf_config` over the base checkpoint's config.json (a `*_hf` run).

  Keeps what Tunix does not model but Hugging Face users read (e.g.
  `max_position_embeddings`); every key export writes wins. A released
  block-diffusion base (`models.released`: SDAR, Fast-dLLM v2) keeps its
  own format: its `model_type`, `architectures` (and `auto_map`), with the
  run's block size and mask token id under the format's keys, so the
  format's own tools load the result.
  """
  if not str(cfg.model.kind).endswith("_hf"):
    return hf_config
  base = exported.read_config(str(cfg.model.path)) or {}
  fmt = released.detect(base)  # a refused base never trained a run
  if fmt is not None:
    base.pop(exported.SECTION, None)
    diffusion = common.diffusion_config_from(cfg.diffusion)
    merged = {
        **base,
        **hf_config,
        "model_type": base["model_type"],
        "architectures": base.get("architectures") or list(fmt.architectures),
        "mask_token_id": diffusion.mask_token_id,
    }
    if fmt.block_size_key is not None:
      merged[fmt.block_size_key] = diffusion.block_size
    return merged
  if base.get("model_type") != hf_config["model_type"]:
    return hf_config  # e.g. a multimodal gemma3 whose text part was loaded
  base.pop(exported.SECTION, None)
  return {**base, **hf_config}


def remote_code_files(cfg) -> list[pathlib.Path]:
  """A released base checkpoint's modeling code (`*.py`), else nothing.

  Copied beside the exported weights, so that `trust_remote_code` loaders
  of the format (its `auto_map`) find them.
  """
  if not str(cfg.model.kind).endswith("_hf"):
    return []
  path = pathlib.Path(str(cfg.model.path)).expanduser()
  if released.detect(exported.read_config(path) or {}) is None:
    return []
  return sorted(path.glob("*.py"))


def build(args: Args, cfg):
  """({HF key: tensor}, config.json dict) of RUN: all compute, no writes."""
  from tunix_blockdiff.jobs import generate  # pylint: disable=g-import-not-at-top

  model, step = _merged_model(args, cfg)
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  diffusion = common.diffusion_config_from(cfg.diffusion)
  family = family_of(str(cfg.model.kind))
  try:
    hf_config = hf_export.FAMILIES[family].hf_config(model.config)
  except ValueError as e:
    raise errors.UsageError(f"RUN's model cannot be exported: {e}") from None
  try:
    prompts, budget, scored = generate.held_out_prompts(
        cfg, tokenizer, model, diffusion
    )
  except errors.UsageError as e:  # e.g. the run's eval file has moved
    print(
        f"export: no default prompts recorded ({errors.one_line(e)});"
        " generate OUT then needs prompts=[...] and max_new_tokens=N",
        file=sys.stderr,
    )
    prompts, budget, scored = [], None, False
  hf_config = _with_base_config(cfg, hf_config)
  _, tensors = hf_export.hf_tensors(model, family=family)
  hf_config.update(
      torch_dtype=next(iter(tensors.values())).dtype.name,
      bos_token_id=tokenizer.bos_id(),
      eos_token_id=tokenizer.eos_id(),
      pad_token_id=tokenizer.pad_id(),
  )
  hf_config[exported.SECTION] = exported.section(
      cfg,
      run_dir=args.run_dir,
      step=step,
      tokenizer=tokenizer,
      decoding=exported.decoding_defaults(cfg, generate.DEFAULTS, budget),
      eval_prompts=prompts,
      eval_scored=scored,
  )
  return tensors, hf_config


def write(args: Args, cfg, tensors, hf_config) -> list[str]:
  """Writes OUT through a temporary sibling directory; returns file names.

  Parent directories OUT needs are created, and removed again on failure.
  """
  created = next((p for p in reversed(args.out.parents) if not p.exists()), None)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  # Not tempfile.mkdtemp: its 0700 mode would stay on OUT after the rename.
  staging = args.out.parent / f".{args.out.name}.partial-{uuid.uuid4().hex[:8]}"
  staging.mkdir()
  try:
    files = hf_export.write_safetensors(
        tensors, staging, max_shard_bytes=args.max_shard_bytes
    )
    (staging / exported.CONFIG_FILE).write_text(
        json.dumps(common._jsonable(hf_config), indent=2) + "\n"  # pylint: disable=protected-access
    )
    source = tokenizer_source(cfg)
    tokenizer = [] if source is None else hf_export.tokenizer_files(source)
    for file in [*tokenizer, *remote_code_files(cfg)]:
      shutil.copyfile(file, staging / file.name)
      files.append(file.name)
    if args.out.exists():
      args.out.rmdir()  # empty (checked); rename cannot replace it otherwise
    staging.rename(args.out)
  except BaseException:
    shutil.rmtree(created or staging, ignore_errors=True)
    raise
  return [exported.CONFIG_FILE] + files


def run(args: Args) -> dict[str, Any]:
  """Exports with RUN's model kind; returns a summary."""
  recipe = _recipe_file(args)
  return kinds.of_recipe(omegaconf.OmegaConf.load(recipe)).call(
      "export", args)


def _recipe_file(args: Args) -> pathlib.Path:
  recipe = args.run_dir / common.RECIPE_FILE
  if not recipe.is_file():
    raise errors.MissingFileError(
        f"{recipe} not found: RUN must be the output_dir of a"
        " `tunix-blockdiff sft` run"
    )
  return recipe


def run_block_diffusion(args: Args) -> dict[str, Any]:
  """Checks, builds and writes OUT; returns a summary."""
  cfg = check(args)
  tensors, hf_config = build(args, cfg)
  files = write(args, cfg, tensors, hf_config)
  return {
      "out": str(args.out),
      "files": files,
      "family": exported.read_config(args.out)["model_type"],
      "checkpoint_step": hf_config[exported.SECTION]["source"][
          "checkpoint_step"
      ],
  }


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    print(USAGE)
    return 0
  summary = run(parse_args(argv))
  print(
      f"wrote {summary['out']} ({summary['family']}, checkpoint step"
      f" {summary['checkpoint_step']}): {', '.join(summary['files'])}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
