"""Tests for on-policy distillation into a block-diffusion student."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tunix.rl import function_registry

import tunix_blockdiff
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import opd
from tunix_blockdiff.rl import scoring

tunix_blockdiff.register()

VOCAB, MASK, EOS = 40, 3, 2
CONFIG = config_lib.DenoiseConfig(
    block_size=4,
    mask_token_id=MASK,
    threshold=0.3,
    temperature=1.0,
    eos_token_id=EOS,
)


@functools.lru_cache(maxsize=None)
def _models():
  student = tiny_models.tiny_qwen3(VOCAB, seed=1, num_layers=1)
  teacher = tiny_models.tiny_qwen3(VOCAB, seed=2, num_layers=1)
  return student, teacher


def _trajectories(seed=0, batch=4, width=6, num_new=8):
  rs = np.random.RandomState(seed)
  lengths = rs.randint(1, width + 1, size=batch)
  prompt_mask = np.arange(width)[None] >= width - lengths[:, None]
  prompts = np.where(prompt_mask, rs.randint(4, VOCAB, size=(batch, width)), 0)
  tokens = rs.randint(4, VOCAB, size=(batch, num_new))
  tokens[0, 5] = EOS  # row 0 stops at slot 5; later slots are not scored
  steps = np.full((batch, num_new), -1)
  for b in range(batch):
    block = (lengths[b] + np.arange(num_new)) // CONFIG.block_size
    order = np.lexsort((rs.rand(num_new), block))
    steps[b, order] = np.arange(num_new)
  return (
      prompts.astype(np.int32),
      prompt_mask,
      tokens.astype(np.int32),
      steps.astype(np.int32),
  )


@functools.lru_cache(maxsize=None)
def _student_batch():
  prompts, prompt_mask, tokens, steps = _trajectories()
  scored = opd.through_first_eos(steps, tokens, EOS)
  assert scored[0].sum() == 6 and scored[1:].all()
  return scoring.prepare_trajectory_batch(
      prompts,
      prompt_mask,
      tokens,
      steps,
      mask_token_id=MASK,
      loss_weights=scored.astype(np.float32),
  )


def test_one_opd_step_lowers_the_divergence_on_a_fixed_batch():
  student, teacher = _models()
  student = nnx.clone(student)
  batch = opd.DiffusionDistillationBatch(
      student_batch=_student_batch(),
      teacher_logits=opd.teacher_logits(
          teacher, "ar", _student_batch(), CONFIG
      ),
  )
  logits_fn = scoring.trajectory_logits_fn_for(CONFIG)
  optimizer = nnx.Optimizer(student, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def step(student, optimizer):
    def objective(model):
      out = opd.diffusion_opd_loss_fn(
          model, batch, logits_fn, exclude_token_id=MASK
      )
      return out.primary_loss.compute(), out

    (loss, out), grads = nnx.value_and_grad(objective, has_aux=True)(student)
    optimizer.update(student, grads)
    return loss, out.aux_metrics["divergence"].compute()

  before, estimate = step(student, optimizer)
  np.testing.assert_allclose(before, estimate, rtol=1e-6)
  after, _ = step(student, optimizer)
  assert float(before) > 0.1
  assert float(after) < float(before)


def test_ar_teacher_logits_are_next_token_logits_in_its_own_context():
  _, teacher = _models()
  batch = _student_batch()
  inputs = batch.model_inputs
  # One compiled program each (op by op: ~140 programs).
  got = nnx.jit(opd.ar_teacher_logits)(
      teacher,
      inputs["prompt_tokens"],
      inputs["prompt_mask"],
      inputs["completion_tokens"],
      batch.loss_weights,
  )
  # Row 1 alone, unpadded, through the plain causal model.
  prompt = np.asarray(inputs["prompt_tokens"][1])[
      np.asarray(inputs["prompt_mask"][1])
  ]
  sequence = np.concatenate(
      [prompt, np.asarray(inputs["completion_tokens"][1])]
  )
  length = len(sequence)
  logits, _ = nnx.jit(lambda m, *a: m(*a))(
      teacher,
      jnp.asarray(sequence)[None],
      jnp.arange(length)[None],
      None,
      jnp.tril(jnp.ones((1, length, length), bool)),
  )
  expected = np.asarray(logits[0, len(prompt) - 1 : -1])
  np.testing.assert_allclose(got[1], expected, atol=2e-5)


def test_registered_bd_opd_trains_on_a_sampled_token_train_example():
  student, teacher = _models()
  batch = _student_batch()
  teacher_log_probs = jax.nn.log_softmax(
      opd.teacher_logits(teacher, "ar", batch, CONFIG)
      .at[..., MASK]
      .set(-jnp.inf)
  )
  inputs = batch.model_inputs
  example = grpo.BlockDiffusionTrainExample(
      prompt_ids=inputs["prompt_tokens"],
      prompt_mask=inputs["prompt_mask"],
      completion_ids=inputs["completion_tokens"],
      completion_mask=batch.loss_weights.astype(jnp.int32),
      advantages=jnp.zeros((4,)),
      ref_per_token_logps=None,
      old_per_token_logps=None,
      commit_step=inputs["commit_step"],
      teacher_per_token_logps=jnp.take_along_axis(
          teacher_log_probs, batch.target_ids[..., None], axis=-1
      )[..., 0],
  )
  loss_fn = function_registry.get_policy_loss_fn("bd_opd")
  losses, grads = {}, {}
  for kind in ("exact", "committed_only"):
    algo = opd.BlockDiffusionOPDConfig(
        estimator="sampled_token",
        divergence="jsd",
        beta=0.5,
        denoise_config=CONFIG,
        likelihood=kind,
    )
    losses[kind], grad = nnx.jit(
        nnx.value_and_grad(
            lambda m, a=algo: loss_fn(m, example, a).primary_loss.compute()
        )
    )(student)
    grads[kind] = [np.asarray(g) for g in jax.tree.leaves(grad)]
    assert all(np.all(np.isfinite(g)) for g in grads[kind])
    assert sum(float(np.abs(g).sum()) for g in grads[kind]) > 0
  # Same estimate; the exact likelihood changes only the score function.
  np.testing.assert_allclose(
      losses["exact"], losses["committed_only"], rtol=1e-5
  )
  assert any(
      not np.allclose(a, b)
      for a, b in zip(grads["exact"], grads["committed_only"])
  )


def test_bad_configurations_raise():
  student, _ = _models()
  # Abstract (shape-only) model: its vocabulary is all this check reads.
  wider_teacher = nnx.eval_shape(
      lambda: tiny_models.tiny_qwen3(VOCAB + 8, seed=0, num_layers=1)
  )
  with pytest.raises(ValueError, match="vocabulary"):
    opd.check_vocab_match(
        opd.model_vocab_size(wider_teacher), opd.model_vocab_size(student)
    )
  logits_fn = scoring.trajectory_logits_fn_for(CONFIG)
  batch = _student_batch()
  mismatched = opd.DiffusionDistillationBatch(
      student_batch=batch,
      teacher_logits=jnp.zeros(batch.target_ids.shape + (VOCAB + 8,)),
  )
  with pytest.raises(ValueError, match="vocabulary"):
    opd.diffusion_opd_loss_fn(student, mismatched, logits_fn)
  with pytest.raises(ValueError, match="teacher_logits"):
    opd.diffusion_opd_loss_fn(
        student, opd.DiffusionDistillationBatch(student_batch=batch), logits_fn
    )
  with pytest.raises(ValueError, match="divergence must be one of"):
    opd.BlockDiffusionOPDConfig(divergence="tv")
  with pytest.raises(ValueError, match="teacher_kind"):
    opd.teacher_logits(student, "encoder", batch, CONFIG)
