"""DiffusionGemma's objective and trainer: corruption, loss, accumulation, LoRA."""

from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tunix.sft import peft_trainer

from tunix_blockdiff.data.examples import DataConfig
from tunix_blockdiff.data.examples import Example
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import data as rows_lib
from tunix_blockdiff.runs import model_setup
from tunix_blockdiff.kinds.diffusion_gemma import objective as obj
from tunix_blockdiff.kinds.diffusion_gemma import trainer as dg_trainer

VOCAB, C, SEQ = 24, 4, 16


def _model(seed=0, moe=False):
  extra = dict(num_experts=3, top_k_experts=2, moe_intermediate_size=8) if moe else {}
  config = dg.DiffusionGemmaConfig(
      vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
      layer_types=("sliding_attention", "full_attention"), num_heads=2,
      num_kv_heads=1, head_dim=8, global_num_kv_heads=1, global_head_dim=8,
      sliding_window=8, canvas_length=C, **extra)
  return dg.DiffusionGemma(config, rngs=nnx.Rngs(seed))


OBJ = obj.DiffusionGemmaObjective(canvas_length=C, vocab_size=VOCAB,
                                  self_conditioning_prob=0.5)


def _example(prompt, completion, i=0):
  return Example(np.asarray(prompt, np.int32), np.asarray(completion, np.int32), i)


def test_row_layout_fill_and_targets():
  row = rows_lib.encode_row(_example([5, 6, 7], [8, 9, 10, 11, 12]), OBJ, seed=0,
                       epoch=0, seq_len=SEQ, pad_token_id=0)
  # 5 completion tokens -> 2 canvases of 4, filled with fill_id (0).
  np.testing.assert_array_equal(row["clean"][:11], [5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0])
  np.testing.assert_array_equal(row["canvas_id"][:12], [-1] * 3 + [0] * 4 + [1] * 4 + [-1])
  np.testing.assert_array_equal(row["canvas_start"][3:11], [3] * 4 + [7] * 4)
  assert row["loss_weights"].sum() == 8 and row["valid"].sum() == 11
  np.testing.assert_array_equal(row["noisy"][:3], [5, 6, 7])  # prompt kept
  again = rows_lib.encode_row(_example([5, 6, 7], [8, 9, 10, 11, 12]), OBJ, seed=0,
                         epoch=0, seq_len=SEQ, pad_token_id=0)
  for k in obj.FIELDS:
    np.testing.assert_array_equal(row[k], again[k])
  other = rows_lib.encode_row(_example([5, 6, 7], [8, 9, 10, 11, 12]), OBJ, seed=0,
                         epoch=1, seq_len=SEQ, pad_token_id=0)
  assert not np.array_equal(row["noisy"], other["noisy"])
  with pytest.raises(ValueError, match="no room"):
    rows_lib.encode_row(_example(list(range(1, 14)), [3]), OBJ, seed=0, epoch=0,
                   seq_len=SEQ, pad_token_id=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.99))
def test_corruption_touches_only_canvases_at_the_noise_level(seed, min_noise):
  objective = obj.DiffusionGemmaObjective(C, VOCAB, min_noise=min_noise)
  row = rows_lib.encode_row(_example([1, 2], list(range(3, 15))), objective,
                       seed=seed, epoch=0, seq_len=SEQ, pad_token_id=0)
  outside = row["canvas_id"] < 0
  np.testing.assert_array_equal(row["noisy"][outside], row["clean"][outside])
  assert row["noisy"].min() >= 0 and row["noisy"].max() < VOCAB


def test_noise_level_one_replaces_every_slot_uniformly():
  objective = obj.DiffusionGemmaObjective(C, VOCAB, min_noise=0.999999)
  rows = [rows_lib.encode_row(_example([1], [2] * 12, i), objective, seed=0,
                         epoch=0, seq_len=SEQ, pad_token_id=0) for i in range(200)]
  noisy = np.concatenate([r["noisy"][1:13] for r in rows])
  counts = np.bincount(noisy, minlength=VOCAB)
  # Uniform replacement: every id appears, the clean id no more than chance.
  assert counts.min() > 0 and counts[2] < 3 * counts.mean()


def _batch(examples, seed=0, objective=OBJ):
  rows = [rows_lib.encode_row(e, objective, seed=seed, epoch=0, seq_len=SEQ,
                         pad_token_id=0) for e in examples]
  return {k: jnp.asarray(v) for k, v in rows_lib.stack(rows).items()}


