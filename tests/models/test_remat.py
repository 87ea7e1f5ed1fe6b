"""`models.remat`: rematerialised layers give the same loss and gradients.

The policy is set only while a loss is traced; the model's config is back to
its own setting afterwards, so decoding never runs under it.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.models import remat
from tunix_blockdiff.models import tiny as tiny_models

VOCAB, L = 32, 16


def _inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB - 1, (2, L)).astype(np.int32)
  inputs = np.where(rng.random((2, L)) < 0.5, VOCAB - 1, tokens)
  return dict(
      inputs=inputs, tokens=tokens, targets=tokens,
      positions=np.broadcast_to(np.arange(L), (2, L)).astype(np.int32),
      segment_ids=np.zeros((2, L), np.int32),
      validity=np.ones((2, L), bool),
      loss_weights=(inputs == VOCAB - 1).astype(np.float32))


@pytest.mark.parametrize("family,policy", [("tiny_qwen3", "decoder"),
                                           ("tiny_gemma3", "block")])
def test_remat_keeps_loss_and_gradients(family, policy):
  model = getattr(tiny_models, family)(VOCAB, seed=0, random_mlp=True)
  config = config_lib.BlockDiffusionConfig(block_size=4,
                                           mask_token_id=VOCAB - 1)
  batch = _inputs()
  graphdef, state = nnx.split(model, nnx.Param)
  rest = nnx.state(model, nnx.Not(nnx.Param))

  def loss_and_grad(policy):
    loss_fn = trainer_lib.make_diffusion_loss_fn(config, remat=policy)

    def loss(params):
      m = nnx.merge(graphdef, params, rest)
      out = loss_fn(m, **batch).primary_loss
      return out.unreduced_sum / out.denominator

    grad_fn = jax.value_and_grad(loss)
    # One compiled program (op by op: ~230 programs).
    return jax.jit(grad_fn)(state), str(jax.make_jaxpr(grad_fn)(state))

  (want_loss, want_grad), plain = loss_and_grad("none")
  (got_loss, got_grad), remat_jaxpr = loss_and_grad(policy)
  # The policy took effect (a checkpointed region in the program), and only
  # the rounding of the recomputation differs.
  assert "remat" in remat_jaxpr and "remat" not in plain
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
  assert model.config.remat_config.name == "NONE"


def test_bad_policies_and_models_are_refused():
  with pytest.raises(ValueError, match="remat must be one of"):
    remat.check_policy("layer")
  with pytest.raises(ValueError, match="remat must be one of"):
    trainer_lib.make_diffusion_loss_fn(
        config_lib.BlockDiffusionConfig(block_size=4, mask_token_id=1),
        remat="all")
  with pytest.raises(ValueError, match="no Tunix remat_config"):
    with remat.remat_scope(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "block"):
      pass
  with remat.remat_scope(jnp.zeros(()), "none"):  # a no-op for any model
    pass
