"""`layouts`: train steps whose updated states keep their shardings."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import layouts

P = jax.sharding.PartitionSpec


class _Scale(nnx.Module):

  def __init__(self, value):
    self.w = nnx.Param(value)


def _mesh():
  return jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))


def test_named_shardings_are_none_off_a_mesh():
  assert layouts.named_shardings(None) is None
  assert layouts.named_shardings(_Scale(jnp.ones((4,)))) == [None]
  mesh = _mesh()
  replicated = jax.sharding.NamedSharding(mesh, P())
  placed = _Scale(jax.device_put(jnp.ones((4,)), replicated))
  assert layouts.named_shardings(placed) == [replicated]


def _step_that_reshards(mesh):
  split = jax.sharding.NamedSharding(mesh, P("fsdp"))

  def step(model, optimizer, grad_sums, inputs):
    del optimizer, grad_sums
    model.w.set_value(jax.lax.with_sharding_constraint(
        model.w.get_value() * inputs, split))
    return model.w.get_value().sum()

  return step


def test_a_step_keeps_the_layout_it_was_built_with():
  mesh = _mesh()
  replicated = jax.sharding.NamedSharding(mesh, P())
  for keep in (False, True):
    model = _Scale(jax.device_put(jnp.arange(4.0), replicated))
    step = _step_that_reshards(mesh)
    if keep:
      step = layouts.keeping_shardings(step, model, None, None)
    total = nnx.jit(step)(model, None, None, jnp.float32(2.0))
    assert float(total) == 12.0
    np.testing.assert_array_equal(model.w.get_value(), [0.0, 2.0, 4.0, 6.0])
    got = model.w.get_value().sharding
    assert got.is_equivalent_to(replicated, 1) == keep, got


def test_modules_without_a_mesh_are_left_alone():
  model = _Scale(jnp.arange(3.0))

  def step(model, optimizer, grad_sums, inputs):
    del optimizer, grad_sums
    model.w.set_value(model.w.get_value() + inputs)
    return inputs

  kept = layouts.keeping_shardings(step, model, None, None)
  nnx.jit(kept)(model, None, None, jnp.float32(1.0))
  np.testing.assert_array_equal(model.w.get_value(), [1.0, 2.0, 3.0])


def _lowered(module):
  return jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s)).lower(
      nnx.state(module)).as_text()


def test_a_fresh_state_is_committed_like_a_restored_one(tmp_path):
  """A fresh state compiles the program a checkpoint-restored state does."""
  from tunix.sft import checkpoint_manager  # pylint: disable=g-import-not-at-top

  manager = checkpoint_manager.CheckpointManager(str(tmp_path))
  manager.save(1, _Scale(jnp.arange(4.0)), force=True)
  manager.close()
  restored = _Scale(jnp.zeros((4,)))
  manager = checkpoint_manager.CheckpointManager(str(tmp_path))
  assert manager.maybe_restore(restored)[0] == 1
  manager.close()
  fresh = _Scale(jnp.arange(4.0))
  # Uncommitted and committed arrays lower to different programs.
  assert _lowered(fresh) != _lowered(restored)
  layouts.commit_to_one_device(fresh, None)
  assert _lowered(fresh) == _lowered(restored)
  np.testing.assert_array_equal(fresh.w.get_value(), np.arange(4.0))
  assert fresh.w.get_value().devices() == {jax.local_devices()[0]}


def test_committing_leaves_mesh_states_and_non_arrays_alone():
  mesh = _mesh()
  split = jax.sharding.NamedSharding(mesh, P("fsdp"))
  placed = _Scale(jax.device_put(jnp.ones((4,)), split))
  layouts.commit_to_one_device(placed)
  assert placed.w.get_value().sharding == split
  counter = _Scale(3)
  layouts.commit_to_one_device(counter)
  assert counter.w.get_value() == 3 and isinstance(counter.w.get_value(), int)
