"""Tests for BlockDiffusionTrainer: exact accumulation, eval, LoRA, resume."""

import dataclasses

from flax import nnx
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import qwix
from tunix.sft import peft_trainer

from tunix_blockdiff import compat
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.objective import loss as loss_lib
from tunix_blockdiff.runs import model_setup

VOCAB = 50
MASK = 3
SEQ = 16
DCFG = config_lib.BlockDiffusionConfig(block_size=4, mask_token_id=MASK)

# These tests hold on google-tunix 0.1.7 (our accumulation) and on Tunix main
# (Tunix's own LossOutput path), except where noted.


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


def _examples(lengths, seed=0):
  rng = np.random.default_rng(seed)
  raw = [
      (rng.integers(4, VOCAB, p).tolist(), rng.integers(4, VOCAB, c).tolist())
      for p, c in lengths
  ]
  return data.as_examples(
      raw, seq_len=SEQ, vocab_size=VOCAB, mask_token_id=MASK
  )


def _batch(lengths, seed=0, dcfg=DCFG):
  docs = [
      [data.encode_document(ex, dcfg, seed=seed, epoch=0)]
      for ex in _examples(lengths, seed)
  ]
  return data.assemble_rows(docs, seq_len=SEQ, block_size=dcfg.block_size)


def _params(model, kind=nnx.Param):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, kind))]


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _config(**kw):
  return peft_trainer.TrainingConfig(eval_every_n_steps=1000, **kw)


@pytest.fixture(scope="module")
def micro_batches():
  # Unequal token counts: 2 short completions vs 2 long ones.
  small = _batch([(4, 1), (3, 2)], seed=1)
  large = _batch([(2, 12), (1, 14)], seed=2)
  full = {k: np.concatenate([small[k], large[k]]) for k in small}
  assert (small["loss_weights"] > 0).sum() * 3 < (
      large["loss_weights"] > 0
  ).sum()
  return small, large, full


def test_accumulation_equals_full_batch_and_differs_from_multisteps(
    micro_batches,
):
  small, large, full = micro_batches
  steps = 2
  accumulated = _model()
  trainer_lib.BlockDiffusionTrainer(
      accumulated,
      optax.sgd(0.5),
      _config(max_steps=steps, gradient_accumulation_steps=2),
      DCFG,
  ).train([small, large] * steps)

  one_batch = _model()
  trainer_lib.BlockDiffusionTrainer(
      one_batch, optax.sgd(0.5), _config(max_steps=steps), DCFG
  ).train([full] * steps)

  # Tunix 0.1.7's own accumulation: optax.MultiSteps over micro-batch means.
  loss_fn = trainer_lib.make_diffusion_loss_fn(DCFG)
  multisteps = _model()
  base = peft_trainer.PeftTrainer(
      multisteps,
      optax.sgd(0.5),
      _config(max_steps=steps, gradient_accumulation_steps=2),
  )

  def mean_loss(
      model,
      inputs,
      tokens,
      targets,
      positions,
      segment_ids,
      validity,
      loss_weights,
  ):
    return loss_fn(
        model,
        inputs,
        tokens,
        targets,
        positions,
        segment_ids,
        validity,
        loss_weights,
    ).primary_loss.compute()

  base.with_loss_fn(mean_loss)
  base.with_gen_model_input_fn(trainer_lib.diffusion_model_inputs)
  base.train([small, large] * steps)

  initial = _params(_model())
  exact, reference, mean_of_means = map(
      _params, (accumulated, one_batch, multisteps)
  )
  assert _max_diff(initial, exact) > 1e-3  # training did something
  assert _max_diff(exact, reference) < 1e-6
  assert _max_diff(mean_of_means, reference) > 1e-4


def test_eval_loss_is_token_weighted(micro_batches):
  small, large, _ = micro_batches
  trainer = trainer_lib.BlockDiffusionTrainer(
      _model(), optax.sgd(0.1), _config(max_steps=0), DCFG
  )
  trainer.train([small], eval_ds=[small, large])
  logged = trainer.metrics_logger.get_metric_history("", "loss", "eval")[-1]

  loss_fn = trainer_lib.make_diffusion_loss_fn(DCFG)
  model = _model()
  jitted = jax.jit(
      lambda b: loss_fn(model, **trainer_lib.diffusion_model_inputs(b))
  )
  outs = [jitted(b) for b in (small, large)]
  sums = [float(o.primary_loss.unreduced_sum) for o in outs]
  counts = [float(o.primary_loss.denominator) for o in outs]
  np.testing.assert_allclose(logged, sum(sums) / sum(counts), rtol=1e-5)
  mean_of_means = np.mean([s / c for s, c in zip(sums, counts)])
  assert abs(logged - mean_of_means) > 1e-3
  accuracy = trainer.metrics_logger.get_metric_history("", "accuracy", "eval")[
      -1
  ]
  assert 0.0 <= accuracy <= 1.0


