"""Global arrays over a mesh: row-sharded calls and host trees placed on it.

On one process with 8 simulated devices; the many-process runs are in
`test_distributed.py`.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np
import pytest

from tunix_blockdiff import distributed
from tunix_blockdiff import global_arrays


def test_distributed_serves_the_global_array_helpers_under_their_old_names():
  for name in global_arrays.__all__:
    assert getattr(distributed, name) is getattr(global_arrays, name), name


@hypothesis.given(
    rows=st.integers(1, 20), fsdp=st.sampled_from([1, 2, 4, 8])
)
def test_call_sharded_equals_the_unsharded_call(rows, fsdp):
  mesh = distributed.build_mesh({"fsdp": fsdp, "tp": 8 // fsdp})
  x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
  lengths = np.arange(rows, dtype=np.int32)

  def fn(x, lengths):
    # Rows of the padded global batch are placed over fsdp.
    assert x.shape[0] % fsdp == 0
    return {"y": x * 2 + lengths[:, None], "total": jax.numpy.sum(lengths)}

  out = global_arrays.call_sharded(fn, mesh, x, lengths)
  np.testing.assert_array_equal(out["y"], x * 2 + lengths[:, None])
  assert isinstance(out["y"], np.ndarray) and out["y"].shape == (rows, 3)
  # Non-row outputs come back whole (here: over the padded batch, whose
  # padding repeats the last row).
  padded = -(-rows // fsdp) * fsdp
  assert int(out["total"]) == lengths.sum() + (padded - rows) * (rows - 1)


def test_call_sharded_without_a_mesh_is_the_plain_call():
  fn = lambda x: x + 1
  assert global_arrays.call_sharded(fn, None, 1) == 2
  with pytest.raises(ValueError, match="same number of rows"):
    global_arrays.call_sharded(
        fn, distributed.build_mesh({"fsdp": 8}), np.zeros(3), np.zeros(4)
    )


def test_globalize_places_rows_over_fsdp_where_they_divide():
  mesh = distributed.build_mesh({"fsdp": 4, "tp": 2})
  tree = {"a": np.ones((8, 2)), "b": np.ones((3,)), "c": np.float32(1), "d": None}
  out = global_arrays.globalize(tree, mesh)
  spec = jax.sharding.PartitionSpec
  assert out["a"].sharding.spec == spec("fsdp")
  assert out["b"].sharding.spec == spec()  # 3 rows do not divide over 4
  assert out["c"].sharding.spec == spec() and out["d"] is None
  np.testing.assert_array_equal(global_arrays.gather(out["a"]), tree["a"])
  assert global_arrays.globalize(tree, None) is tree
