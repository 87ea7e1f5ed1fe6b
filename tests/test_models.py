"""Every Tunix family through `models`, the trainer and `make_logits_fn`."""

import dataclasses
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import omegaconf
import optax
import pytest
import qwix
from tunix.sft import peft_trainer

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff import models
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.runs import model_setup

VOCAB, MASK, SEQ, BLOCK = 64, 3, 16, 4
DCFG = config_lib.BlockDiffusionConfig(block_size=BLOCK, mask_token_id=MASK)
SIZES = dict(
    num_layers=1,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
)


def _tiny(family, **kwargs):
  return getattr(tiny_models, f"tiny_{family}")(VOCAB, **(SIZES | kwargs))


def _packed_batch(seed=0):
  """Two rows, two documents each (segment ids 1 and 2), corrupted."""
  rng = np.random.default_rng(seed)
  raw = [
      (rng.integers(4, VOCAB, p).tolist(), rng.integers(4, VOCAB, c).tolist())
      for p, c in [(2, 5), (3, 4), (1, 6), (2, 3)]
  ]
  examples = data.as_examples(
      raw, seq_len=SEQ, vocab_size=VOCAB, mask_token_id=MASK
  )
  docs = [data.encode_document(ex, DCFG, seed=seed, epoch=0) for ex in examples]
  batch = data.assemble_rows(
      [docs[:2], docs[2:]],
      seq_len=SEQ,
      block_size=BLOCK,
      packing="block_aligned",
  )
  assert np.asarray(batch["segment_ids"]).max() == 2
  return batch


@pytest.mark.parametrize("family", models.FAMILIES)
def test_build_tiny_kinds(family):
  """The recipe's sizes, seed and random_mlp reach the tiny builder."""
  cfg = omegaconf.OmegaConf.create(
      {"kind": f"tiny_{family}", "vocab_size": VOCAB, "random_mlp": True}
      | SIZES
  )
  model = models.build_model(cfg, seed=3)
  want = _tiny(family, seed=3, random_mlp=True)
  assert type(model) is type(want)
  assert models.model_vocab_size(model) == VOCAB
  got = nnx.to_flat_state(nnx.state(model, nnx.Param))
  for (path, a), (_, b) in zip(
      got, nnx.to_flat_state(nnx.state(want, nnx.Param))
  ):
    np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=path)
  assert np.any(np.asarray(model.layers[0].mlp.down_proj.kernel.value))


def test_build_model_errors_and_gemma3_window():
  with pytest.raises(ValueError, match="model.kind must be one of"):
    models.build_model(omegaconf.OmegaConf.create({"kind": "gpt2"}), seed=0)
  cfg = omegaconf.OmegaConf.create(
      {"kind": "tiny_gemma3", "vocab_size": VOCAB, "sliding_window_size": 8}
      | SIZES
  )
  assert models.sliding_window(models.build_model(cfg, seed=0)) == 8
  assert models.sliding_window(_tiny("qwen3")) is None


def test_model_vocab_size_sources():
  assert models.model_vocab_size(_tiny("gemma3")) == VOCAB  # num_embed

  class NoConfig(nnx.Module):

    def __init__(self):
      self.embed = nnx.Param(jnp.zeros((7, 3)))

  assert models.model_vocab_size(NoConfig()) == 7
  with pytest.raises(ValueError, match="cannot tell the vocabulary size"):
    models.model_vocab_size(object())


# Qwen3: tests/test_trainer.py in depth.
@pytest.mark.parametrize("family", ["qwen2", "llama3", "gemma3"])
def test_trainer_trains_every_family(family):
  """Packed rows (segment ids) train: finite nonzero gradients, loss falls."""
  model = _tiny(family, random_mlp=True)
  batch = _packed_batch()
  inputs = trainer_lib.diffusion_model_inputs(batch)
  loss_fn = trainer_lib.make_diffusion_loss_fn(DCFG)

  @nnx.jit
  def loss_and_grads(model):
    return nnx.value_and_grad(
        lambda m: loss_fn(m, **inputs).primary_loss.compute()
    )(model)

  before, grads = loss_and_grads(model)
  assert np.isfinite(float(before))
  for path, grad in nnx.to_flat_state(grads):
    grad = np.asarray(grad.get_value())
    assert np.all(np.isfinite(grad)), path
    assert np.abs(grad).max() > 0, f"no gradient reaches {path}"
  trainer_lib.BlockDiffusionTrainer(
      model,
      optax.adam(1e-2),
      peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=4),
      DCFG,
  ).train([batch] * 4)
  after, _ = loss_and_grads(model)
  assert float(after) < float(before) - 0.05


