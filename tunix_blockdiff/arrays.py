"""Host values to JAX arrays without compiling a program for each shape.

In JAX 0.10, `jnp.asarray` and `jnp.array` of a NumPy array with no dtype
bind `lax.stage`, which outside a trace compiles and runs an identity
program (`jit(stage)`) for every new shape and dtype; given a dtype that
differs from the array's (int64 where x64 is off), it compiles a
conversion instead. On a TPU each is an XLA compilation before the real
work. Given the array's own dtype, the call copies it to the device
directly: `asarray` casts on the host, then gives it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def asarray(value: Any, dtype: Any = None) -> jax.Array:
  """`jnp.asarray(value, dtype)` that copies a NumPy array without a program.

  Args:
    value: A NumPy array, or anything else `jnp.asarray` takes (JAX arrays
      and tracers go to `jnp.asarray` as before).
    dtype: The result's dtype (None: the array's), canonicalised as
      `jnp.asarray` does (64-bit to 32-bit unless x64 is enabled).

  Returns:
    The same array as `jnp.asarray(value, dtype)`: dtype, shape, values,
    device.
  """
  if isinstance(value, np.ndarray) and not isinstance(value, np.ma.MaskedArray):
    dtype = jax.dtypes.canonicalize_dtype(value.dtype if dtype is None
                                          else dtype)
    return jnp.asarray(value.astype(dtype, copy=False), dtype=dtype)
  return jnp.asarray(value, dtype)
