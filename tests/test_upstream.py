"""Tests for the Tunix diffusion extension points (tunix_blockdiff.upstream).

Every test runs on google-tunix 0.1.7 (compat fallbacks) and on Tunix main
(Tunix's own contracts); the tests marked `main_only` check Tunix main's
objects themselves and are skipped where `tunix.diffusion` is not importable.
The protocol doubles below are ours: the call shapes of Tunix main's
`DiffusionBatchAdapter` and `DiffusionLogitsFn`, made runtime-checkable.
"""

import inspect
from typing import Any, Protocol, runtime_checkable

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

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff import upstream

VOCAB = 48
MASK = 3
SEQ = 16
DCFG = config_lib.BlockDiffusionConfig(block_size=4, mask_token_id=MASK)
TWO_STREAM = config_lib.BlockDiffusionConfig(
    block_size=4, mask_token_id=MASK, stream="two_stream"
)
ELBO = config_lib.BlockDiffusionConfig(
    block_size=4, mask_token_id=MASK, loss_weighting="elbo"
)

main_only = pytest.mark.skipif(
    not compat.TUNIX_HAS_DIFFUSION,
    reason=(
        "Tunix main's tunix.diffusion is not importable (google-tunix 0.1.7)"
    ),
)


@runtime_checkable
class _AdapterDouble(Protocol):
  """Our double of `DiffusionBatchAdapter`: `(raw_batch, /) -> batch`."""

  def __call__(self, batch: Any, /) -> Any:
    ...


@runtime_checkable
class _LogitsFnDouble(Protocol):
  """Our double of `DiffusionLogitsFn`: `(model, model_inputs, /) -> logits`."""

  def __call__(self, model: Any, model_inputs: Any, /) -> Any:
    ...


def _positional_arity(fn) -> int:
  params = inspect.signature(fn).parameters.values()
  kinds = (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD,
  )
  return sum(1 for p in params if p.kind in kinds and p.name != "self")


def _model(seed=0):
  return tiny_models.tiny_qwen3(
      VOCAB,
      seed=seed,
      num_layers=1,
      embed_dim=16,
      hidden_dim=32,
      num_heads=2,
      head_dim=8,
      num_kv_heads=1,
  )


def _examples(n=8, seed=0):
  rng = np.random.default_rng(seed)
  raw = [
      (
          rng.integers(4, VOCAB, rng.integers(1, 5)).tolist(),
          rng.integers(4, VOCAB, rng.integers(2, 10)).tolist(),
      )
      for _ in range(n)
  ]
  return data_lib.as_examples(
      raw, seq_len=SEQ, vocab_size=VOCAB, mask_token_id=MASK
  )


def _batches(dcfg=DCFG, batch_size=2, n=8):
  data_config = data_lib.DataConfig(
      seq_len=SEQ, batch_size=batch_size, vocab_size=VOCAB, num_epochs=1
  )
  return list(data_lib.SFTBatches(_examples(n), dcfg, data_config))


@pytest.fixture(scope="module")
def batch():
  return _batches(batch_size=4, n=4)[0]


# Contracts.


def test_adapter_and_logits_fn_have_the_protocol_call_shapes():
  adapter = upstream.BlockDiffusionBatchAdapter()
  logits_fn = upstream.BlockDiffusionLogitsFn(DCFG)
  assert isinstance(adapter, _AdapterDouble)
  assert isinstance(logits_fn, _LogitsFnDouble)
  assert _positional_arity(adapter) == 1
  assert _positional_arity(logits_fn) == 2
  # Callable positionally only, as Tunix calls them.
  inspect.signature(adapter).bind(object())
  inspect.signature(logits_fn).bind(object(), object())