def test_tunix_zero_mlps_get_no_gradient():
  """Why `random_mlp` exists: Tunix's zero feed-forward init is a saddle."""
  model = _tiny("qwen3", num_layers=2)
  loss_fn = trainer_lib.make_diffusion_loss_fn(DCFG)
  inputs = trainer_lib.diffusion_model_inputs(_packed_batch())
  grads = nnx.jit(
      nnx.grad(lambda m: loss_fn(m, **inputs).primary_loss.compute())
  )(model)
  for layer in grads["layers"].values():
    for name in ("gate_proj", "up_proj", "down_proj"):
      assert not np.any(np.asarray(layer["mlp"][name]["kernel"].get_value()))


def test_zero_output_projections_start_as_identity_and_are_no_saddle():
  """`mlp_out_scale=0`: blocks start as the identity, yet every kernel learns.

  At the draw the feed-forward blocks add nothing (the logits equal those
  of the same model with Tunix's zero feed-forward kernels), the down
  kernels get a gradient at once, and after one step so do gate and up.
  """
  cfg = omegaconf.OmegaConf.create(
      {"kind": "tiny_qwen3", "vocab_size": VOCAB, "random_mlp": True,
       "mlp_out_scale": 0.0} | SIZES)
  model = models.build_model(cfg, seed=3)
  layer = model.layers[0].mlp
  assert not np.any(np.asarray(layer.down_proj.kernel.value))
  assert np.any(np.asarray(layer.gate_proj.kernel.value))
  zero = _tiny("qwen3", seed=3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 8)))
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  mask = jnp.ones((2, 8, 8), bool)
  np.testing.assert_allclose(
      np.asarray(model(tokens, positions, None, mask)[0]),
      np.asarray(zero(tokens, positions, None, mask)[0]), atol=1e-6)
  loss_fn = trainer_lib.make_diffusion_loss_fn(DCFG)
  inputs = trainer_lib.diffusion_model_inputs(_packed_batch())
  grad_fn = nnx.jit(
      nnx.grad(lambda m: loss_fn(m, **inputs).primary_loss.compute()))
  grads = grad_fn(model)["layers"][0]["mlp"]
  assert np.any(np.asarray(grads["down_proj"]["kernel"].get_value()))
  trainer_lib.BlockDiffusionTrainer(
      model, optax.sgd(0.1),
      peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=1),
      DCFG).train([_packed_batch()])
  grads = grad_fn(model)["layers"][0]["mlp"]
  for name in ("gate_proj", "up_proj"):
    assert np.any(np.asarray(grads[name]["kernel"].get_value())), name
  with pytest.raises(ValueError, match="model.mlp_out_scale must be >= 0"):
    models.build_model(
        omegaconf.OmegaConf.merge(cfg, {"mlp_out_scale": -1.0}), seed=0)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_make_logits_fn_is_the_block_causal_model_call(family):
  # Gemma3 with a window (5) shorter than the row: the band acts in both.
  model = _tiny(
      family, **({"sliding_window_size": 5} if family == "gemma3" else {})
  )
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 10)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
  logits_fn = modeling.make_logits_fn(model, block_size=BLOCK)
  block = np.arange(10) // BLOCK
  mask = jnp.asarray(block[None, :] <= block[:, None])[None].repeat(2, 0)

  @jax.jit
  def both(tokens, positions):
    return logits_fn(tokens, positions), model(tokens, positions, None, mask)[0]

  got, want = both(tokens, positions)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_packed_rows_without_model_segment_ids(family):
  """Llama3/Gemma3 take no segment_ids: each document sees only itself."""
  model = _tiny(family)
  rng = np.random.default_rng(1)
  first = rng.integers(0, VOCAB, 8)
  second = rng.integers(0, VOCAB, 4)
  tokens = jnp.asarray(np.concatenate([first, second])[None], jnp.int32)
  positions = jnp.asarray(np.r_[np.arange(8), np.arange(4)][None], jnp.int32)
  segments = jnp.asarray(np.r_[[1] * 8, [2] * 4][None], jnp.int32)
  logits = nnx.jit(
      functools.partial(modeling.block_diffusion_logits, block_size=BLOCK)
  )
  packed = logits(model, tokens, positions, segment_ids=segments)
  alone = logits(
      model, jnp.asarray(second[None], jnp.int32), jnp.arange(4)[None]
  )
  np.testing.assert_allclose(packed[:, 8:], alone, rtol=1e-5, atol=1e-5)


