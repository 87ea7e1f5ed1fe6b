"""`rollout.kv_cache.row_merge`: each row's window written where kept."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff.rollout import kv_cache


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_row_merge_writes_each_rows_kept_slots_only(data):
  rng = np.random.default_rng(data.draw(st.integers(0, 10_000)))
  batch = data.draw(st.integers(1, 4))
  width = data.draw(st.integers(1, 5))
  size = width * data.draw(st.integers(1, 4)) + data.draw(st.integers(0, 3))
  x = rng.integers(0, 100, (batch, size)).astype(np.int32)
  update = rng.integers(100, 200, (batch, width)).astype(np.int32)
  keep = rng.random((batch, width)) < 0.5
  start = rng.integers(0, size - width + 1, batch).astype(np.int32)
  want = x.copy()
  for b in range(batch):
    for i in range(width):
      if keep[b, i]:
        want[b, start[b] + i] = update[b, i]
  got = kv_cache.row_merge(jnp.asarray(x), jnp.asarray(update),
                           jnp.asarray(keep), jnp.asarray(start))
  np.testing.assert_array_equal(np.asarray(got), want)