@main_only
def test_compat_names_are_tunix_mains_objects():
  import tunix.diffusion as tunix_diffusion  # pylint: disable=g-import-not-at-top
  from tunix.sft import utils as sft_utils  # pylint: disable=g-import-not-at-top

  assert compat.DiffusionTokenBatch is tunix_diffusion.DiffusionTokenBatch
  assert compat.DiffusionLogitsFn is tunix_diffusion.DiffusionLogitsFn
  assert compat.DiffusionBatchAdapter is tunix_diffusion.DiffusionBatchAdapter
  assert (
      compat.compute_diffusion_logits
      is tunix_diffusion.compute_diffusion_logits
  )
  assert compat.LossOutput is sft_utils.LossOutput
  # Our callables take exactly the positional arguments of main's protocols
  # (`self` is not counted).
  assert _positional_arity(upstream.BlockDiffusionBatchAdapter()) == (
      _positional_arity(tunix_diffusion.DiffusionBatchAdapter.__call__)
  )
  assert _positional_arity(upstream.BlockDiffusionLogitsFn(DCFG)) == (
      _positional_arity(tunix_diffusion.DiffusionLogitsFn.__call__)
  )


def test_adapter_maps_batch_fields(batch):
  out = upstream.BlockDiffusionBatchAdapter()(batch)
  assert isinstance(out, compat.DiffusionTokenBatch)
  assert sorted(out.model_inputs) == sorted(upstream.MODEL_INPUT_KEYS)
  for name in upstream.MODEL_INPUT_KEYS:
    np.testing.assert_array_equal(out.model_inputs[name], batch[name])
  np.testing.assert_array_equal(out.target_ids, batch["targets"])
  np.testing.assert_array_equal(out.loss_weights, batch["loss_weights"])


def test_adapter_rejects_bad_batches(batch):
  adapter = upstream.BlockDiffusionBatchAdapter()
  with pytest.raises(TypeError, match="mapping"):
    adapter([batch["tokens"]])
  with pytest.raises(ValueError, match=r"missing fields \['segment_ids'\]"):
    adapter({k: v for k, v in batch.items() if k != "segment_ids"})
  with pytest.raises(ValueError, match=r"batch\['validity'\]"):
    adapter({**batch, "validity": batch["validity"][:, :-1]})
  with pytest.raises(ValueError, match="nonnegative"):
    adapter({**batch, "loss_weights": -batch["loss_weights"]})


@pytest.mark.parametrize("dcfg", [DCFG, TWO_STREAM], ids=["single", "two"])
def test_compute_diffusion_logits_is_the_trainers_logits(dcfg):
  batch = _batches(dcfg, batch_size=2, n=2)[0]
  model = _model()
  prepared = upstream.BlockDiffusionBatchAdapter()(batch)
  logits_fn = upstream.BlockDiffusionLogitsFn(dcfg)
  got = jax.jit(lambda b: compat.compute_diffusion_logits(model, b, logits_fn))(
      prepared
  )
  fields = {k: batch[k] for k in upstream.MODEL_INPUT_KEYS}
  want = trainer_lib.diffusion_logits(model, dcfg, **fields)
  assert got.shape == (2, SEQ, VOCAB)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_compute_diffusion_logits_rejects_misaligned_logits(batch):
  prepared = upstream.BlockDiffusionBatchAdapter()(batch)
  with pytest.raises(ValueError, match="align"):
    compat.compute_diffusion_logits(
        None, prepared, lambda m, x: jnp.zeros((4, SEQ - 1, VOCAB))
    )
  with pytest.raises(TypeError, match="floating"):
    compat.compute_diffusion_logits(
        None, prepared, lambda m, x: jnp.zeros((4, SEQ, VOCAB), jnp.int32)
    )
  with pytest.raises(ValueError, match="vocabulary"):
    compat.compute_diffusion_logits(
        None, prepared, lambda m, x: jnp.zeros((4, SEQ, 2))
    )
  with pytest.raises(ValueError, match="finite"):
    compat.DiffusionTokenBatch.create(
        model_inputs=prepared.model_inputs,
        target_ids=prepared.target_ids,
        loss_weights=np.full(prepared.target_ids.shape, np.nan, np.float32),
    )


def test_logits_fn_rejects_bad_inputs():
  with pytest.raises(TypeError, match="BlockDiffusionConfig"):
    upstream.BlockDiffusionLogitsFn({"block_size": 4})
  with pytest.raises(ValueError, match=r"missing fields \['tokens'"):
    upstream.BlockDiffusionLogitsFn(DCFG)(None, {"inputs": np.zeros((1, 4))})


# The loss.


