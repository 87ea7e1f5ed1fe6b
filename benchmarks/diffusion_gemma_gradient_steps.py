"""How a DiffusionGemma trajectory's exact log-prob moves along its gradient.

One process, a tiny random DiffusionGemma (vocabulary 15, canvas 4, two
layers), one `DiffusionGemmaRollout` call on 4 prompts. The `dg_grpo` loss
with advantages A = [1, -1, 0.5, -0.5] gives a gradient g. The parameters
take steps of L2 length eta along -g, for several eta. At each step each
row's exact trajectory log-prob (`DiffusionGemmaRollout.score`, acceptance
recomputed under the new parameters) is compared with its first-order
prediction (eta times the row's slope at the rollout's parameters, the
slope measured at the smallest eta).

A smooth likelihood changes linearly at small eta. The entropy-bound
acceptance is a step function of the logits, so where a step changes an
accepted set, a row's log-prob jumps. The gradient never sees those jumps
(see docs/diffusion_gemma.md, "RL" and "On-policy distillation").

    python benchmarks/diffusion_gemma_gradient_steps.py
    tunix-blockdiff bench diffusion_gemma_gradient_steps --seeds 3
"""

from __future__ import annotations

import argparse
import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import function_registry
from tunix.rl.rollout import base_rollout

import tunix_blockdiff
from tunix_blockdiff import tasks
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models import tiny
from tunix_blockdiff.kinds.diffusion_gemma import grpo as dg_grpo
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib

TOKENIZER = tasks.CharTokenizer(alphabet="0123456789rev >")
SAMPLER = dg.SamplerConfig(max_denoising_steps=4, entropy_bound=0.6,
                           t_min=0.5, t_max=1.0, confidence_threshold=0.5)
ROLLOUT = base_rollout.RolloutConfig(max_tokens_to_generate=8,
                                     max_prompt_length=9)
PROMPTS = ["rev 12>", "rev 12>", "rev 345>", "rev 345>"]
ADVANTAGES = np.array([1.0, -1.0, 0.5, -0.5])
ETAS = (1e-5, 1e-4, 1e-3, 1e-2)


def _model(seed: int) -> dg.DiffusionGemma:
  return tiny.tiny_diffusion_gemma(TOKENIZER.vocab_size, seed=seed,
                                   embedding_scale=3.0)


def measure(seed: int) -> dict:
  """Per eta: each row's log-prob change and its first-order prediction."""
  engine = engine_lib.DiffusionGemmaRollout(_model(seed), TOKENIZER,
                                            sampler_config=SAMPLER, seed=1)
  out = engine.generate(PROMPTS, ROLLOUT)
  mask = dg_rollout.valid_mask(out.left_padded_prompt_tokens.shape[1],
                               out.prompt_lengths)
  example = dg_grpo.DiffusionGemmaTrainExample(
      prompt_ids=jnp.asarray(out.left_padded_prompt_tokens),
      prompt_mask=jnp.asarray(mask),
      completion_ids=jnp.asarray(out.trace.tokens),
      completion_mask=jnp.ones(out.trace.tokens.shape, jnp.int32),
      advantages=jnp.asarray(ADVANTAGES, jnp.float32),
      ref_per_token_logps=None, old_per_token_logps=None,
      trace=jax.tree.map(jnp.asarray, out.trace))
  algo = dg_grpo.DiffusionGemmaGRPOConfig(
      num_generations=2, sampler_config=engine.sampler_config, beta=0.0)
  loss_fn = function_registry.get_policy_loss_fn("dg_grpo")
  model = engine.model()
  grads = nnx.grad(lambda m: loss_fn(m, example, algo).primary_loss.compute())(
      model)
  norm = float(np.sqrt(sum(float(jnp.sum(g ** 2))
                           for g in jax.tree.leaves(grads))))
  graphdef, state = nnx.split(model)

  def score(eta: float) -> np.ndarray:
    moved = jax.tree.map(lambda p, g: p - eta * g / norm, state,
                         nnx.state(grads))
    return np.asarray(engine.score(nnx.merge(graphdef, moved),
                                   example.prompt_ids, example.prompt_mask,
                                   out.trace), np.float64)

  base = score(0.0)
  changes = {eta: score(eta) - base for eta in ETAS}
  slope = changes[ETAS[0]] / ETAS[0]
  return {
      "seed": seed,
      "gradient_norm": norm,
      "steps": [{"eta": eta, "change": changes[eta].round(4).tolist(),
                 "first_order": (slope * eta).round(4).tolist(),
                 "sum_advantage_times_change": float(
                     (ADVANTAGES * changes[eta]).sum())}
                for eta in ETAS],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=1,
                      help="models to measure (seeds 0..N-1)")
  args = parser.parse_args()
  tunix_blockdiff.register()
  for seed in range(args.seeds):
    result = measure(seed)
    print(json.dumps(result))
    for step in result["steps"]:
      print(f"seed {seed} eta {step['eta']:g}: change {step['change']}"
            f" first-order {step['first_order']}"
            f" sum A*change {step['sum_advantage_times_change']:+.4f}")


if __name__ == "__main__":
  main()
