"""Global arrays over a mesh that spans processes: batches, gathers, row calls.

Every array of a many-process job spans the devices of all processes. The
mesh itself (`distributed.build_mesh`) and the runtime live in
`distributed`; this module moves data onto and off such a mesh:

* `process_rows` / `global_batch` / `GlobalBatches`: each process builds
  only the rows of a batch its devices hold and the global `jax.Array`s are
  assembled with `jax.make_array_from_process_local_data`, so the global
  batch is, example for example, the one a single process would build.
* `gather` brings a global array back to NumPy on every process;
  `globalize` is its inverse for a tree every process holds whole.
* `call_sharded` runs a function of host rows with the rows sharded over
  the mesh's fsdp axis and its outputs gathered (padding with `pad_rows`
  to `row_multiple`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import jax
from jax.experimental import multihost_utils
import numpy as np

# Axes of the batch dimensions: [B] over fsdp, [B, L] also over sp (context
# parallelism: every sp shard holds a slice of the sequence).
BATCH_AXIS = "fsdp"
SEQUENCE_AXIS = "sp"


def batch_sharding(
    mesh: jax.sharding.Mesh, ndim: int
) -> jax.sharding.NamedSharding:
  """[B] over fsdp; [B, L, ...] over (fsdp, sp)."""
  spec = (BATCH_AXIS,) if ndim == 1 else (BATCH_AXIS, SEQUENCE_AXIS)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def process_rows(mesh: jax.sharding.Mesh, batch_size: int) -> tuple[int, int]:
  """[lo, hi): the rows of a global batch this process's devices hold.

  Raises:
    ValueError: `batch_size` is not a multiple of mesh.fsdp.
  """
  fsdp = int(mesh.shape[BATCH_AXIS])
  if batch_size % fsdp:
    raise ValueError(
        f"batch size {batch_size} must be a multiple of mesh.fsdp={fsdp}"
    )
  index_map = batch_sharding(mesh, 1).addressable_devices_indices_map((
      batch_size,
  ))
  starts = sorted({s[0].start or 0 for s in index_map.values()})
  stops = sorted({
      batch_size if s[0].stop is None else s[0].stop for s in index_map.values()
  })
  lo, hi = starts[0], stops[-1]
  rows = sum(b - a for a, b in zip(starts, stops))
  if rows != hi - lo:
    raise ValueError(
        f"process {jax.process_index()} holds non-contiguous batch rows"
        f" {list(zip(starts, stops))}; reorder the mesh devices"
    )
  return lo, hi


def global_batch(
    local: Mapping[str, np.ndarray],
    mesh: jax.sharding.Mesh,
    batch_size: int,
) -> dict[str, jax.Array]:
  """Global arrays [batch_size, ...] from this process's rows.

  Args:
    local: Fields [hi - lo, ...] for the rows `process_rows` names, each
      with its full sequence (sp shards are sliced from it).
    mesh: The global mesh.
    batch_size: The global batch size B.

  Returns:
    The same fields as global `jax.Array`s sharded by `batch_sharding`.
  """
  lo, hi = process_rows(mesh, batch_size)
  out = {}
  for name, value in local.items():
    value = np.asarray(value)
    if value.shape[0] != hi - lo:
      raise ValueError(
          f"field {name!r} has {value.shape[0]} rows, this process holds"
          f" rows [{lo}, {hi}) of {batch_size}"
      )
    out[name] = jax.make_array_from_process_local_data(
        batch_sharding(mesh, value.ndim),
        value,
        (batch_size,) + value.shape[1:],
    )
  return out


class GlobalBatches:
  """Re-iterable global batches from re-iterable process-local ones.

  Each process's `local_batches` yield only the rows `process_rows` names
  (or whole batches, sliced here when `sliced=True`).
  """

  def __init__(
      self,
      local_batches: Iterable[Mapping[str, np.ndarray]],
      mesh: jax.sharding.Mesh,
      batch_size: int,
      *,
      sliced: bool = False,
  ):
    self.local_batches = local_batches
    self.mesh = mesh
    self.batch_size = batch_size
    self.rows = process_rows(mesh, batch_size)
    self.sliced = sliced

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    lo, hi = self.rows
    for batch in self.local_batches:
      if self.sliced:
        batch = {k: np.asarray(v)[lo:hi] for k, v in batch.items()}
      yield global_batch(batch, self.mesh, self.batch_size)

  def __len__(self) -> int:
    return len(self.local_batches)  # pytype: disable=wrong-arg-types


def gather(x: Any) -> np.ndarray:
  """A (possibly global) array as NumPy, the whole array on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


