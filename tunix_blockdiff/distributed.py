"""Many processes: JAX's distributed runtime and the global mesh.

JAX runs one process per host (or, for tests and multi-GPU hosts, several
per machine); every array of a job then spans the devices of all processes.
This module holds what the jobs need for that:

* `initialize(distributed_cfg)` starts `jax.distributed` from a recipe's
  `distributed` section (gloo collectives on CPU); `None` is one process.
* `build_mesh(mesh_cfg)` lays the recipe's `{fsdp, sp, tp}` axes over the
  devices of all processes.
* `is_main_process` says who writes summaries, figures and logs.

Moving data onto and off that mesh (global batches, `gather`,
`call_sharded`, `globalize`) lives in `global_arrays`; its names are
re-exported here, where the jobs have always imported them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

# The global-array helpers, at the names the jobs import them by.
from tunix_blockdiff.global_arrays import BATCH_AXIS
from tunix_blockdiff.global_arrays import batch_sharding
from tunix_blockdiff.global_arrays import call_sharded
from tunix_blockdiff.global_arrays import gather
from tunix_blockdiff.global_arrays import global_batch
from tunix_blockdiff.global_arrays import GlobalBatches
from tunix_blockdiff.global_arrays import globalize
from tunix_blockdiff.global_arrays import pad_rows
from tunix_blockdiff.global_arrays import process_rows
from tunix_blockdiff.global_arrays import row_multiple
from tunix_blockdiff.global_arrays import SEQUENCE_AXIS
from tunix_blockdiff.global_arrays import shards_rows

MESH_AXES = ("fsdp", "sp", "tp")
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


__all__ = [
    "BATCH_AXIS",
    "batch_sharding",
    "build_mesh",
    "call_sharded",
    "check_cp_size",
    "DISTRIBUTED_KEYS",
    "gather",
    "global_batch",
    "GlobalBatches",
    "globalize",
    "initialize",
    "is_main_process",
    "MESH_AXES",
    "mesh_shape",
    "pad_rows",
    "process_rows",
    "row_multiple",
    "SEQUENCE_AXIS",
    "shards_rows",
]