def test_zero_target_micro_batches_contribute_nothing(micro_batches):
  _, large, _ = micro_batches
  empty = data.assemble_rows([[], []], seq_len=SEQ, block_size=4)
  assert not empty["loss_weights"].any()

  def train(batches, steps, accumulation=None):
    model = _model()
    trainer = trainer_lib.BlockDiffusionTrainer(
        model,
        optax.adam(1e-2),
        _config(max_steps=steps, gradient_accumulation_steps=accumulation),
        DCFG,
    )
    trainer.train(batches)
    losses = trainer.metrics_logger.get_metric_history("", "loss", "train")
    assert np.all(np.isfinite(losses))
    return _params(model)

  reference = train([large, large], 2)
  # Empty micro-batches inside accumulated steps add nothing...
  assert _max_diff(train([empty, large, large, empty], 2, 2), reference) < 1e-7
  # ...and a step made only of them stays finite and, on our path, changes
  # neither the parameters nor the optimizer state (Tunix main applies Adam
  # to the zero gradient, which still moves along the momentum).
  with_empty_step = train([large, empty, large], 3)
  assert all(np.all(np.isfinite(p)) for p in with_empty_step)
  if not compat.TUNIX_HAS_LOSS_OUTPUT:
    assert _max_diff(with_empty_step, reference) == 0.0


def test_lora_trains_only_lora_params(micro_batches):
  small, large, _ = micro_batches
  base = _model()
  provider = qwix.LoraProvider(
      module_path=".*q_proj|.*v_proj|.*up_proj", rank=2, alpha=2.0
  )
  model = model_setup.traced_lora(base, provider, seed=1)
  frozen = _params(model, nnx.Not(nnx.LoRAParam))
  lora_before = _params(model, nnx.LoRAParam)
  assert lora_before
  trainer = trainer_lib.BlockDiffusionTrainer(
      model,
      optax.adam(1e-2),
      _config(max_steps=2, gradient_accumulation_steps=2),
      DCFG,
  )
  trainer.train([small, large] * 2)
  assert _max_diff(frozen, _params(model, nnx.Not(nnx.LoRAParam))) == 0.0
  assert _max_diff(lora_before, _params(model, nnx.LoRAParam)) > 1e-4


class _Preempted(Exception):
  pass


class _CrashAt:
  """Yields the batches of `ds` and raises before batch `index`."""

  def __init__(self, ds, index):
    self.ds, self.index = ds, index

  def __iter__(self):
    for i, batch in enumerate(self.ds):
      if i == self.index:
        raise _Preempted(f"simulated preemption at batch {i}")
      yield batch


def test_resume_after_interruption_reproduces_uninterrupted_run(tmp_path):
  examples = _examples([(3, 5), (2, 8), (4, 3), (1, 10), (5, 6), (2, 2)] * 3)
  dcfg = dataclasses.replace(DCFG, stream="two_stream", loss_weighting="elbo")
  ds = data.SFTBatches(
      examples,
      dcfg,
      data.DataConfig(seq_len=SEQ, batch_size=2, vocab_size=VOCAB, seed=3),
  )
  optimizer = lambda: optax.adamw(
      optax.linear_schedule(1e-2, 1e-3, 6), weight_decay=0.1
  )

  def config(directory):
    return _config(
        max_steps=6,
        gradient_accumulation_steps=2,
        checkpoint_root_directory=str(directory) if directory else None,
        checkpointing_options=ocp.CheckpointManagerOptions(
            save_interval_steps=2,
            max_to_keep=2,
            enable_async_checkpointing=False,
        ),
    )

  uninterrupted = _model()
  trainer_lib.BlockDiffusionTrainer(
      uninterrupted, optimizer(), config(None), dcfg
  ).train(ds)

  first = trainer_lib.BlockDiffusionTrainer(
      _model(), optimizer(), config(tmp_path), dcfg
  )
  # Step 5 dies between its two micro-batches; the last checkpoint is step 4.
  with pytest.raises(_Preempted):
    first.train(_CrashAt(ds, 9))
  first.checkpoint_manager.close()
  assert first.train_steps == 4

  resumed_model = _model(
      seed=7
  )  # different init: everything must come from the checkpoint
  resumed = trainer_lib.BlockDiffusionTrainer(
      resumed_model, optimizer(), config(tmp_path), dcfg
  )
  assert resumed.train_steps == 4 and resumed.iter_steps == 8
  resumed.train(ds)
  assert resumed.train_steps == 6
  assert _max_diff(_params(resumed_model), _params(uninterrupted)) < 1e-6
  assert _max_diff(_params(resumed_model), _params(_model())) > 1e-3


