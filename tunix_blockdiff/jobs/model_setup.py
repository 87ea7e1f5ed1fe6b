"""The model a job's recipe names: built, with LoRA, placed on the mesh.

`build_model` builds a recipe's `model` section (`models.build_model`),
`apply_lora` wraps it in qwix LoRA when the recipe's `lora` section asks,
and `shard_model` places its parameters by the model's own partition specs
(Tunix's rules), after `check_model_fits_mesh` has named any parameter that
does not divide over its mesh axes. `jobs.common` re-exports them.
"""

from __future__ import annotations

from flax import nnx
import jax
import numpy as np

from tunix_blockdiff import layouts
from tunix_blockdiff import models as models_lib


def check_model_fits_mesh(model, mesh: jax.sharding.Mesh) -> None:
  """Every parameter dimension divides over the mesh axes it is sharded on.

  Tunix's partition specs shard heads, KV heads, the vocabulary and the MLP
  width over `tp` and the model width over `fsdp`; a size that does not
  divide fails here, naming the parameter, instead of inside XLA.

  Raises:
    ValueError: A parameter dimension is not a multiple of its mesh axes.
  """
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  leaves = jax.tree_util.tree_leaves_with_path(state)
  spec_leaves = jax.tree_util.tree_leaves(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )
  for (path, value), spec in zip(leaves, spec_leaves):
    if not isinstance(spec, jax.sharding.PartitionSpec):
      continue
    for dim, axes in enumerate(spec):
      names = axes if isinstance(axes, tuple) else (axes,)
      names = [n for n in names if n is not None and n in mesh.shape]
      size = int(np.prod([mesh.shape[n] for n in names], dtype=np.int64))
      if size > 1 and value.shape[dim] % size:
        axes_text = " * ".join(f"mesh.{n}={mesh.shape[n]}" for n in names)
        raise ValueError(
            f"parameter {jax.tree_util.keystr(path)} of shape"
            f" {tuple(value.shape)} is sharded over {axes_text} on dimension"
            f" {dim} (size {value.shape[dim]}), which is not a multiple of"
            f" {size}: pick mesh sizes that divide the model's heads, KV"
            " heads, widths and vocabulary"
        )


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
  graphdef, state = nnx.split(model)

  def place(x, spec):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    host = np.asarray(x)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])

  return nnx.merge(graphdef, jax.tree.map(place, state,
                                          nnx.get_partition_spec(state)))


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


__all__ = [
    "apply_lora",
    "build_model",
    "check_model_fits_mesh",
    "lora_enabled",
    "model_vocab_size",
    "shard_model",
]
