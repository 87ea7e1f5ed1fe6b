"""Context-parallel training step == single-device step (8 simulated CPUs).

A tiny Tunix Qwen3 (sequence-parallel sharding config: activations
[B, L, ...] over ('fsdp', 'sp')) computes the block-diffusion loss and its
gradients on a mesh fsdp x sp(= cp) x tp(=1), with the batch in load-balanced
order and sharded over (fsdp, sp). Dense attention and Splash (interpret
mode; Tunix's flash path shards queries over 'sp' inside `shard_map`) must
both reproduce the single-device step on the batch in logical order.
"""

import dataclasses

from flax import nnx
import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.models import flash as shim
from tunix_blockdiff.attention import tokamax_path
from tunix_blockdiff.objective import loss as loss_lib

VOCAB, L, BATCH, BLOCK = 64, 512, 4, 16
TOL = 1e-5


def _model(flash: bool):
  config = dataclasses.replace(
      tiny_models.qwen3_config(
          VOCAB, use_flash_attention=flash, flash_attention_block_size=128
      ),
      shd_config=qwen3_lib.ShardingConfig.get_default_sharding(enable_sp=True),
  )
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))


def _batch():
  """Packed rows whose documents start at block multiples, with padding."""
  rng = np.random.default_rng(0)
  positions = np.tile(np.arange(L, dtype=np.int32), (BATCH, 1))
  segments = np.zeros((BATCH, L), np.int32)
  validity = np.ones((BATCH, L), bool)
  for row, start in ((1, 96), (2, 208), (3, 400)):
    positions[row, start:] = np.arange(L - start)
    segments[row, start:] = 1
    validity[row, start - 11 : start] = False
  validity[0, -9:] = False
  weights = (rng.random((BATCH, L)) < 0.5) & validity
  return {
      "tokens": rng.integers(0, VOCAB, (BATCH, L)).astype(np.int32),
      "positions": positions,
      "segment_ids": segments,
      "validity": validity,
      "targets": rng.integers(0, VOCAB, (BATCH, L)).astype(np.int32),
      "loss_weights": weights.astype(np.float32),
  }


def _loss(graphdef, state, batch, *, flash, cp_size=1, logits_sharding=None):
  model = nnx.merge(graphdef, state)
  args = dict(
      block_size=BLOCK,
      validity=batch["validity"],
      segment_ids=batch["segment_ids"],
  )
  if flash:
    logits = shim.block_diffusion_logits(
        model,
        batch["tokens"],
        batch["positions"],
        cp_size=cp_size,
        mask_mode="static",
        **args,
    )
  else:
    logits = modeling.block_diffusion_logits(
        model, batch["tokens"], batch["positions"], **args
    )
  if logits_sharding is not None:
    # Tunix's own constraints are no-ops on CPU; keep the sequence sharded.
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
  out = loss_lib.diffusion_loss(logits, batch["targets"], batch["loss_weights"])
  return out.primary_loss.compute(), logits


@pytest.fixture(scope="module")
def setup():
  graphdef_dense, state = nnx.split(_model(flash=False))
  graphdef_flash, _ = nnx.split(_model(flash=True))
  batch = _batch()
  step = jax.value_and_grad(
      lambda s, b: _loss(graphdef_dense, s, b, flash=False)[0]
  )
  reference = jax.jit(step)(state, batch)
  return graphdef_dense, graphdef_flash, state, batch, reference


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("attention", ["dense", "splash"])
def test_context_parallel_step_matches_single_device(
    setup, cp, attention, monkeypatch
):
  graphdef_dense, graphdef_flash, state, batch, (want_loss, want_grads) = setup
  flash = attention == "splash"
  mesh = jax.make_mesh(
      (8 // cp, cp, 1), ("fsdp", "sp", "tp"), axis_types=(AxisType.Auto,) * 3
  )
  token_sharding = NamedSharding(mesh, P("fsdp", "sp"))
  reordered = context_parallel.reorder_batch_for_context_parallel(batch, cp)
  reordered = {
      k: jax.device_put(v, token_sharding) for k, v in reordered.items()
  }
  replicated = jax.device_put(state, NamedSharding(mesh, P()))

  kernel_shards = []
  make = shim._SplashProxy.make_splash_mha  # pylint: disable=protected-access

  def recording_make(self, mask, **kwargs):
    kernel_shards.append(kwargs["q_seq_shards"])
    return make(self, mask, **kwargs)

  monkeypatch.setattr(shim._SplashProxy, "make_splash_mha", recording_make)  # pylint: disable=protected-access

  step = jax.jit(
      jax.value_and_grad(
          lambda s, b: _loss(
              graphdef_flash if flash else graphdef_dense,
              s,
              b,
              flash=flash,
              cp_size=cp,
              logits_sharding=NamedSharding(mesh, P("fsdp", "sp", None)),
          ),
          has_aux=True,
      )
  )
  with mesh:
    (loss, logits), grads = step(replicated, reordered)

  assert abs(float(loss) - float(want_loss)) <= TOL
  errors = jax.tree.map(
      lambda g, w: float(jnp.abs(g - w).max()), grads, want_grads
  )
  assert max(jax.tree.leaves(errors)) <= TOL, errors
  # Each device holds its (batch, sequence) shard of the logits.
  assert logits.sharding.shard_shape(logits.shape) == (
      BATCH // (8 // cp),
      L // cp,
      VOCAB,
  )
  if flash:
    # Tunix built its Splash kernel for `cp` query-sequence shards.
    assert kernel_shards and set(kernel_shards) == {cp}
  else:
    assert not kernel_shards


@pytest.mark.parametrize("kernel", ["splash", "tokamax"])
def test_position_aware_kernels_under_context_parallelism(setup, kernel):
  """Unaligned packing: masks from positions, per query shard, cp=4."""
  if kernel == "tokamax" and not tokamax_path.tokamax_available():
    pytest.skip("the optional `tokamax` package is not installed")
  graphdef_dense, graphdef_flash, state, batch, _ = setup
  cp = 4
  batch = dict(batch)
  positions, segments = batch["positions"].copy(), batch["segment_ids"].copy()
  positions[1, 37:] = np.arange(L - 37)  # a document starting off the grid.
  segments[1, 37:] = 2
  batch.update(positions=positions, segment_ids=segments)
  want = modeling.block_diffusion_logits(
      nnx.merge(graphdef_dense, state),
      batch["tokens"],
      positions,
      block_size=BLOCK,
      validity=batch["validity"],
      segment_ids=segments,
  )
  mesh = jax.make_mesh(
      (8 // cp, cp, 1), ("fsdp", "sp", "tp"), axis_types=(AxisType.Auto,) * 3
  )
  reordered = context_parallel.reorder_batch_for_context_parallel(batch, cp)
  reordered = {
      k: jax.device_put(v, NamedSharding(mesh, P("fsdp", "sp")))
      for k, v in reordered.items()
  }

  @jax.jit
  def logits(state, b):
    return shim.block_diffusion_logits(
        nnx.merge(graphdef_flash, state),
        b["tokens"],
        b["positions"],
        block_size=BLOCK,
        validity=b["validity"],
        segment_ids=b["segment_ids"],
        cp_size=cp,
        kernel=kernel,
        mask_mode="dynamic",
    )

  with mesh:
    got = logits(jax.device_put(state, NamedSharding(mesh, P())), reordered)
  got = context_parallel.restore_from_context_parallel(np.asarray(got), cp)
  keep = batch["validity"][..., None]
  assert np.abs(np.where(keep, got - np.asarray(want), 0.0)).max() <= 1e-4
