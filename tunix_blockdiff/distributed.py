"""Many processes: JAX's distributed runtime, the global mesh, global batches.

JAX runs one process per host (or, for tests and multi-GPU hosts, several
per machine); every array of a job then spans the devices of all processes.
This module holds what the jobs need for that:

* `initialize(distributed_cfg)` starts `jax.distributed` from a recipe's
  `distributed` section (gloo collectives on CPU); `None` is one process.
* `build_mesh(mesh_cfg)` lays the recipe's `{fsdp, sp, tp}` axes over the
  devices of all processes.
* `process_rows` / `global_batch` / `GlobalBatches`: each process builds
  only the rows of a batch its devices hold and the global `jax.Array`s are
  assembled with `jax.make_array_from_process_local_data`, so the global
  batch is, example for example, the one a single process would build.
* `gather` brings a global array back to NumPy on every process;
  `is_main_process` says who writes summaries, figures and logs.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Mapping

import jax
from jax.experimental import multihost_utils
import numpy as np

MESH_AXES = ("fsdp", "sp", "tp")
# Axes of the batch dimensions: [B] over fsdp, [B, L] also over sp (context
# parallelism: every sp shard holds a slice of the sequence).
BATCH_AXIS = "fsdp"
SEQUENCE_AXIS = "sp"
DISTRIBUTED_KEYS = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "initialization_timeout",
    "heartbeat_timeout",
)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
  if cfg is None:
    return default
  value = cfg.get(key, default) if hasattr(cfg, "get") else default
  return default if value is None else value


def initialize(distributed_cfg: Mapping[str, Any] | None) -> bool:
  """Starts JAX's distributed runtime when a recipe asks for it.

  Call before anything touches a JAX backend. On CPU the cross-process
  collectives are gloo's (the setting is ignored by TPU and GPU backends).

  Args:
    distributed_cfg: The recipe's `distributed` section or None (one
      process). Keys: `coordinator_address` ("host:port"), `num_processes`,
      `process_id` (each null: auto-detected, as `jax.distributed.initialize`
      does on Cloud TPU, SLURM, ...), `initialization_timeout` (seconds to
      wait for every process to connect, default 300) and
      `heartbeat_timeout` (seconds after which a silent peer is declared
      dead and the job stops, default 60).

  Returns:
    True when the runtime was started (or already running), False for one
    process.

  Raises:
    ValueError: An unknown key or a value out of range.
  """
  if distributed_cfg is None:
    return False
  unknown = sorted(set(distributed_cfg) - set(DISTRIBUTED_KEYS))
  if unknown:
    raise ValueError(
        f"unknown distributed keys {unknown}; known: {list(DISTRIBUTED_KEYS)}"
    )
  if jax.distributed.is_initialized():
    return True
  num_processes = _get(distributed_cfg, "num_processes")
  process_id = _get(distributed_cfg, "process_id")
  if num_processes is not None and int(num_processes) < 1:
    raise ValueError(
        f"distributed.num_processes must be >= 1, got {num_processes}"
    )
  if process_id is not None and num_processes is not None:
    if not 0 <= int(process_id) < int(num_processes):
      raise ValueError(
          "distributed.process_id must be in [0, num_processes ="
          f" {num_processes}), got {process_id}"
      )
  timeouts = {}
  for key, default in (
      ("initialization_timeout", 300),
      ("heartbeat_timeout", 60),
  ):
    timeouts[key] = int(_get(distributed_cfg, key, default))
    if timeouts[key] < 1:
      raise ValueError(f"distributed.{key} must be >= 1 s, got {timeouts[key]}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
        coordinator_address=_get(distributed_cfg, "coordinator_address"),
        num_processes=None if num_processes is None else int(num_processes),
        process_id=None if process_id is None else int(process_id),
        initialization_timeout=timeouts["initialization_timeout"],
        heartbeat_timeout_seconds=timeouts["heartbeat_timeout"],
    )
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise RuntimeError(
        "jax.distributed.initialize failed (coordinator"
        f" {_get(distributed_cfg, 'coordinator_address', 'auto-detected')},"
        f" process {'auto' if process_id is None else process_id} of"
        f" {'auto' if num_processes is None else num_processes}); every"
        " process must run"
        " the same command with its own process_id and reach the coordinator"
        f" within {timeouts['initialization_timeout']} s: {e}"
    ) from e
  return True


def is_main_process() -> bool:
  """True on process 0: the one that writes summaries, figures and logs."""
  return jax.process_index() == 0


# The global mesh.


def mesh_shape(mesh_cfg: Mapping[str, Any]) -> dict[str, int]:
  """{fsdp, sp, tp} sizes of a recipe's `mesh` section (missing keys: 1)."""
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; known: {list(MESH_AXES)}")
  shape = {}
  for axis in MESH_AXES:
    value = mesh_cfg.get(axis, 1)
    value = 1 if value is None else value
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
      raise ValueError(f"mesh.{axis} must be an int >= 1, got {value!r}")
    shape[axis] = int(value)
  return shape


