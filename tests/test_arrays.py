"""`arrays.asarray`: `jnp.asarray`'s result, without a program per shape."""

import itertools

import compilations
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import arrays

# A leading size no other example has, so that a program per shape would
# have to be compiled (JAX caches one per shape in the process).
_FRESH_SIZES = itertools.count(20)
DTYPES = st.sampled_from([np.int64, np.int32, np.int8, np.uint8, np.uint32,
                          np.bool_, np.float64, np.float32, np.float16])


@given(data=st.data(), dtype=DTYPES,
       shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
def test_a_numpy_array_gives_jnp_asarrays_array_without_compiling(
    data, dtype, shape):
  value = data.draw(hnp.arrays(np.int8, shape, elements=st.integers(0, 100)))
  value = np.broadcast_to(value, (next(_FRESH_SIZES),) + shape).astype(dtype)
  with compilations.counting() as events:
    got = arrays.asarray(value)
  assert not events
  want = jnp.asarray(value)
  assert (got.dtype, got.shape, got.weak_type) == (
      want.dtype, want.shape, want.weak_type)
  assert got.sharding == want.sharding
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_dtype_is_cast_on_the_host_and_other_values_go_to_jnp_asarray():
  value = np.linspace(0, 1, 6 * 13).reshape(6, 13)  # float64
  with compilations.counting() as events:
    got = arrays.asarray(value, jnp.float32)
    ints = arrays.asarray(np.arange(13 * 3).reshape(13, 3))  # int64
  assert not events
  assert got.dtype == jnp.float32 and ints.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), value.astype(np.float32))
  device_array = jnp.arange(4)
  assert arrays.asarray(device_array) is device_array
  assert arrays.asarray(3).weak_type == jnp.asarray(3).weak_type
  traced = jax.jit(lambda x: arrays.asarray(x, jnp.float32) * 2)(device_array)
  np.testing.assert_array_equal(np.asarray(traced), [0, 2, 4, 6])