def test_splash_training_loss_and_gradients_equal_dense():
  """The loss traced under Splash (interpret mode, tile 128) = dense."""
  model = _model()
  rows = [rows_lib.encode_row(_example(list(range(1, 9)), [3, 5, 7] * 30, i),
                              OBJ, seed=0, epoch=0, seq_len=128, pad_token_id=0)
          for i in range(2)]
  batch = {k: jnp.asarray(v) for k, v in rows_lib.stack(rows).items()}

  def value_and_grads(loss_fn):
    @nnx.jit
    def run(m):
      def total(m):
        out = loss_fn(m, **batch).primary_loss
        return out.unreduced_sum / out.denominator
      return nnx.value_and_grad(total)(m)
    return run(model)

  want, want_grads = value_and_grads(obj.make_loss_fn(OBJ))
  got, got_grads = value_and_grads(
      obj.make_loss_fn(OBJ, splash_tile=128, splash_interpret=True))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads),
                  strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


def test_zero_weight_batch_gives_zero_loss_and_finite_grads():
  model = _model(moe=True)
  batch = {k: jnp.asarray(v) for k, v in rows_lib.stack(
      [rows_lib.empty_row(SEQ, 0)] * 2).items()}
  loss_fn = obj.make_loss_fn(OBJ)

  @nnx.jit  # as the trainer runs it (eager, op by op, it took 28 s)
  def loss_and_grads(m):
    def total(m):
      out = loss_fn(m, **batch).primary_loss
      return out.unreduced_sum, out.denominator
    return nnx.value_and_grad(total, has_aux=True)(m)

  (value, denominator), grads = loss_and_grads(model)
  assert float(value) == 0.0 and float(denominator) == 0.0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_self_conditioning_mask_zeros_the_signal():
  model = _model()
  batch = _batch([_example([1, 2, 3], [4, 5, 6, 7, 8]),
                  _example([9, 8], [7, 6, 5])])
  off = dict(batch, sc_on=jnp.zeros((2,), bool))
  # Each loss as one compiled program (op by op: ~50 programs each).
  loss_fn = nnx.jit(obj.make_loss_fn(OBJ))
  with_sc = loss_fn(model, **off)
  without = nnx.jit(obj.make_loss_fn(obj.DiffusionGemmaObjective(
      C, VOCAB, self_conditioning_prob=0.0)))(model, **off)
  assert float(with_sc.primary_loss.unreduced_sum) == pytest.approx(
      float(without.primary_loss.unreduced_sum), abs=1e-6)
  on = dict(batch, sc_on=jnp.ones((2,), bool))
  conditioned = loss_fn(model, **on)
  assert abs(float(conditioned.primary_loss.unreduced_sum)
             - float(without.primary_loss.unreduced_sum)) > 1e-4


def _params(model, kind=nnx.Param):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, kind))]


def _config(**kw):
  return peft_trainer.TrainingConfig(eval_every_n_steps=1000, **kw)


def test_exact_accumulation_across_unequal_micro_batches():
  small = {k: np.asarray(v) for k, v in _batch(
      [_example([1, 2, 3, 4, 5, 6, 7, 8, 9], [4], 0),
       _example([1, 2, 3, 4, 5, 6, 7, 8], [5], 1)], seed=1).items()}
  large = {k: np.asarray(v) for k, v in _batch(
      [_example([1], list(range(2, 14)), 2),
       _example([2], list(range(3, 15)), 3)], seed=2).items()}
  assert small["loss_weights"].sum() * 2 < large["loss_weights"].sum()
  full = {k: np.concatenate([small[k], large[k]]) for k in small}
  accumulated, one = _model(), _model()
  dg_trainer.DiffusionGemmaTrainer(
      accumulated, optax.sgd(0.5),
      _config(max_steps=2, gradient_accumulation_steps=2), OBJ,
  ).train([small, large] * 2)
  dg_trainer.DiffusionGemmaTrainer(
      one, optax.sgd(0.5), _config(max_steps=2), OBJ).train([full] * 2)
  initial = _params(_model())
  diff = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(a, b))
  moved = diff(initial, _params(accumulated))
  assert moved > 1e-3
  # Equal up to float32 summation order, which differs between CPUs (seen
  # 6e-6 and 3e-5 of a 0.24 move); a mean of micro-batch means (8 and 24
  # targets) moves the first step 0.12 away from the exact one.
  assert diff(_params(accumulated), _params(one)) < 1e-3 * moved