def build_mesh(mesh_cfg: Mapping[str, Any] | None) -> jax.sharding.Mesh | None:
  """The `(fsdp, sp, tp)` mesh over the devices of every process.

  Devices are ordered by (process, id) and laid out with `sp` outermost,
  then `fsdp`, then `tp` (innermost): tensor parallelism stays within a
  process's devices, and a context-parallel `sp` axis spans processes when
  there are several. With `sp = 1` this is the plain (fsdp, tp) layout.

  Args:
    mesh_cfg: `{fsdp, sp, tp}` (missing: 1) or None: no mesh with one
      process, `fsdp` over every device with several.

  Returns:
    A mesh with axes ("fsdp", "sp", "tp") over the first fsdp * sp * tp
    devices (all processes' devices when it uses all of them), or None.
  """
  if mesh_cfg is None:
    if jax.process_count() == 1:
      return None
    mesh_cfg = {"fsdp": jax.device_count()}
  shape = mesh_shape(mesh_cfg)
  fsdp, sp, tp = shape["fsdp"], shape["sp"], shape["tp"]
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  size = fsdp * sp * tp
  if size > len(devices):
    raise ValueError(
        f"mesh needs fsdp * sp * tp = {size} devices, {len(devices)} available"
        f" over {jax.process_count()} process(es)"
    )
  if jax.process_count() > 1 and size != len(devices):
    raise ValueError(
        f"with {jax.process_count()} processes the mesh must use all"
        f" {len(devices)} devices, got fsdp * sp * tp = {size}"
    )
  grid = np.asarray(devices[:size], dtype=object).reshape(sp, fsdp, tp)
  return jax.sharding.Mesh(
      grid.transpose(1, 0, 2),
      MESH_AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * 3,
  )


def check_cp_size(mesh: jax.sharding.Mesh | None, cp_size: int) -> int:
  """`data.cp_size` follows `mesh.sp`: equal, or 1 meaning "use mesh.sp"."""
  sp = 1 if mesh is None else int(mesh.shape[SEQUENCE_AXIS])
  if cp_size not in (1, sp):
    raise ValueError(
        f"data.cp_size={cp_size} must equal mesh.sp={sp} (or be 1: follow"
        " mesh.sp); the context-parallel order is the sp axis's layout"
    )
  return sp if sp > 1 else cp_size


# Global batches.


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


def local_device_flags(num_devices: int) -> str:
  """XLA_FLAGS (the current ones plus a CPU device count) for a child process."""
  flags = [
      f
      for f in os.environ.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
  ]
  flags.append(f"--xla_force_host_platform_device_count={int(num_devices)}")
  return " ".join(flags)


__all__ = [
    "DISTRIBUTED_KEYS",
    "GlobalBatches",
    "MESH_AXES",
    "batch_sharding",
    "build_mesh",
    "call_sharded",
    "check_cp_size",
    "gather",
    "global_batch",
    "globalize",
    "initialize",
    "is_main_process",
    "local_device_flags",
    "mesh_shape",
    "process_rows",
    "shards_rows",
]
