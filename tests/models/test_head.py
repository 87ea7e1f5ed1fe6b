"""Tests for models.head: a Tunix model split at its output head."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.models import head as head_lib
from tunix_blockdiff.models import tiny as tiny_models

VOCAB = 40


def _tied_qwen3():
  config = dataclasses.replace(tiny_models.qwen3_config(VOCAB, num_layers=1),
                               use_tied_embedding=True)
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))


def _bf16_qwen3():
  config = dataclasses.replace(tiny_models.qwen3_config(VOCAB, num_layers=1),
                               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))


FAMILIES = {
    "qwen3 (untied)": lambda: tiny_models.tiny_qwen3(VOCAB, num_layers=1),
    "qwen3 (tied)": _tied_qwen3,
    "qwen3 (bfloat16)": _bf16_qwen3,
    "qwen2": lambda: tiny_models.tiny_qwen2(VOCAB, num_layers=1),
    "llama3": lambda: tiny_models.tiny_llama3(VOCAB, num_layers=1),
    "gemma3": lambda: tiny_models.tiny_gemma3(VOCAB, num_layers=1),
}


def _call(model, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
  return model(tokens, positions, None, mask)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_head_of_headless_states_is_the_models_logits(family):
  model = FAMILIES[family]()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 7)))
  view = head_lib.headless(model)
  hidden = _call(view.model, tokens)
  assert hidden.shape[:2] == (2, 7) and hidden.shape[2] != VOCAB
  logits = head_lib.output_head(model)(hidden.astype(view.dtype))
  want = _call(model, tokens)  # the model itself is left whole
  assert want.shape == (2, 7, VOCAB) and logits.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(logits),
                                np.asarray(want, np.float32))


def test_headless_gradients_reach_the_shared_weights():
  model = tiny_models.tiny_qwen3(VOCAB, num_layers=1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 5)))

  def split(m):
    view = head_lib.headless(m)
    return jnp.sum(head_lib.output_head(m)(_call(view.model, tokens)) ** 2)

  def whole(m):
    return jnp.sum(_call(m, tokens) ** 2)

  # Each gradient as one compiled program (op by op: ~190 programs).
  got = nnx.jit(nnx.grad(split))(model)
  want = nnx.jit(nnx.grad(whole))(model)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_model_without_a_known_head_is_refused():
  class Headless(nnx.Module):
    config = None

  with pytest.raises(ValueError, match="head_chunk.*embedder.decode"):
    head_lib.check_splittable(Headless())
  with pytest.raises(ValueError, match="head_chunk"):
    head_lib.headless(Headless())
