"""Generation from a qwix LoRA model (modules that mutate themselves when called)."""

from flax import nnx
import jax
import numpy as np
import qwix

import tunix_blockdiff as tbd
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.runs import model_setup


def test_lora_model_generates_like_its_merged_weights():
  base = tiny_models.tiny_qwen3(32, seed=1)
  lora = model_setup.traced_lora(
      base,
      qwix.LoraProvider(module_path=".*q_proj|.*v_proj", rank=2, alpha=4.0),
      seed=2,
  )
  # qwix starts B at zero (LoRA is the identity); make it matter.
  state = nnx.state(lora, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(3), 64))
  nnx.update(
      lora,
      jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape), state),
  )
  merged = checkpoints.merge_lora(lora, base, rank=2, alpha=4.0)
  config = tbd.DenoiseConfig(block_size=4, mask_token_id=3, steps_per_block=2)
  prompts = np.array([[5, 6, 7, 8, 9], [0, 0, 5, 6, 7]], np.int32)
  lengths = np.array([5, 3], np.int32)
  cached = tbd.generate(lora, prompts, lengths, config, max_new_tokens=6)
  cacheless = tbd.generate(
      lora, prompts, lengths, config, max_new_tokens=6, use_cache=False
  )
  reference = tbd.generate(merged, prompts, lengths, config, max_new_tokens=6)
  np.testing.assert_array_equal(cached.tokens, cacheless.tokens)
  np.testing.assert_array_equal(cached.commit_step, cacheless.commit_step)
  np.testing.assert_array_equal(cached.tokens, reference.tokens)
  # The perturbed adapters change the model: the base weights alone differ.
  positions = np.broadcast_to(np.arange(5), (2, 5))
  assert not np.allclose(
      tbd.block_diffusion_logits(merged, prompts, positions, block_size=4),
      tbd.block_diffusion_logits(base, prompts, positions, block_size=4),
  )