def _logits_of(logits):
  return lambda model, model_inputs: logits


def test_loss_matches_the_trainers_loss_and_denominators():
  batch = _batches(ELBO, batch_size=2, n=2)[0]
  weights = batch["loss_weights"]
  assert len(np.unique(weights[weights > 0])) > 1  # ELBO: 1/t weights.
  model = _model()
  prepared = upstream.BlockDiffusionBatchAdapter()(batch)
  logits_fn = upstream.BlockDiffusionLogitsFn(ELBO)
  ours = trainer_lib.make_diffusion_loss_fn(ELBO)(
      model, **trainer_lib.diffusion_model_inputs(batch)
  )
  by_targets = upstream.diffusion_loss_fn(
      model, prepared, logits_fn, denominator="targets"
  )
  by_weights = upstream.diffusion_loss_fn(model, prepared, logits_fn)
  np.testing.assert_allclose(
      by_targets.primary_loss.compute(), ours.primary_loss.compute(), rtol=1e-6
  )
  np.testing.assert_allclose(
      by_weights.primary_loss.unreduced_sum,
      ours.primary_loss.unreduced_sum,
      rtol=1e-6,
  )
  np.testing.assert_allclose(by_weights.primary_loss.denominator, weights.sum())
  assert float(by_targets.primary_loss.denominator) == (weights > 0).sum()


def test_loss_is_weighted_cross_entropy_without_shift():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
  prepared = compat.DiffusionTokenBatch.create(
      model_inputs={"x": np.zeros((1, 2), np.int32)},
      target_ids=np.array([[0, 2]], np.int32),
      loss_weights=np.array([[1.0, 3.0]], np.float32),
  )
  out = upstream.diffusion_loss_fn(None, prepared, _logits_of(logits))
  want = (-np.log(0.5) - 3 * np.log(0.8)) / 4.0
  np.testing.assert_allclose(out.primary_loss.compute(), want, rtol=1e-6)
  assert isinstance(out, compat.LossOutput)
  assert isinstance(out.primary_loss, compat.WeightedMetric)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 10.0),
)
def test_denominators_agree_on_binary_weights_and_scale_as_documented(
    seed, scale
):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32)
  targets = rng.integers(0, 6, (2, 5)).astype(np.int32)
  binary = (rng.random((2, 5)) < 0.6).astype(np.float32)
  binary[0, 0] = 1.0

  def loss(weights, denominator):
    prepared = compat.DiffusionTokenBatch.create(
        model_inputs={"x": targets}, target_ids=targets, loss_weights=weights
    )
    return float(
        upstream.diffusion_loss_fn(
            None, prepared, _logits_of(logits), denominator=denominator
        ).primary_loss.compute()
    )

  by_weights = loss(binary, "loss_weights")
  np.testing.assert_allclose(by_weights, loss(binary, "targets"), rtol=1e-5)
  # A weighted mean does not change when every weight is scaled; the
  # per-target mean scales with the weights.
  scaled = binary * np.float32(scale)
  np.testing.assert_allclose(
      loss(scaled, "loss_weights"), by_weights, rtol=1e-5
  )
  np.testing.assert_allclose(
      loss(scaled, "targets"), scale * by_weights, rtol=1e-5
  )


def test_inactive_slots_reach_neither_loss_nor_gradient():
  prepared = compat.DiffusionTokenBatch.create(
      model_inputs={"x": np.zeros((1, 3), np.int32)},
      target_ids=np.array([[1, 999, -5]], np.int32),
      loss_weights=np.array([[1.0, 0.0, 0.0]], np.float32),
  )

  def loss(scale):
    logits = scale * jnp.ones((1, 3, 4))
    logits = logits.at[0, 1].set(jnp.nan).at[0, 2].set(jnp.inf)
    return upstream.diffusion_loss_fn(
        None, prepared, _logits_of(logits)
    ).primary_loss.compute()

  value, grad = jax.value_and_grad(loss)(1.0)
  np.testing.assert_allclose(value, np.log(4.0), rtol=1e-6)
  assert np.isfinite(grad)


