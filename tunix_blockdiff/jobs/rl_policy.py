"""The policy of the `rl` and `opd` jobs: an SFT run's model, or a warm start.

`load_policy` restores the block-diffusion policy from an `init.checkpoint`
(the `output_dir` of an sft, rl or opd run) or, when that is null, runs the
SFT job's Python API first (`sft_warm_start`) and restores its result.
`policy_recipe` reads the recipe the policy would have without any compute,
for the jobs' checks up front.
"""

from __future__ import annotations

import json
import pathlib

import jax
import omegaconf
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import outputs
from tunix_blockdiff.runs import rl_checkpoints


def load_sft_policy(
    directory: str | pathlib.Path, mesh: jax.sharding.Mesh | None = None
):
  """(model, SFT recipe) restored from an SFT, rl or opd job's `output_dir`.

  An rl/opd output_dir's final policy is its `policy/` subdirectory
  (`rl_checkpoints.policy_dir`). The model is rebuilt from the saved recipe
  and its parameters (or LoRA parameters, on top of the seed-determined
  base) restored from the latest Orbax checkpoint in `checkpoints/`. Under
  a `mesh` the parameters are placed by the model's partition specs first,
  so every process restores its own shards.
  """
  directory = rl_checkpoints.policy_dir(directory)
  recipe_file = directory / common.RECIPE_FILE
  if not recipe_file.is_file():
    raise FileNotFoundError(
        f"{recipe_file} not found: init.checkpoint must be the output_dir of"
        " an sft, rl or opd run"
    )
  sft_cfg = omegaconf.OmegaConf.load(recipe_file)
  model = common.build_model(sft_cfg.model, seed=int(sft_cfg.seed), mesh=mesh)
  model = common.apply_lora(model, sft_cfg.lora, seed=int(sft_cfg.seed))
  model = common.shard_model(model, mesh)
  manager = checkpoint_lib.CheckpointManager(str(directory / "checkpoints"))
  step, _ = manager.maybe_restore(
      model, restore_only_lora_params=common.lora_enabled(sft_cfg.lora)
  )
  manager.close()
  if step == 0:
    raise FileNotFoundError(f"no checkpoint under {directory / 'checkpoints'}")
  return model, sft_cfg


def sft_warm_start(
    init_cfg, out: pathlib.Path, mesh_cfg=None
) -> tuple[pathlib.Path, dict]:
  """Runs the SFT job (its Python API) into `out/<name>`; returns (dir, summary).

  A `mesh_cfg` ({fsdp, sp, tp}) is passed on to the SFT recipe (the warm
  start then trains on the job's mesh).
  """
  from tunix_blockdiff.jobs import sft as sft_job  # pylint: disable=g-import-not-at-top

  directory, sft_cfg = warm_start_recipe(init_cfg, out, mesh_cfg)
  summary_file = directory / outputs.SUMMARY_FILE
  if summary_file.is_file():  # A relaunch: the warm start finished before.
    return directory, json.loads(summary_file.read_text())
  summary = sft_job.run(sft_cfg)
  return directory, summary


def warm_start_recipe(
    init_cfg, out: pathlib.Path, mesh_cfg=None
) -> tuple[pathlib.Path, omegaconf.DictConfig]:
  """(dir, SFT recipe) of the warm start `sft_warm_start` runs; no compute."""
  directory = out / str(init_cfg.get("output_subdir", "sft"))
  overrides = [str(o) for o in init_cfg.sft_overrides or []]
  if mesh_cfg is not None:
    overrides += [
        f"mesh.{axis}={size}"
        for axis, size in distributed.mesh_shape(common.to_dict(mesh_cfg)).items()
    ]
  sft_cfg = common.load_recipe(
      [str(init_cfg.sft_recipe), *overrides, f"output_dir={directory}"]
  )
  return directory, sft_cfg


def policy_recipe(
    init_cfg, out: pathlib.Path, mesh_cfg=None
) -> omegaconf.DictConfig:
  """The SFT recipe of the policy `load_policy` would load, read only.

  For checks before any compute: `init.checkpoint`'s saved recipe, or the
  warm start's recipe (nothing runs).

  Raises:
    errors.MissingFileError: `init.checkpoint` has no saved recipe.
  """
  if not init_cfg.checkpoint:
    return warm_start_recipe(init_cfg, out, mesh_cfg)[1]
  recipe_file = rl_checkpoints.policy_dir(str(init_cfg.checkpoint)) / (
      common.RECIPE_FILE
  )
  if not recipe_file.is_file():
    raise errors.MissingFileError(
        f"{recipe_file} not found: the checkpoint must be an SFT output_dir"
    )
  return omegaconf.OmegaConf.load(recipe_file)


def load_policy(
    init_cfg,
    out: pathlib.Path,
    mesh: jax.sharding.Mesh | None = None,
    mesh_cfg=None,
):
  """(model, SFT recipe, SFT summary or None) for an `init` recipe section.

  `init.checkpoint` names an SFT output_dir; when null, the SFT job runs
  `init.sft_recipe` with `init.sft_overrides` (and the job's `mesh_cfg`)
  into `out/init.output_subdir`. The policy is placed on `mesh`.
  """
  if init_cfg.checkpoint:
    model, sft_cfg = load_sft_policy(init_cfg.checkpoint, mesh)
    return model, sft_cfg, None
  directory, summary = sft_warm_start(init_cfg, out, mesh_cfg)
  model, sft_cfg = load_sft_policy(directory, mesh)
  return model, sft_cfg, summary


__all__ = [
    "load_policy",
    "load_sft_policy",
    "policy_recipe",
    "sft_warm_start",
    "warm_start_recipe",
]