def test_train_steps_keep_the_shardings_of_parameters_and_state():
  """On a mesh, updated states come back laid out as they went in.

  Otherwise every later step, sampler and scorer program compiles again
  for the layout XLA picked (a replicated norm scale split over fsdp).
  """
  mesh = jax.make_mesh((2, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:2])
  model = model_setup.shard_model(_model(), mesh)

  def same_layout(m, shardings):
    leaves = jax.tree.leaves(nnx.state(m))
    return all(x.sharding.is_equivalent_to(s, x.ndim)
               for x, s in zip(leaves, shardings, strict=True))

  before = [x.sharding for x in jax.tree.leaves(nnx.state(model))]
  batch = {k: np.asarray(v) for k, v in _batch(
      [_example([1, 2], list(range(3, 11))), _example([3], [4, 5, 6])]).items()}
  with mesh:
    trainer = dg_trainer.DiffusionGemmaTrainer(
        model, optax.adam(1e-2),
        _config(max_steps=2, gradient_accumulation_steps=2), OBJ)
    trainer.train([batch] * 4)
  assert same_layout(model, before)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for counter in (trainer.grad_sums.denominator, trainer.grad_sums.micro_steps):
    assert counter.get_value().sharding == replicated


def test_lora_on_attention_and_mlp_trains_only_lora():
  import qwix  # pylint: disable=g-import-not-at-top

  model = _model(moe=True)
  cache = model.init_cache(1, 8)
  prompt = (jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None],
            jnp.ones((1, 4), bool))
  canvas = (jnp.ones((1, C), jnp.int32), jnp.arange(4, 8)[None])
  # Jitted: called eagerly, the MoE model compiles op by op.
  call = nnx.jit(lambda m, *args, method: m(*args, method=method),
                 static_argnames="method")
  _, plain_cache = call(model, *prompt, cache, method="encode")
  plain = call(model, *canvas, plain_cache, method="decode")
  provider = qwix.LoraProvider(module_path=".*_proj", rank=2, alpha=4.0)
  lora = model_setup.traced_lora(model, provider, seed=1)
  paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(
      nnx.state(lora, nnx.LoRAParam))}
  for name in ("q_proj", "k_proj", "o_proj", "mlp.gate_proj", "router_proj",
               "self_conditioning.mlp.up_proj"):
    assert any(name in p for p in paths), name
  frozen = lambda m: [np.asarray(x) for x in jax.tree.leaves(
      nnx.state(m, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))]
  frozen_before, lora_before = frozen(lora), _params(lora, nnx.LoRAParam)
  batch = {k: np.asarray(v) for k, v in _batch(
      [_example([1, 2], list(range(3, 11))), _example([3], [4, 5, 6])]).items()}
  dg_trainer.DiffusionGemmaTrainer(
      lora, optax.adam(1e-2), _config(max_steps=2), OBJ).train([batch] * 2)
  lora_after = _params(lora, nnx.LoRAParam)
  assert max(float(np.abs(a - b).max())
             for a, b in zip(lora_before, lora_after)) > 1e-4
  for a, b in zip(frozen_before, frozen(lora)):
    np.testing.assert_array_equal(a, b)
  # The sampler's passes go through __call__, so they see the LoRA update.
  _, lora_cache = call(lora, *prompt, lora.init_cache(1, 8), method="encode")
  tuned = call(lora, *canvas, lora_cache, method="decode")
  assert float(jnp.abs(tuned - plain).max()) > 1e-4


def test_batches_are_deterministic_and_validated():
  examples = [_example([1, 2], [3, 4, 5], i) for i in range(6)]
  dcfg = DataConfig(seq_len=SEQ, batch_size=2, vocab_size=VOCAB, seed=3,
                    num_epochs=2)
  a = list(rows_lib.DiffusionGemmaBatches(examples, OBJ, dcfg))
  b = list(rows_lib.DiffusionGemmaBatches(examples, OBJ, dcfg))
  assert len(a) == 6
  for x, y in zip(a, b):
    for k in obj.FIELDS:
      np.testing.assert_array_equal(x[k], y[k])
  with pytest.raises(ValueError, match="packing"):
    rows_lib.DiffusionGemmaBatches(examples, OBJ, DataConfig(
        seq_len=SEQ, batch_size=2, vocab_size=VOCAB, packing="block_aligned"))
  evals = rows_lib.eval_batches(examples[:3], OBJ, dcfg)
  assert len(evals) == 2 and evals[1]["loss_weights"][1].sum() == 0
  with pytest.raises(ValueError, match="fill_id"):
    obj.DiffusionGemmaObjective(C, VOCAB, fill_id=VOCAB)
  with pytest.raises(TypeError, match="objective"):
    dg_trainer.DiffusionGemmaTrainer(_model(), optax.sgd(0.1), _config(),
                                      object())
