"""The model a job's recipe names: built, with LoRA, placed on the mesh.

`build_model` builds a recipe's `model` section (`models.build_model`),
`apply_lora` wraps it in qwix LoRA when the recipe's `lora` section asks
(`traced_lora`: qwix's model pass traced, not dispatched op by op), and
`shard_model` places its parameters by the model's own partition specs
(Tunix's rules), after `check_model_fits_mesh` has named any parameter that
does not divide over its mesh axes. `runs.common` re-exports them.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import layouts
from tunix_blockdiff import models as models_lib
from tunix_blockdiff.models import flash
from tunix_blockdiff.models import remat as remat_lib
from tunix_blockdiff.objective import loss as loss_lib


check_model_fits_mesh = layouts.check_fits_mesh


def shard_model(model, mesh: jax.sharding.Mesh | None):
  """Places the parameters by the model's own partition specs (Tunix rules).

  Without a mesh, commits them to the first device, where a checkpoint
  restore would put them (`layouts.commit_to_one_device`).

  Raises:
    ValueError: A parameter does not divide over its mesh axes
      (`check_model_fits_mesh`).
  """
  if mesh is None:
    layouts.commit_to_one_device(model)
    return model
  from tunix.rl import reshard  # pylint: disable=g-import-not-at-top

  check_model_fits_mesh(model, mesh)
  if jax.process_count() == 1:
    return reshard.reshard_model_to_mesh(model, mesh)
  # Several processes: Tunix's reshard device_puts onto devices of other
  # processes, which JAX refuses. Every process holds the same host model
  # (same seed, same checkpoint), so each builds its own shards from it.
  placed = nnx.merge(*nnx.split(model))
  layouts.place_on_mesh(placed, mesh)
  return placed


def build_model(model_cfg, *, seed: int, mesh: jax.sharding.Mesh | None = None):
  """The model of a recipe's `model` section (`models.build_model`)."""
  return models_lib.build_model(model_cfg, seed=seed, mesh=mesh)


model_vocab_size = models_lib.model_vocab_size


def check_released_settings(model_cfg, diffusion) -> None:
  """A released checkpoint's (`model.path`) block diffusion = the recipe's.

  A no-op for other models (`models.released.check_diffusion`).

  Raises:
    UsageError: naming the `diffusion` key to set, or a refused variant.
  """
  if not str(model_cfg.kind).endswith("_hf") or not model_cfg.get("path"):
    return
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.models import released  # pylint: disable=g-import-not-at-top

  try:
    hf_config = checkpoints.read_hf_config(model_cfg.path)
  except FileNotFoundError as e:
    raise errors.MissingFileError(str(e)) from None
  try:
    if released.detect(hf_config) is not None:
      released.check_diffusion(hf_config, model_cfg.path, diffusion)
  except ValueError as e:
    raise errors.UsageError(f"model.path={model_cfg.path}: {e}") from None


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
  return traced_lora(model, provider, seed=seed)


def traced_lora(model, provider, *, seed: int):
  """`qwix.apply_lora_to_model` with its model pass traced, not run op by op.

  qwix finds the modules to wrap by running the model once on its dummy
  inputs (`get_model_input`). Run eagerly, that pass dispatches (and, on a
  new shape, compiles) every op of the forward on its own; here the wrapped
  structure comes from `nnx.eval_shape`, the new LoRA parameters from one
  jitted program with no inputs (placed where the eager draws would be:
  on no device in particular, or by their partition specs on the weights'
  mesh), and the base weights are the input's own arrays. The result
  equals the eager call's bit for bit, placement included (tested); what
  this cannot reproduce (weights over several processes, PRNG key state)
  takes qwix's eager pass.

  Args:
    model: A model with `get_model_input()` (left unchanged, as qwix does).
    provider: The `qwix.LoraProvider`.
    seed: Seed of the LoRA parameters' draw (`nnx.Rngs(seed)`).

  Returns:
    A new model with the LoRA parameters.
  """
  import qwix  # pylint: disable=g-import-not-at-top

  inputs = model.get_model_input()

  def wrap(m):
    return qwix.apply_lora_to_model(m, provider, rngs=nnx.Rngs(seed), **inputs)

  base_graphdef, base_state = nnx.split(model)
  leaves = jax.tree.leaves(base_state)
  meshes = {x.sharding.mesh for x in leaves
            if isinstance(x.sharding, jax.sharding.NamedSharding)}
  if (len(meshes) > 1 or (meshes and jax.process_count() > 1)
      or not all(jnp.issubdtype(x.dtype, jnp.number) for x in leaves)):
    # Weights on several meshes or processes, or PRNG key state (no zeros
    # of its dtype): qwix's own eager pass.
    return wrap(model)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

  def lora_params():
    # The LoRA draws depend on the shapes and the seed, not on the weights:
    # the pass runs on zeros built inside the program (so no weight is an
    # input, copied or committed to a device by it, and the forward itself
    # is dead code), and a pure jax.jit (nnx.jit would write into `model`).
    zeros = [jnp.zeros(x.shape, x.dtype) for x in shapes]
    m = nnx.merge(base_graphdef, jax.tree.unflatten(
        jax.tree.structure(base_state), zeros))
    return nnx.state(wrap(m), nnx.LoRAParam)

  lora_params = jax.jit(lora_params)()
  if meshes:  # placed by their partition specs on the model's mesh, as
    # qwix places its eager draws when the weights it wraps are sharded.
    (mesh,) = meshes
    for _, variable in nnx.to_flat_state(lora_params):
      spec = jax.sharding.PartitionSpec(*(variable.get_metadata().get(
          "out_sharding") or ()))
      variable.set_value(jax.device_put(
          variable.get_value(), jax.sharding.NamedSharding(mesh, spec)))
  graphdef, state = nnx.split(nnx.eval_shape(wrap, model))
  lora = nnx.merge(graphdef, state)
  nnx.update(lora, base_state)
  nnx.update(lora, lora_params)
  if any(isinstance(leaf, jax.ShapeDtypeStruct)
         for leaf in jax.tree.leaves(nnx.state(lora))):
    return wrap(model)  # qwix made state other than LoRA parameters
  return lora


