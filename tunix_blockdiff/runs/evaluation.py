"""Generation evaluation of the `tunix-blockdiff` jobs.

`evaluate_generation` generates every held-out example's completion with
`rollout.cached.generate` and scores it; re-exported by
`tunix_blockdiff.runs.common`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.runs.outputs import Stopwatch


@dataclasses.dataclass(frozen=True)
class GenerationEval:
  """Exact match and parallelism of block-diffusion generation.

  Attributes:
    threshold: The denoising confidence threshold.
    exact_match: Fraction of examples whose completion (text before EOS)
      equals the answer.
    tokens_per_step: Committed tokens (up to and including EOS) per model
      call, summed over rows: a row takes part in every step until it
      finishes, so its calls are its last commit step + 1.
    completions: Decoded completions, in example order.
    seconds: Wall time of the generation (including compilation).
    tokens: int32 [N, T] generated tokens, in example order.
    commit_step: int32 [N, T] step that committed each token (-1: never).
    prompt_lengths: int32 [N] prompt lengths (position of the first slot).
  """

  threshold: float
  exact_match: float
  tokens_per_step: float
  completions: tuple[str, ...]
  seconds: float
  tokens: np.ndarray | None = None
  commit_step: np.ndarray | None = None
  prompt_lengths: np.ndarray | None = None

  def row(self) -> dict[str, float]:
    return {
        "threshold": self.threshold,
        "exact_match": self.exact_match,
        "tokens_per_step": self.tokens_per_step,
    }


def evaluate_generation(
    model,
    examples: Sequence[data_lib.Example],
    pairs: Sequence[tuple[str, str]],
    task: tasks_lib.Task,
    tokenizer,
    denoise_config: config_lib.DenoiseConfig,
    *,
    max_new_tokens: int,
    batch_size: int,
    use_cache: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerationEval:
  """Generates every example's completion and scores it exactly.

  Batches are padded to `batch_size` (repeating the last example) so one
  compiled program serves all of them. Under a `mesh` (a multiple of
  mesh.fsdp rows) the prompts are sharded over fsdp, each process placing
  its own rows, and the results gathered: every process scores them all.
  """
  from tunix_blockdiff.rollout import cached  # pylint: disable=g-import-not-at-top

  clock = Stopwatch()
  prompts, lengths = data_lib.left_padded_prompts(examples, tokenizer.pad_id())
  num = len(examples)
  completions, tokens_committed, calls = [], 0, 0
  all_tokens, all_steps = [], []
  for start in range(0, num, batch_size):
    index = np.minimum(np.arange(start, start + batch_size), num - 1)
    result = distributed.call_sharded(
        lambda tokens, lens: cached.generate(
            model,
            tokens,
            lens,
            denoise_config,
            max_new_tokens=max_new_tokens,
            use_cache=use_cache,
        ),
        mesh,
        prompts[index],
        lengths[index],
    )
    tokens = np.asarray(result.tokens)
    commit_step = np.asarray(result.commit_step)
    trace_step = np.asarray(result.trace_commit_step)
    real = min(batch_size, num - start)
    all_tokens.append(tokens[:real])
    all_steps.append(commit_step[:real])
    for b in range(real):
      completions.append(tokenizer.decode(tokens[b]))
      tokens_committed += int(np.sum(commit_step[b] >= 0))
      calls += int(trace_step[b].max(initial=-1)) + 1
  correct = [
      task.check(prompt, completion, answer)
      for (prompt, answer), completion in zip(pairs, completions)
  ]
  return GenerationEval(
      threshold=float(denoise_config.threshold),
      exact_match=float(np.mean(correct)),
      tokens_per_step=tokens_committed / max(calls, 1),
      completions=tuple(completions),
      seconds=clock(),
      tokens=np.concatenate(all_tokens),
      commit_step=np.concatenate(all_steps),
      prompt_lengths=lengths,
  )


__all__ = ["GenerationEval", "evaluate_generation"]