# Row-sharded calls: every process holds the same host batch.


def shards_rows(mesh: jax.sharding.Mesh | None) -> bool:
  """Whether `call_sharded` places rows over the mesh (more than one device)."""
  return mesh is not None and mesh.devices.size > 1


def row_multiple(mesh: jax.sharding.Mesh | None) -> int:
  """The row count `call_sharded` pads a batch to a multiple of (mesh.fsdp)."""
  return int(mesh.shape[BATCH_AXIS]) if shards_rows(mesh) else 1


def pad_rows(arrays, multiple: int) -> list[np.ndarray]:
  """Host arrays [B, ...] padded to a multiple of rows with the last row.

  Args:
    arrays: Arrays with the same leading size B >= 1.
    multiple: >= 1.

  Returns:
    NumPy copies with ceil(B / multiple) * multiple rows; rows >= B repeat
    row B - 1 (callers that sum over rows zero their weights).
  """
  arrays = [np.asarray(a) for a in arrays]
  num = arrays[0].shape[0]
  size = -(-num // multiple) * multiple
  index = np.minimum(np.arange(size), num - 1)
  return [a[index] for a in arrays]


def call_sharded(fn, mesh: jax.sharding.Mesh | None, *arrays):
  """`fn(*arrays)` with the rows of `arrays` sharded over the mesh's fsdp axis.

  For jobs in which every process holds the same host batch (the rl and opd
  rollouts and scores): the B rows are padded to a multiple of mesh.fsdp with
  copies of the last row, each process places only the rows its devices hold
  (`global_batch`), and every output is gathered back, so every process gets
  the same NumPy results. Without a mesh (or on one device) this is
  `fn(*arrays)`.

  Args:
    fn: A function of B-row arrays (e.g. a jitted program closing over a
      model on `mesh`) returning a pytree of arrays.
    mesh: The global mesh or None.
    *arrays: Host arrays [B, ...] (the same on every process).

  Returns:
    `fn`'s outputs; with a mesh, as NumPy, arrays of leading size B cut back
    to B rows (outputs of other shapes, e.g. scalars, gathered whole).
  """
  if not shards_rows(mesh):
    return fn(*arrays)
  arrays = [np.asarray(a) for a in arrays]
  num = arrays[0].shape[0]
  if num == 0 or any(a.ndim == 0 or a.shape[0] != num for a in arrays):
    raise ValueError(
        "call_sharded needs arrays with the same number of rows >= 1, got"
        f" shapes {[a.shape for a in arrays]}"
    )
  arrays = pad_rows(arrays, row_multiple(mesh))
  size = arrays[0].shape[0]
  lo, hi = process_rows(mesh, size)
  placed = global_batch(
      {str(i): a[lo:hi] for i, a in enumerate(arrays)}, mesh, size
  )
  out = fn(*(placed[str(i)] for i in range(len(arrays))))

  def cut(x):
    x = gather(x)
    return x[:num] if x.ndim and x.shape[0] == size else x

  return jax.tree.map(cut, out)


def globalize(tree: Any, mesh: jax.sharding.Mesh | None, axis: str = "fsdp"):
  """Host-batch leaves as global arrays, rows over `axis` where they divide.

  The inverse of `gather` for a tree every process holds whole (e.g. an RL
  training example): leaf x becomes the global array of value x, sharded on
  its leading dimension over `axis` when that divides it, else replicated.
  Leaves already spanning processes, and non-array leaves, are kept.
  """
  if mesh is None:
    return tree
  size = int(mesh.shape[axis])
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    if not isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return x
    x = np.asarray(x)
    rows_divide = x.ndim >= 1 and x.shape[0] % size == 0
    return jax.make_array_from_process_local_data(
        sharded if rows_divide else replicated, x, x.shape
    )

  return jax.tree.map(place, tree)

__all__ = [
    "BATCH_AXIS",
    "GlobalBatches",
    "SEQUENCE_AXIS",
    "batch_sharding",
    "call_sharded",
    "gather",
    "global_batch",
    "globalize",
    "pad_rows",
    "process_rows",
    "row_multiple",
    "shards_rows",
]
