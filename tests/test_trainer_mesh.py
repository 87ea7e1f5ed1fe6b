"""The trainer on a context-parallel mesh, with a model built outside it.

The flow a user follows: a tiny Qwen3 with Tunix's sequence-parallel
sharding config is built with no mesh, the trainer is created under
`with mesh:` (fsdp 2 x sp 4) and trains on a batch in load-balanced order.
The trainer places the model and optimizer states on that mesh itself
(`layouts.place_unsharded`); one SGD step must equal the single-device step
on the batch in logical order, and so must the eval loss.
"""

import dataclasses

from flax import nnx
import jax
import numpy as np
import optax
import pytest
from tunix.models.qwen3 import model as qwen3_lib
from tunix.sft import peft_trainer

import tunix_blockdiff as tbd
from tunix_blockdiff import data
from tunix_blockdiff import layouts
from tunix_blockdiff import tasks
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.models import tiny

VOCAB, SEQ, BATCH, CP, LR = 50, 32, 8, 4, 0.5
OBJECTIVE = tbd.BlockDiffusionConfig(block_size=8, mask_token_id=3,
                                     stream="single")


def _model():
  config = dataclasses.replace(
      tiny.qwen3_config(VOCAB, embed_dim=32, num_heads=4, num_kv_heads=2),
      shd_config=qwen3_lib.ShardingConfig.get_default_sharding(enable_sp=True),
  )
  return tiny.random_mlps(qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0)))


def _batch():
  tok = tasks.CharTokenizer()
  pairs = [tasks.encode_example(tok, p, a)
           for p, a in tasks.get_task("reverse").sample(BATCH, seed=0)]
  examples = data.as_examples(pairs, seq_len=SEQ, vocab_size=VOCAB,
                              mask_token_id=3)
  batches = data.SFTBatches(examples, OBJECTIVE, data.DataConfig(
      seq_len=SEQ, batch_size=BATCH, vocab_size=VOCAB, completion_fill_id=2))
  return next(iter(batches))


def _mesh():
  return jax.make_mesh((2, CP, 1), ("fsdp", "sp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _reference(batch):
  """(loss, gradient) on one device, logical order."""
  loss_fn = trainer_lib.make_diffusion_loss_fn(OBJECTIVE)
  inputs = trainer_lib.diffusion_model_inputs(batch)

  def loss(model):
    return loss_fn(model, **inputs).primary_loss.compute()

  model = _model()
  # One compiled program each (op by op: ~250 programs).
  value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
  return model, float(value), grads, nnx.jit(loss)


def _params(model):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


def test_one_sgd_step_on_the_mesh_equals_the_logical_single_device_step(
    tmp_path):
  batch = _batch()
  reordered = tbd.reorder_batch_for_context_parallel(batch, CP)
  reference, want_loss, grads, loss = _reference(batch)
  before = _params(reference)
  mesh = _mesh()
  model = _model()
  with mesh:
    trainer = tbd.BlockDiffusionTrainer(
        model, optax.sgd(LR),
        peft_trainer.TrainingConfig(eval_every_n_steps=10, max_steps=1,
                                    data_sharding_axis=("fsdp", "sp")),
        OBJECTIVE)
    # The states went onto the mesh, by the model's partition specs.
    shardings = layouts.named_shardings(trainer.model)
    assert all(s is not None and s.mesh == mesh for s in shardings)
    assert any(not s.is_fully_replicated for s in shardings)
    _, eval_step = trainer.jit_train_and_eval_step()
    _, out = eval_step(reordered)
    np.testing.assert_allclose(float(out.primary_loss.compute()), want_loss,
                               rtol=1e-5)
    trainer.train([reordered], eval_ds=[reordered])
  assert trainer.train_steps == 1
  got = _params(trainer.model)
  want_grads = _params_of(grads)
  for name, value in before.items():
    np.testing.assert_allclose(got[name], value - LR * want_grads[name],
                               rtol=1e-4, atol=1e-6, err_msg=name)
  # And the eval loss after the step equals the unsharded loss there.
  nnx.update(reference, nnx.state(jax.device_get(trainer.model), nnx.Param))
  with mesh:
    _, out = trainer.jit_train_and_eval_step()[1](reordered)
  np.testing.assert_allclose(float(out.primary_loss.compute()),
                             float(loss(reference)), rtol=1e-5)


def _params_of(grads):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(grads)}


def test_a_state_that_cannot_go_on_the_mesh_is_refused_in_one_line():
  model = _model()
  mesh = jax.make_mesh((1, 1, 8), ("fsdp", "sp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with mesh, pytest.raises(ValueError, match=(
      r"cannot place Qwen3 on the active mesh .*not a multiple of 8.*"
      r"reshard_model_to_mesh")):
    tbd.BlockDiffusionTrainer(
        model, optax.sgd(LR), peft_trainer.TrainingConfig(
            eval_every_n_steps=10, max_steps=1), OBJECTIVE)


def test_without_a_mesh_states_are_committed_to_the_first_device():
  trainer = tbd.BlockDiffusionTrainer(
      _model(), optax.sgd(LR), peft_trainer.TrainingConfig(
          eval_every_n_steps=10, max_steps=1), OBJECTIVE)
  leaves = jax.tree.leaves(nnx.state(trainer.model))
  assert {tuple(x.devices()) for x in leaves} == {(jax.local_devices()[0],)}
  assert layouts.active_mesh() is None