def test_loss_rejects_unknown_denominator(batch):
  prepared = upstream.BlockDiffusionBatchAdapter()(batch)
  with pytest.raises(ValueError, match="denominator"):
    upstream.diffusion_loss_fn(
        None, prepared, _logits_of(None), denominator="mean"
    )


# configure_diffusion_sft on a stock PeftTrainer.


def _training_config(**kw):
  return peft_trainer.TrainingConfig(eval_every_n_steps=1000, **kw)


def test_configure_rejects_bad_arguments():
  adapter = upstream.BlockDiffusionBatchAdapter()
  logits_fn = upstream.BlockDiffusionLogitsFn(DCFG)
  with pytest.raises(TypeError, match="with_loss_fn"):
    upstream.configure_diffusion_sft(object(), adapter, logits_fn)
  trainer = peft_trainer.PeftTrainer(
      _model(), optax.sgd(0.1), _training_config(max_steps=1)
  )
  with pytest.raises(TypeError, match="logits_fn must be callable"):
    upstream.configure_diffusion_sft(trainer, adapter, "qwen3")
  with pytest.raises(ValueError, match="denominator"):
    upstream.configure_diffusion_sft(
        trainer, adapter, logits_fn, denominator="tokens"
    )


def test_stock_peft_trainer_takes_the_steps_of_block_diffusion_trainer():
  dcfg = DCFG
  batches = _batches(dcfg, batch_size=2, n=6)
  steps = len(batches)
  assert steps == 3

  stock_model = _model()
  stock = peft_trainer.PeftTrainer(
      stock_model, optax.adam(0.05), _training_config(max_steps=steps)
  )
  assert (
      upstream.configure_diffusion_sft(
          stock,
          upstream.BlockDiffusionBatchAdapter(),
          upstream.BlockDiffusionLogitsFn(dcfg),
      )
      is stock
  )
  # 0.1.7's PeftTrainer needs (mean, aux); Tunix main reduces LossOutput.
  assert stock._has_aux == (not compat.TUNIX_HAS_LOSS_OUTPUT)
  stock.train(batches)

  ours_model = _model()
  ours = trainer_lib.BlockDiffusionTrainer(
      ours_model, optax.adam(0.05), _training_config(max_steps=steps), dcfg
  )
  ours.train(batches)

  def history(trainer):
    return np.asarray(
        trainer.metrics_logger.get_metric_history("", "loss", "train"),
        np.float64,
    )

  stock_losses, our_losses = history(stock), history(ours)
  assert stock_losses.shape == (steps,)
  np.testing.assert_allclose(stock_losses, our_losses, rtol=1e-5, atol=1e-6)
  # Both moved the parameters, identically.
  initial = jax.tree.leaves(nnx.state(_model(), nnx.Param))
  stock_params = jax.tree.leaves(nnx.state(stock_model, nnx.Param))
  our_params = jax.tree.leaves(nnx.state(ours_model, nnx.Param))
  assert (
      max(float(np.max(np.abs(a - b))) for a, b in zip(stock_params, initial))
      > 1e-2
  )
  for a, b in zip(stock_params, our_params):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_block_diffusion_trainer_keeps_its_loss_output_path(batch):
  # ExactAccumulation reduces a LossOutput itself (exact token-weighted
  # accumulation on 0.1.7), so it must get one, not (mean, aux).
  model = _model()
  ours = trainer_lib.BlockDiffusionTrainer(
      model,
      optax.sgd(0.1),
      _training_config(max_steps=1, gradient_accumulation_steps=2),
      DCFG,
  )
  upstream.configure_diffusion_sft(
      ours,
      upstream.BlockDiffusionBatchAdapter(),
      upstream.BlockDiffusionLogitsFn(DCFG),
      denominator="targets",
  )
  assert not ours._has_aux
  # Each loss as one compiled program (op by op: ~50 programs each).
  out = nnx.jit(ours.loss_fn)(model, **ours.gen_model_input_fn(batch))
  assert isinstance(out, compat.LossOutput)
  want = nnx.jit(trainer_lib.make_diffusion_loss_fn(DCFG))(
      model, **trainer_lib.diffusion_model_inputs(batch)
  )
  np.testing.assert_allclose(
      out.primary_loss.compute(), want.primary_loss.compute(), rtol=1e-6
  )
