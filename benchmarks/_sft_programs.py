"""The programs `sft_step.py` times: the model, the rows, the jitted steps.

Tunix's causal `PeftTrainer` step (its own next-token loss, or the same
loss with the output head in chunks) and `BlockDiffusionTrainer`'s step per
stream, built from `sft_step.py`'s parsed flags; and their losses alone, for
XLA's FLOP count.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
from jax.interpreters import pxla
import jax.numpy as jnp
import numpy as np
import optax
from tunix.models.qwen3 import model as qwen3_lib
from tunix.sft import peft_trainer

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff.models import head as head_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff import trainer as trainer_lib
from tunix_blockdiff.objective import loss as loss_lib
from tunix_blockdiff.runs import model_setup

STREAMS = ("single", "clean_prefix", "two_stream")


def training_config(args) -> peft_trainer.TrainingConfig:
  """Every step's `TrainingConfig`: `--micro-batch` rows a call, the
  gradients of the batch's calls accumulated (Tunix's
  `gradient_accumulation_steps`, an `optax.MultiSteps` optimizer)."""
  steps = args.batch // args.micro_batch if args.micro_batch else None
  return peft_trainer.TrainingConfig(eval_every_n_steps=10**9,
                                     gradient_accumulation_steps=steps)


def accumulated(step, args):
  """`step` over the batch's micro-batches in turn (the last call's output):
  one optimizer update of the whole batch, as the trainer makes it."""
  if not args.micro_batch or args.micro_batch == args.batch:
    return step
  size = args.micro_batch

  def run(batch):
    out = None
    for i in range(args.batch // size):
      out = step(jax.tree.map(lambda x, i=i: x[i * size:(i + 1) * size],
                              batch))
    return out

  return run


def make_model(args, flash: bool = False,
               remat: bool = False) -> qwen3_lib.Qwen3:
  """The model (`--model`, `--vocab`, `--dtype`).

  Args:
    args: The parsed flags.
    flash: Tunix's own (causal) flash branch.
    remat: Set `--remat` in the model's config (the causal step; the
      block-diffusion steps take it from the trainer's `remat=` instead).
  """
  if args.model == "qwen3_0p6b":
    config = qwen3_lib.ModelConfig.qwen3_0p6b()
    config = dataclasses.replace(config, vocab_size=args.vocab) if (
        args.vocab != config.vocab_size) else config
  else:
    config = tiny_models.qwen3_config(
        args.vocab,
        num_layers=args.layers,
        embed_dim=args.width,
        hidden_dim=4 * args.width,
        num_heads=args.heads,
        head_dim=args.width // args.heads,
        num_kv_heads=max(1, args.heads // 2),
    )
  dtype = jnp.dtype(args.dtype)
  tile = args.tile or 128
  config = dataclasses.replace(
      config, dtype=dtype, param_dtype=dtype, use_flash_attention=flash,
      flash_attention_block_size=tile)
  if remat and args.remat != "none":
    config = dataclasses.replace(
        config, remat_config=qwen3_lib.RematConfig[args.remat.upper()])
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))


def causal_flash(args) -> bool:
  """Tunix's causal flash branch: a TPU only (it has no interpret mode)."""
  return args.attention == "splash" and jax.default_backend() == "tpu"


def attention_config(args) -> config_lib.AttentionConfig | None:
  """The steps' Splash config as the sft job picks it for these rows (one
  document per row: the static mask, `training_mask_mode`)."""
  if args.attention == "dense":
    return None
  return model_setup.training_mask_mode(
      config_lib.AttentionConfig("splash", tile=args.tile), "none", 1)


def make_examples(args) -> list[data_lib.Example]:
  """Rows that fill the length: a quarter prompt, the rest completion."""
  rng = np.random.default_rng(0)
  prompt = args.length // 4
  raw = [
      (
          rng.integers(4, args.vocab, prompt).tolist(),
          rng.integers(4, args.vocab, args.length - prompt).tolist(),
      )
      for _ in range(args.batch)
  ]
  return data_lib.as_examples(
      raw, seq_len=args.length, vocab_size=args.vocab, mask_token_id=3
  )


def causal_step(args, examples):
  """Tunix PeftTrainer's jitted step and its batch (causal next-token)."""
  tokens = np.stack(
      [np.concatenate([e.prompt, e.completion]) for e in examples]
  )
  completion = np.zeros(tokens.shape, bool)
  completion[:, args.length // 4 :] = True
  batch = {
      "input_tokens": tokens.astype(np.int32),
      "input_mask": completion,
      "positions": (
          np.broadcast_to(np.arange(args.length), tokens.shape).astype(np.int32)
      ),
      "attention_mask": np.broadcast_to(
          np.tril(np.ones((args.length, args.length), bool)),
          (args.batch, args.length, args.length),
      ),
  }
  trainer = peft_trainer.PeftTrainer(
      make_model(args, flash=causal_flash(args), remat=True),
      optax.adamw(1e-4),
      training_config(args),
  )
  if args.head_chunk:
    trainer.with_loss_fn(chunked_causal_loss(args.head_chunk))
  # Placed as the step's outputs will be, so its second call does not
  # compile it again (tens of seconds a program on a TPU).
  mesh = pxla.thread_resources.env.physical_mesh
  for module in (trainer.model, trainer.optimizer):
    state = nnx.state(module)
    nnx.update(module, jax.device_put(
        state, nnx.get_named_sharding(state, mesh)))
  step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  return accumulated(step, args), batch


def chunked_causal_loss(chunk: int):
  """Tunix's next-token loss with the output head run `chunk` tokens at a
  time (the block-diffusion steps' `head_chunk`), for a like-for-like
  causal step where Tunix's own loss (full logits and their one-hot) does
  not fit."""

  def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
    view = head_lib.headless(model)
    hidden, _ = view.model(input_tokens, positions, None, attention_mask)
    out = loss_lib.chunked_diffusion_loss(
        hidden[:, :-1], head_lib.output_head(model), input_tokens[:, 1:],
        input_mask[:, 1:], chunk=chunk, hidden_dtype=view.dtype)
    return out.primary_loss.compute()

  return loss_fn


def diffusion_step(args, examples, stream):
  dcfg = config_lib.BlockDiffusionConfig(
      block_size=args.block, mask_token_id=3, stream=stream
  )
  batch = next(
      iter(
          data_lib.SFTBatches(
              examples,
              dcfg,
              data_lib.DataConfig(
                  seq_len=args.length,
                  batch_size=args.batch,
                  vocab_size=args.vocab,
                  shuffle=False,
              ),
          )
      )
  )
  trainer = trainer_lib.BlockDiffusionTrainer(
      make_model(args),
      optax.adamw(1e-4),
      training_config(args),
      dcfg,
      attention=attention_config(args),
      remat=args.remat,
      head_chunk=args.head_chunk,
  )
  step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  return accumulated(step, args), batch


def causal_loss_for(head_chunk=None):
  loss_fn = (chunked_causal_loss(head_chunk) if head_chunk else
             peft_trainer._default_loss_fn)  # pylint: disable=protected-access
  return lambda model, batch: loss_fn(model, **batch)


def diffusion_loss_for(stream, block, attention=None, head_chunk=None):
  loss_fn = trainer_lib.make_diffusion_loss_fn(
      config_lib.BlockDiffusionConfig(
          block_size=block, mask_token_id=3, stream=stream
      ),
      attention,
      head_chunk=head_chunk,
  )
  return lambda model, batch: loss_fn(
      model, **trainer_lib.diffusion_model_inputs(batch)
  ).primary_loss.unreduced_sum