def test_two_stream_refuses_a_window_it_would_apply_wrongly():
  model = _tiny("gemma3", sliding_window_size=2 * SEQ - 1)
  batch = _packed_batch()
  loss_fn = trainer_lib.make_diffusion_loss_fn(
      dataclasses.replace(DCFG, stream="two_stream")
  )
  inputs = trainer_lib.diffusion_model_inputs(batch)
  loss = nnx.jit(lambda m: loss_fn(m, **inputs).primary_loss.compute())
  with pytest.raises(ValueError, match="two-stream.*sliding window"):
    loss(model)
  assert np.isfinite(float(loss(_tiny("gemma3", sliding_window_size=2 * SEQ))))


def test_lora_on_gemma3_einsums_trains_but_does_not_merge():
  """qwix LoRA reaches Gemma3's attention einsums; merge_lora refuses them."""
  lora = model_setup.traced_lora(
      _tiny("gemma3"),
      qwix.LoraProvider(module_path=".*einsum|.*_proj", rank=2, alpha=4.0),
      seed=0,
  )
  names = {p[-2] for p, _ in nnx.to_flat_state(nnx.state(lora, nnx.LoRAParam))}
  assert {"q_einsum", "kv_einsum", "attn_vec_einsum", "down_proj"} <= names
  with pytest.raises(ValueError, match="einsum weights"):
    checkpoints.merge_lora(lora, _tiny("gemma3"), rank=2, alpha=4.0)


def test_every_bundled_tiny_recipe_draws_its_feed_forward_kernels():
  """Trained from scratch, a model needs random MLPs (Tunix's are zero)."""
  import omegaconf  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff.runs import common  # pylint: disable=g-import-not-at-top

  tiny = omegaconf.OmegaConf.load(common.recipe_path("tiny.yaml"))
  assert tiny.model.kind.startswith("tiny_") and tiny.model.random_mlp is True
  for name, section in (("rl_tiny.yaml", "init"), ("opd_tiny.yaml", "student")):
    cfg = omegaconf.OmegaConf.load(common.recipe_path(name))
    assert cfg[section].sft_recipe == "tiny.yaml"  # inherits model.random_mlp
    assert not any("random_mlp" in o for o in cfg[section].sft_overrides)
  opd = omegaconf.OmegaConf.load(common.recipe_path("opd_tiny.yaml"))
  assert opd.teacher.random_mlp is True


def test_tiny_diffusion_gemma_takes_config_overrides_and_sharpens():
  plain = tiny_models.tiny_diffusion_gemma(15, seed=3)
  sharp = tiny_models.tiny_diffusion_gemma(15, seed=3, embedding_scale=3.0,
                                           num_experts=2, top_k_experts=1,
                                           moe_intermediate_size=8)
  assert plain.config.vocab_size == 15 and plain.config.num_experts is None
  assert sharp.config.num_experts == 2 and sharp.config.canvas_length == 4
  np.testing.assert_allclose(np.asarray(sharp.embedding[...]),
                             3.0 * np.asarray(plain.embedding[...]),
                             rtol=1e-6)