__all__ = [
    "apply_lora",
    "build_model",
    "check_model_fits_mesh",
    "lora_enabled",
    "model_vocab_size",
    "shard_model",
    "traced_lora",
]


def attention_config_from(model_cfg,
                          key: str = "model.attention"
                          ) -> config_lib.AttentionConfig:
  """`model.attention` (`auto|dense|splash`, default dense), its tile and
  its mask mode (`model.attention_mask_mode`, `auto|static|dynamic`).

  `key`: the recipe key an error names (`rollout.attention` for the
  scorers' section).

  Raises:
    UsageError: a bad value, named by its recipe key.
  """
  try:
    return config_lib.AttentionConfig(
        str(model_cfg.get("attention", "dense")),
        tile=model_cfg.get("attention_tile"),
        mask_mode=str(model_cfg.get("attention_mask_mode", "auto")))
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"{key}: {e}") from None


def mesh_for_attention(mesh, attention: config_lib.AttentionConfig):
  """The job's mesh; a one-device mesh where Splash may run without one.

  Tunix's flash branch reads the legacy `with mesh:` context, so a job that
  may train with Splash (`splash`, or `auto` on a TPU) gets one.
  """
  may_splash = attention.implementation == "splash" or (
      attention.implementation == "auto" and jax.default_backend() == "tpu")
  if mesh is None and may_splash:
    return distributed.build_mesh({"fsdp": 1})
  return mesh


def training_attention(attention: config_lib.AttentionConfig, model,
                       length: int) -> config_lib.AttentionConfig | None:
  """The trainer's `attention`: the config where it runs Splash, else None.

  Args:
    attention: The recipe's choice.
    model: The model to train.
    length: Slots the attention spans (twice `seq_len` for two_stream).

  Raises:
    UsageError: `splash` where it cannot run, in one line.
  """
  try:
    splash = attention.uses_splash(length, jax.default_backend(),
                                   flash.supports_splash(model))
  except ValueError as e:
    raise errors.UsageError(f"model.attention: {e}") from None
  return attention if splash else None


def training_mask_mode(attention: config_lib.AttentionConfig | None,
                       packing: str, cp_size: int
                       ) -> config_lib.AttentionConfig | None:
  """The trainer's single-stream Splash mask, from the data's layout.

  `auto` (the recipe left it) becomes `static` where every batch has the
  static mask's layout (`packing: none` or `block_aligned`, rows in
  logical order), else `dynamic`: never the `lax.cond` of both, whose
  gradient keeps both variants' activations (`config.AttentionConfig`).

  Raises:
    UsageError: `static` on a layout that breaks it.
  """
  if attention is None:
    return None
  aligned = packing != "unaligned" and cp_size == 1
  if attention.mask_mode == "static" and not aligned:
    raise errors.UsageError(
        "model.attention_mask_mode: static needs documents at block"
        f" multiples in logical order; data.packing={packing} and"
        f" data.cp_size={cp_size} break it; use dynamic or auto")
  if attention.mask_mode != "auto":
    return attention
  return dataclasses.replace(attention,
                             mask_mode="static" if aligned else "dynamic")


def remat_policy_from(model_cfg) -> str:
  """`model.remat` (`none|block|decoder`, default none), checked.

  Raises:
    UsageError: an unknown policy, named by its recipe key.
  """
  policy = str(model_cfg.get("remat", "none"))
  try:
    return remat_lib.check_policy(policy)
  except ValueError as e:
    raise errors.UsageError(f"model.{e}") from None


def head_chunk_from(model_cfg) -> int | None:
  """`model.head_chunk` (tokens per output-head chunk; null/absent: off).

  Raises:
    UsageError: not a positive int, named by its recipe key.
  """
  value = model_cfg.get("head_chunk", None)
  try:
    return loss_lib.check_head_chunk(value)
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"model.{e}") from None
