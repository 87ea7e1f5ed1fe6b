"""`distill-data` from a block-diffusion checkpoint: self-distillation data.

A block-diffusion model trained on its own decodes becomes confident about
them: dParallel's certainty-forcing self-distillation trains the model on
its own trajectories, with the certainty term on the masked slots it already
gets right, and then commits several slots per call under a threshold
schedule. `tunix-blockdiff distill-data RUN_DIR PROMPTS OUT.jsonl
--threshold T` writes those trajectories as `{"prompt", "completion"}`
rows: RUN_DIR is the output_dir of an `sft`, `opd` or `rl` run, or a
directory `tunix-blockdiff export` wrote, and every prompt is decoded with
the exact block-KV-cached driver (`rollout.cached.generate`) under the
run's own block size, mask id and alignment.

`distill_data` reads the command line and writes the rows; this module
finds, loads and decodes the checkpoint.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple, Sequence

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import exported
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import rl_checkpoints


class Source(NamedTuple):
  """A block-diffusion checkpoint directory and its settings.

  Attributes:
    directory: The run's (or opd run's policy) directory, or an exported one.
    recipe: The run's recipe (None for an exported directory).
    tokenizer: The run's tokenizer.
    diffusion: The run's `BlockDiffusionConfig`.
  """

  directory: pathlib.Path
  recipe: Any
  tokenizer: Any
  diffusion: config_lib.BlockDiffusionConfig


def find(path: str) -> pathlib.Path | None:
  """The block-diffusion checkpoint directory at `path`, or None.

  An `sft` or `rl` output_dir (its recipe.yaml), an `opd` output_dir (its
  `policy/`), or a directory `export` wrote (its config.json's
  `block_diffusion` section); anything else is None (an AR checkpoint).
  """
  directory = pathlib.Path(path).expanduser()
  if not directory.is_dir():
    return None
  directory = rl_checkpoints.policy_dir(directory.resolve())
  if exported.is_exported(directory):
    return directory
  if (directory / common.RECIPE_FILE).is_file():
    return directory
  return None


def open_source(directory: pathlib.Path) -> Source:
  """The tokenizer and settings of a checkpoint `find` returned; no model."""
  import omegaconf  # pylint: disable=g-import-not-at-top

  if exported.is_exported(directory):
    found = exported.read_section(directory)
    return Source(
        directory,
        None,
        exported.build_tokenizer(directory, found),
        exported.diffusion_config(found),
    )
  recipe = omegaconf.OmegaConf.load(directory / common.RECIPE_FILE)
  kind = kinds.of_recipe(recipe)
  try:
    source = kind.implementation("distill_data")
  except errors.UsageError as e:
    raise errors.UsageError(f"{directory} is a {kind.description}: {e}") from None
  return source(directory, recipe)


def source_block_diffusion(directory: pathlib.Path, recipe) -> Source:
  """The `Source` of a block-diffusion run's recipe."""
  try:
    diffusion = common.diffusion_config_from(recipe.diffusion)
  except (TypeError, ValueError) as e:
    raise errors.UsageError(
        f"{directory / common.RECIPE_FILE}: {errors.one_line(e)}"
    ) from None
  return Source(
      directory,
      recipe,
      common.build_tokenizer(recipe.tokenizer, recipe.model),
      diffusion,
  )


def load_model(source: Source):
  """The checkpoint's Tunix model (the latest step; LoRA merged)."""
  if source.recipe is None:
    return exported.load(source.directory).model
  from tunix_blockdiff.jobs import generate  # pylint: disable=g-import-not-at-top

  model, _ = generate.load_trained_model(source.directory, source.recipe)
  return model


def denoise_completions(
    model,
    source: Source,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    threshold: float,
    steps_per_block: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
  """Each prompt's completion ids under the run's block denoiser.

  One compiled program: every call has `batch_size` rows (the last batch is
  padded by repeating its last prompt) and the width of the longest prompt,
  left-padded. Batch i samples (at `temperature` > 0) with key
  `fold_in(key(seed), i)`.

  Args:
    model: The checkpoint's Tunix model.
    source: Its `Source` (tokenizer and block-diffusion settings).
    prompts: Prompt strings (BOS is added as in SFT rows).
    max_new_tokens: Completion slots per prompt.
    batch_size: Rows per call.
    threshold: Confidence threshold of the schedule (0 < t <= 1).
    steps_per_block: A static schedule instead (None: threshold).
    temperature: 0: greedy proposals; > 0 samples.
    seed: Sampling seed.

  Returns:
    Per prompt, `max_new_tokens` ids: the completion, its EOS, then pad.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.rollout import cached  # pylint: disable=g-import-not-at-top

  tokenizer, diffusion = source.tokenizer, source.diffusion
  encoded = [common.encode_pair(tokenizer, p, "")[0] for p in prompts]
  width = max(len(ids) for ids in encoded)
  config = config_lib.DenoiseConfig(
      block_size=diffusion.block_size,
      mask_token_id=diffusion.mask_token_id,
      alignment=diffusion.alignment,
      threshold=float(threshold),
      steps_per_block=steps_per_block,
      temperature=float(temperature),
      eos_token_id=tokenizer.eos_id(),
      pad_token_id=tokenizer.pad_id(),
  )
  out = []
  for i, start in enumerate(range(0, len(encoded), batch_size)):
    chunk = encoded[start : start + batch_size]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - real)
    tokens = np.full((batch_size, width), tokenizer.pad_id(), np.int32)
    for b, ids in enumerate(chunk):
      tokens[b, width - len(ids) :] = ids
    result = cached.generate(
        model,
        tokens,
        np.asarray([len(ids) for ids in chunk], np.int32),
        config,
        max_new_tokens=int(max_new_tokens),
        rng=jax.random.fold_in(jax.random.key(int(seed)), i),
    )
    out.extend(
        [int(t) for t in row] for row in np.asarray(result.tokens)[:real]
    )
  return out


__all__ = ["Source", "denoise_completions", "find", "load_model", "open_source"]