@pytest.mark.parametrize(
    "stream, alignment, weighting",
    [
        ("single", "same_position", "uniform"),
        ("two_stream", "shifted", "elbo"),
        ("clean_prefix", "same_position", "elbo"),
    ],
)
def test_loss_is_invariant_to_packing_and_context_parallel_order(
    stream, alignment, weighting
):
  dcfg = config_lib.BlockDiffusionConfig(
      block_size=4,
      mask_token_id=MASK,
      stream=stream,
      alignment=alignment,
      canvas="seed_and_mask" if alignment == "shifted" else "all_masked",
      loss_weighting=weighting,
  )
  examples = _examples([(3, 5), (2, 6), (4, 3), (1, 7)], seed=4)
  docs = [data.encode_document(ex, dcfg, seed=0, epoch=0) for ex in examples]
  model = _model()
  loss_fn = jax.jit(
      lambda batch: trainer_lib.make_diffusion_loss_fn(dcfg)(
          model, **trainer_lib.diffusion_model_inputs(batch)
      )
  )

  def totals(batch):
    out = loss_fn(batch)
    return float(out.primary_loss.unreduced_sum), float(
        out.primary_loss.denominator
    )

  unpacked = data.assemble_rows([[d] for d in docs], seq_len=SEQ, block_size=4)
  reference = totals(unpacked)
  assert reference[1] > 0 and np.isfinite(reference[0])
  packed = data.assemble_rows(
      [docs[:2], docs[2:]], seq_len=SEQ, block_size=4, packing="unaligned"
  )
  aligned = data.assemble_rows(
      [docs[:2], docs[2:]], seq_len=SEQ, block_size=4, packing="block_aligned"
  )
  # Packed documents see only themselves; reordered slots keep their logits.
  for batch in (packed, aligned, data.reorder_batch(packed, 2)):
    got = totals({k: v for k, v in batch.items()} | {})
    np.testing.assert_allclose(got, reference, rtol=2e-5)


