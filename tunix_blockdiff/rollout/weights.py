"""Loading new parameters into a rollout model (Tunix's `update_params`).

Tunix's learners push the actor's updated parameters into the rollout
engine after each step; when the rollout model lives on other devices or in
another dtype, they are resharded and cast to it first.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from flax import nnx
import jax
import jaxtyping
from tunix.rl import reshard


def update_params(
    model: nnx.Module,
    params: jaxtyping.PyTree,
    filter_types: Optional[Tuple[Any, ...]] = None,
) -> None:
  """Loads `params` into `model` in place.

  Args:
    model: The rollout model.
    params: An `nnx.State` (or subset) of the actor's parameters.
    filter_types: The variable types `params` holds; when given, `params`
      is resharded onto `model`'s shardings (Tunix's `reshard_pytree` for
      named shardings, else leaf by leaf) and cast to its dtypes first.
  """
  if filter_types is not None:
    target = nnx.state(model, *filter_types)
    shardings = [
        getattr(x, "sharding", None) for x in jax.tree.leaves(target)
    ]
    if all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
      params = reshard.reshard_pytree(params, target)
    else:
      # Tunix's resharding needs named shardings; plain placements move
      # leaf by leaf.
      params = jax.tree.map(
          lambda new, old: jax.device_put(new, old.sharding), params, target
      )
    params = jax.tree.map(
        lambda new, old: new.astype(old.dtype)
        if hasattr(new, "astype") and new.dtype != old.dtype
        else new,
        params,
        target,
    )
  nnx.update(model, params)


__all__ = ["update_params"]
