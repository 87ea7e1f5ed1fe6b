"""Autoregressive training and decoding with Tunix's own pieces.

Pretraining and the causal fine-tuning peer use `tunix.sft.PeftTrainer`
with its default next-token loss (`input_tokens`, `input_mask` from
`TrainingInput`; `positions` and a causal `attention_mask` built per batch,
as Tunix's examples do); decoding uses `tunix.generate.Sampler`, greedy.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import _timing
import jax.numpy as jnp
import numpy as np
import omegaconf
from tunix.generate import sampler as sampler_lib
from tunix.sft import peft_trainer

from tunix_blockdiff.runs import common


def model_inputs(pad_id: int):
  """`gen_model_input_fn`: positions and a causal mask over valid tokens."""

  def fn(batch: peft_trainer.TrainingInput) -> dict:
    tokens = batch.input_tokens
    valid = tokens != pad_id
    length = tokens.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return {
        "input_tokens": tokens,
        "input_mask": batch.input_mask,
        "positions": jnp.broadcast_to(jnp.arange(length), tokens.shape),
        "attention_mask": causal[None] & valid[:, None, :],
    }

  return fn


def train(model, optimizer, batches, *, max_steps: int, pad_id: int) -> list:
  """Trains `model` in place with PeftTrainer's causal LM loss.

  Args:
    model: A Tunix causal LM.
    optimizer: An optax transformation.
    batches: Iterable of `TrainingInput` (int32 `[B, L]` tokens, `[B, L]`
      bool loss mask; the loss on token t+1 counts where the mask is set).
    max_steps: Optimizer steps.
    pad_id: Pad token id (never attended to).

  Returns:
    The train loss per step.
  """
  trainer = peft_trainer.PeftTrainer(
      model,
      optimizer,
      peft_trainer.TrainingConfig(
          eval_every_n_steps=10**9, max_steps=max_steps, pbar_description=None
      ),
  ).with_gen_model_input_fn(model_inputs(pad_id))
  trainer.train(batches)
  logger = trainer.metrics_logger
  history = logger.get_metric_history(trainer.metrics_prefix, "loss", "train")
  trainer.close()
  return [float(x) for x in history]


def pretraining_batches(
    documents: Sequence[Sequence[int]],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
) -> Iterator[peft_trainer.TrainingInput]:
  """Endless batches of `seq_len` windows of the concatenated documents.

  Documents are concatenated (each already framed by the caller, e.g. BOS ...
  EOS) and cut into windows; each epoch visits the windows in a new seeded
  order. Every token is a target.
  """
  stream = np.concatenate([np.asarray(d, np.int32) for d in documents])
  num = len(stream) // seq_len
  if num < batch_size:
    raise ValueError(
        f"corpus has {num} windows of {seq_len} tokens, fewer than batch_size"
        f" {batch_size}"
    )
  windows = stream[: num * seq_len].reshape(num, seq_len)
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(num)
    for start in range(0, num - batch_size + 1, batch_size):
      tokens = windows[order[start : start + batch_size]]
      yield peft_trainer.TrainingInput(
          input_tokens=tokens, input_mask=np.ones_like(tokens, bool)
      )


def sft_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    seq_len: int,
    batch_size: int,
    pad_id: int,
    seed: int,
) -> Iterator[peft_trainer.TrainingInput]:
  """Endless right-padded (prompt + completion) batches; loss on completion.

  `pairs` are (prompt ids, completion ids) as the block-diffusion job encodes
  them (BOS + prompt, completion + EOS), so both fine-tunings see the same
  tokens.
  """
  rows, masks = [], []
  for prompt, completion in pairs:
    ids = list(prompt) + list(completion)
    if len(ids) > seq_len:
      raise ValueError(f"a pair has {len(ids)} tokens > seq_len {seq_len}")
    rows.append(ids + [pad_id] * (seq_len - len(ids)))
    masks.append(
        [False] * len(prompt)
        + [True] * len(completion)
        + [False] * (seq_len - len(ids))
    )
  if len(rows) < batch_size:
    raise ValueError(
        f"{len(rows)} pairs are fewer than batch_size {batch_size}"
    )
  tokens, mask = np.asarray(rows, np.int32), np.asarray(masks, bool)
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(rows))
    for start in range(0, len(rows) - batch_size + 1, batch_size):
      index = order[start : start + batch_size]
      yield peft_trainer.TrainingInput(
          input_tokens=tokens[index], input_mask=mask[index]
      )


def fine_tune(
    model, pairs, recipe, *, pad_id: int, max_steps: int | None = None
) -> list:
  """Causal fine-tuning on (prompt, completion) pairs with a recipe's budget.

  `recipe` is an sft recipe: its `training` section (the optimizer and its
  schedule; `max_steps` unless given), `data.seq_len`, `data.batch_size` and
  `seed`. Returns the losses (`train`).
  """
  steps = int(max_steps or recipe.training.max_steps)
  training = omegaconf.OmegaConf.merge(recipe.training, {"max_steps": steps})
  return train(
      model,
      common.make_optimizer(training),
      sft_batches(
          pairs,
          seq_len=int(recipe.data.seq_len),
          batch_size=int(recipe.data.batch_size),
          pad_id=pad_id,
          seed=int(recipe.seed),
      ),
      max_steps=steps,
      pad_id=pad_id,
  )


def greedy_generate(
    model,
    hf_tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    max_prompt_length: int,
    batch_size: int,
    warmup: bool = False,
    repeats: int = 1,
) -> tuple[list[list[int]], float]:
  """Greedy completions (token ids, cut at EOS) with Tunix's `Sampler`.

  Args:
    model: A Tunix causal LM.
    hf_tokenizer: The transformers tokenizer (the Sampler adds BOS).
    prompts: Prompt strings.
    max_new_tokens: Decoding steps.
    max_prompt_length: Fixed prompt width (one compiled program).
    batch_size: Prompts per call (the last batch is padded by repetition).
    warmup: Decode the first batch once, untimed, with the same `Sampler`
      first (its programs are compiled per instance), so the seconds
      exclude compilation.
    repeats: Time this many passes over every prompt and report the median
      (greedy decoding is deterministic: the first pass's ids are returned).

  Returns:
    (completions, wall seconds; including compilation unless `warmup`).
  """
  config = model.config
  sampler = sampler_lib.Sampler(
      model,
      hf_tokenizer,
      sampler_lib.CacheConfig(
          cache_size=max_prompt_length + max_new_tokens,
          num_layers=config.num_layers,
          num_kv_heads=config.num_kv_heads,
          head_dim=config.head_dim,
      ),
  )
  eos = hf_tokenizer.eos_token_id

  def decode(chunk):
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - real)
    result = sampler(
        chunk,
        max_generation_steps=max_new_tokens,
        max_prompt_length=max_prompt_length,
        temperature=0.0,
        eos_tokens=[eos],
    )
    return list(result.tokens)[:real]

  def one_pass():
    out = []
    for i in range(0, len(prompts), batch_size):
      for tokens in decode(list(prompts[i : i + batch_size])):
        ids = [int(t) for t in np.asarray(tokens)]
        out.append(ids[: ids.index(eos)] if eos in ids else ids)
    return out

  if warmup and prompts:
    decode(list(prompts[:batch_size]))
  return _timing.median_seconds(one_pass, repeats)
