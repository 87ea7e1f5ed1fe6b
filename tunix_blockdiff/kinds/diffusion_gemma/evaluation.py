"""Held-out evaluation of a DiffusionGemma policy in the rl job.

`greedy_rewards` scores the held-out prompts under the greedy sampler with
noise fixed by a seed, so the before and after figures are paired;
`reward_gain` turns them into means, standard errors and the paired gain
that `summary.json` reports.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
from tunix.generate import tokenizer_adapter
from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.rollout import prompts as prompts_lib
from tunix_blockdiff.runs import rl_common

Mode = rl_cluster_lib.Mode


def reward_gain(start: list[float], end: list[float],
                name: str = "reward") -> dict[str, float]:
  """Held-out reward before/after, with standard errors over the prompts.

  Args:
    start: Each held-out prompt's mean reward before training.
    end: The same prompts' after training.
    name: The keys' stem.

  Returns:
    `{name}_start`, `{name}_end` (means), their standard errors
    `{name}_start_se`, `{name}_end_se`, and `{name}_gain` (end - start)
    with `{name}_gain_se`, the paired standard error (of the per-prompt
    differences: the prompts are the same, their samples independent).
  """
  start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
  n = len(start)

  def se(x):
    return float(np.std(x, ddof=1) / np.sqrt(n)) if n > 1 else float("nan")

  return {
      f"{name}_start": float(start.mean()),
      f"{name}_end": float(end.mean()),
      f"{name}_start_se": se(start),
      f"{name}_end_se": se(end),
      f"{name}_gain": float((end - start).mean()),
      f"{name}_gain_se": se(end - start),
  }


def greedy_rewards(model, sampler: dg.SamplerConfig, tokenizer, mesh, rows,
                   reward_fn, *, max_prompt_length: int, max_new_tokens: int,
                   batch_size: int, seed: int):
  """A function giving each row's reward under the greedy sampler.

  `SamplerConfig(greedy=True)`: each step's denoiser canvas is the argmax.
  The initial canvases and renoising still draw, from keys fixed by `seed`
  and the batch index, so every call (before and after training, and after
  a resume) uses the same noise: the gain is paired.

  Args:
    model: The policy (read at each call: the trained parameters).
    sampler: The rollouts' `SamplerConfig`.
    tokenizer: The policy's tokenizer.
    mesh: The rl mesh (rows sharded over fsdp) or None.
    rows: The held-out `rl_data.Row`s.
    reward_fn: The recipe's reward, called as Tunix calls it.
    max_prompt_length: Prompt width.
    max_new_tokens: New tokens per completion.
    batch_size: Rows per sampler call.
    seed: Noise seed.

  Returns:
    `() -> list[float]`, one reward per row.
  """
  config = dataclasses.replace(sampler, greedy=True)
  program = dg_rollout.DiffusionGemmaSampler(model, config, mesh=mesh)
  adapter = (tokenizer
             if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
             else tokenizer_adapter.TokenizerAdapter(tokenizer))

  class Greedy:
    """`rl_common.evaluate_rewards`'s generator: batch i draws with key i."""

    calls = 0

    def generate(self, texts, mode):
      del mode
      encoded = prompts_lib.tokenize_prompts(adapter, texts, max_prompt_length)
      result = program.generate(
          encoded.tokens, encoded.lengths, max_new_tokens=max_new_tokens,
          rng=jax.random.fold_in(jax.random.key(seed), self.calls))
      self.calls += 1
      _, text = engine_lib.completions(result.tokens, config.eos_token_id,
                                       adapter)
      return types.SimpleNamespace(text=text)

  def evaluate() -> list[float]:
    rewards: list[float] = []
    rl_common.evaluate_rewards(Greedy(), rows, reward_fn, samples=1,
                               mode=Mode.EVAL, batch_size=batch_size,
                               per_rollout=rewards)
    return rewards

  return evaluate


__all__ = ["greedy_rewards", "reward_gain"]
