"""Train steps whose updated states keep the layouts they came with.

Inside `jax.jit`, XLA picks the output sharding of every updated array. For
parameters and optimizer states that is a new layout as often as not (a
replicated norm scale can come back split over fsdp), and every program
that reads them next (the next train step, a sampler, a scorer) compiles
again for it. `keeping_shardings` wraps a train step so that each array of
its modules' states leaves with the `NamedSharding` it had when the step was
built. Without a mesh, `commit_to_one_device` gives a fresh state the
placement a checkpoint restore gives (committed arrays), so a fresh and a
resumed run compile the same programs.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
from jax.interpreters import pxla
import numpy as np


def named_shardings(module: nnx.Module | None) -> list[Any] | None:
  """The `NamedSharding` of each array leaf of `module`'s state.

  Args:
    module: Any nnx module, or None.

  Returns:
    One entry per leaf of `jax.tree.leaves(nnx.state(module))`: its
    `NamedSharding`, or None where it has none (one device, no mesh); None
    for no module.
  """
  if module is None:
    return None
  return [
      leaf.sharding
      if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
      else None
      for leaf in jax.tree.leaves(nnx.state(module))
  ]


def commit_to_one_device(*modules: nnx.Module | None) -> None:
  """Commits the arrays of each unsharded module to the first local device.

  A checkpoint restore returns committed arrays and a freshly built or
  initialised state has uncommitted ones; JAX compiles a different program
  for each (committed arguments carry a sharding annotation), and a step
  fed both kinds compiles again once its outputs come back committed.
  Committing every unsharded state up front gives a fresh run, a resumed
  run and `generate` on either the same programs, so the persistent
  compilation cache serves the later ones. Modules with a `NamedSharding`
  leaf (placed on a mesh) and non-array leaves are left alone; arrays
  already on the device are not copied.

  Args:
    *modules: nnx modules (or None), updated in place.
  """
  device = jax.local_devices()[0]
  for module in _unplaced(modules):
    nnx.update(module, jax.tree.map(
        lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x,
        nnx.state(module)))


def _unplaced(modules) -> list[nnx.Module]:
  """The modules that are not None and have no leaf on a mesh."""
  return [
      m for m in modules
      if m is not None and not any(s is not None for s in named_shardings(m))
  ]


def active_mesh() -> jax.sharding.Mesh | None:
  """The mesh of the legacy `with mesh:` context or of `jax.set_mesh`.

  Returns:
    That mesh, or None when none is active or it has a single device.
  """
  mesh = pxla.thread_resources.env.physical_mesh
  if mesh.empty:
    mesh = jax.sharding.get_mesh()
  if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty or mesh.size == 1:
    return None
  return mesh


def mesh_spec(
    spec: jax.sharding.PartitionSpec | None, mesh: jax.sharding.Mesh
) -> jax.sharding.PartitionSpec:
  """`spec` without the axis names `mesh` lacks (None: replicated)."""
  if spec is None:
    return jax.sharding.PartitionSpec()
  kept = []
  for axes in spec:
    names = axes if isinstance(axes, tuple) else (axes,)
    names = tuple(n for n in names if n is not None and n in mesh.shape)
    kept.append(names if len(names) > 1 else (names[0] if names else None))
  return jax.sharding.PartitionSpec(*kept)


def _spec_leaves(state) -> list[Any]:
  specs = nnx.get_partition_spec(state)
  return jax.tree_util.tree_leaves(
      specs,
      is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec),
  )


def check_fits_mesh(module: nnx.Module, mesh: jax.sharding.Mesh) -> None:
  """Every array dimension divides over the mesh axes it is sharded on.

  Tunix's partition specs shard heads, KV heads, the vocabulary and the MLP
  width over `tp` and the model width over `fsdp`; a size that does not
  divide fails here, naming the parameter, instead of inside XLA.

  Raises:
    ValueError: A dimension is not a multiple of its mesh axes.
  """
  state = nnx.state(module)
  leaves = jax.tree_util.tree_leaves_with_path(state)
  for (path, value), spec in zip(leaves, _spec_leaves(state), strict=True):
    if not isinstance(spec, jax.sharding.PartitionSpec):
      continue
    for dim, axes in enumerate(mesh_spec(spec, mesh)):
      names = axes if isinstance(axes, tuple) else (axes,)
      names = [n for n in names if n is not None]
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


def place_on_mesh(module: nnx.Module, mesh: jax.sharding.Mesh) -> None:
  """Places `module`'s arrays on `mesh` by their own partition specs.

  Each process builds its own shards from its host copy (the same on every
  process: same seed, same checkpoint), so this also works where the mesh
  spans devices of other processes. Non-array leaves are left alone.

  Raises:
    ValueError: A dimension does not divide over its mesh axes
      (`check_fits_mesh`).
  """
  check_fits_mesh(module, mesh)
  state = nnx.state(module)
  leaves, treedef = jax.tree.flatten(state)

  def place(x, spec):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    if not isinstance(x, (jax.Array, np.ndarray)):
      return x
    sharding = jax.sharding.NamedSharding(mesh, mesh_spec(spec, mesh))
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index]
    )

  nnx.update(module, jax.tree.unflatten(treedef, [
      place(x, spec)
      for x, spec in zip(leaves, _spec_leaves(state), strict=True)
  ]))


def place_unsharded(*modules: nnx.Module | None) -> None:
  """Places each module that is on no mesh where the next step runs.

  Under an active mesh of several devices (`active_mesh`), such a module
  goes onto that mesh by its partition specs (`place_on_mesh`); a trainer
  created under `with mesh:` on a model built outside it then trains on the
  mesh. Otherwise it is committed to the first device
  (`commit_to_one_device`).

  Args:
    *modules: nnx modules (or None), updated in place.

  Raises:
    ValueError: A module cannot be placed on the active mesh; the message
      says what to do.
  """
  mesh = active_mesh()
  if mesh is None:
    commit_to_one_device(*modules)
    return
  for module in _unplaced(modules):
    try:
      place_on_mesh(module, mesh)
    except ValueError as e:
      raise ValueError(
          f"cannot place {type(module).__name__} on the active mesh"
          f" {dict(mesh.shape)}: {e}; or place it yourself before building"
          " the trainer (e.g. tunix.rl.reshard.reshard_model_to_mesh)"
      ) from None


def constrain(module: nnx.Module | None, shardings: list[Any] | None):
  """Pins each array of `module`'s state to its entry of `shardings`.

  Called inside a jitted function on the traced module; leaves whose entry
  is None are left alone (nothing is done when all are).
  """
  if module is None or not any(s is not None for s in shardings):
    return
  leaves, treedef = jax.tree.flatten(nnx.state(module))
  nnx.update(module, jax.tree.unflatten(treedef, [
      x if s is None else jax.lax.with_sharding_constraint(x, s)
      for x, s in zip(leaves, shardings, strict=True)
  ]))


def keeping_shardings(train_step, model, optimizer, grad_sums):
  """`train_step` whose updated states keep the shardings they have now.

  Args:
    train_step: `(model, optimizer, grad_sums, inputs) -> outputs`, updating
      its modules in place (what `nnx.jit` then compiles).
    model, optimizer, grad_sums: The modules as they are placed now (any may
      be None); their current shardings are the ones kept.

  Returns:
    The same function with each updated state pinned to those shardings.
  """
  pinned = [named_shardings(m) for m in (model, optimizer, grad_sums)]

  def step(model, optimizer, grad_sums, inputs):
    out = train_step(model, optimizer, grad_sums, inputs)
    for module, shardings in zip((model, optimizer, grad_sums), pinned):
      constrain(module, shardings)
    return out

  return step