def test_two_stream_loss_matches_inference_context():
  """Two-stream logits of a block equal those of its clean prefix + itself."""
  examples = _examples([(3, 9)], seed=5)
  dcfg = dataclasses.replace(DCFG, stream="two_stream")
  batch = data.assemble_rows(
      [[data.encode_document(examples[0], dcfg, seed=0, epoch=0)]],
      seq_len=SEQ,
      block_size=4,
  )
  model = _model()
  fields = ("tokens", "positions", "segment_ids", "validity")

  @jax.jit
  def logits(canvas):
    return trainer_lib.diffusion_logits(
        model,
        dataclasses.replace(dcfg, stream="single"),
        inputs=canvas,
        **{k: batch[k] for k in fields},
    )

  two = jax.jit(
      lambda: trainer_lib.diffusion_logits(
          model, dcfg, inputs=batch["inputs"], **{k: batch[k] for k in fields}
      )
  )()
  n = int(batch["validity"].sum())
  for block in range(-(-n // 4)):
    # The canvas seen at inference: earlier blocks clean, this block noised.
    canvas = np.where(
        np.arange(SEQ) < 4 * block, batch["tokens"], batch["inputs"]
    )
    span = slice(4 * block, min(4 * block + 4, n))
    np.testing.assert_allclose(two[0, span], logits(canvas)[0, span], atol=2e-5)


def test_trainer_rejects_bad_configs_and_batches():
  with pytest.raises(
      TypeError, match="diffusion_config must be a BlockDiffusionConfig"
  ):
    trainer_lib.BlockDiffusionTrainer(
        _model(), optax.sgd(0.1), _config(), {"block_size": 4}
    )
  with pytest.raises(ValueError, match="batch is missing fields"):
    trainer_lib.diffusion_model_inputs({"tokens": np.zeros((1, 4), np.int32)})
  with pytest.raises(
      ValueError, match="gradient_accumulation_steps must be >= 1"
  ):
    trainer_lib.BlockDiffusionTrainer(
        _model(), optax.sgd(0.1), _config(gradient_accumulation_steps=0), DCFG
    )


def test_with_diffusion_config_switches_the_objective(micro_batches):
  small, _, _ = micro_batches
  trainer = trainer_lib.BlockDiffusionTrainer(
      _model(), optax.sgd(0.1), _config(), DCFG
  )
  two = dataclasses.replace(DCFG, stream="two_stream")
  assert trainer.with_diffusion_config(two) is trainer
  assert trainer.diffusion_config == two
  assert (
      trainer.custom_checkpoint_metadata()["diffusion_config"]["stream"]
      == "two_stream"
  )
  fields = ("inputs", "tokens", "positions", "segment_ids", "validity")

  @jax.jit
  def both(batch):
    out = trainer.loss_fn(
        trainer.model, **trainer_lib.diffusion_model_inputs(batch)
    )
    reference = loss_lib.diffusion_loss(
        trainer_lib.diffusion_logits(
            trainer.model, two, **{k: batch[k] for k in fields}
        ),
        batch["targets"],
        batch["loss_weights"],
    )
    return out.primary_loss.unreduced_sum, reference.primary_loss.unreduced_sum

  got, want = both(small)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_certainty_weight_reaches_the_trainer_loss(micro_batches):
  small, _, _ = micro_batches
  on = dataclasses.replace(DCFG, certainty_weight=0.5, certainty_temperature=2.0)
  model = _model()
  fields = ("inputs", "tokens", "positions", "segment_ids", "validity")

  @jax.jit
  def both(batch):
    out = trainer_lib.make_diffusion_loss_fn(on)(
        model, **trainer_lib.diffusion_model_inputs(batch)
    )
    reference = loss_lib.diffusion_loss(
        trainer_lib.diffusion_logits(model, on, **{k: batch[k] for k in fields}),
        batch["targets"],
        batch["loss_weights"],
        certainty_weight=0.5,
        certainty_temperature=2.0,
    )
    return out, reference

  got, want = both(small)
  assert "certainty" in got.aux_metrics
  np.testing.assert_allclose(
      got.primary_loss.unreduced_sum, want.primary_loss.unreduced_sum, rtol=1e-6
  )
  np.testing.assert_allclose(
      got.aux_metrics["certainty"].unreduced_sum,
      want.aux_metrics["certainty"].unreduced_sum,
      rtol=1e-6,
  )


@pytest.mark.parametrize(
    "stream,alignment",
    [("single", "same_position"), ("two_stream", "shifted")])
def test_head_chunk_gives_the_same_loss_and_gradients(stream, alignment):
  dcfg = dataclasses.replace(
      DCFG, stream=stream, alignment=alignment, certainty_weight=0.3,
      canvas="all_masked" if alignment == "same_position" else "seed_and_mask")
  batch = _batch([(2, 12), (1, 14), (4, 1), (3, 2)], seed=3, dcfg=dcfg)
  graphdef, state = nnx.split(_model())

  @jax.jit
  def value_and_grads(state, batch):
    def loss(chunk):
      fn = trainer_lib.make_diffusion_loss_fn(dcfg, head_chunk=chunk)
      return lambda s: fn(nnx.merge(graphdef, s), **trainer_lib
                          .diffusion_model_inputs(batch)).primary_loss.unreduced_sum
    return (jax.value_and_grad(loss(None))(state),
            jax.value_and_grad(loss(5))(state))

  (want, want_grads), (got, got_grads) = value_and_grads(state, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert len(jax.tree.leaves(got_grads)) == len(jax.tree.leaves(want_grads))
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_head_chunk_is_checked_before_any_compute():
  with pytest.raises(ValueError, match="head_chunk must be >= 1"):
    trainer_lib.BlockDiffusionTrainer(_model(), optax.sgd(0.1), _config(),
                                      DCFG, head_chunk=0)
  with pytest.raises(TypeError, match="head_chunk must be an int"):
    trainer_lib.make_diffusion_loss_fn(DCFG, head_chunk=1.5)
