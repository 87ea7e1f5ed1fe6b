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
  for module in modules:
    if module is None or any(s is not None for s in named_shardings(module)):
      continue
    nnx.update(module, jax.tree.map(
        lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x,
        nnx.state(module)))


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
