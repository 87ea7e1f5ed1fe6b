"""SFT step cost: block diffusion vs a plain causal-LM step, side by side.

One process, one Tunix Qwen3 (random weights, float32), one batch of
`--batch` rows of `--length` tokens (prompt then completion). Every program
is a full optimizer step (forward, backward, AdamW update) jitted the way
Tunix's trainer jits it:

* `causal LM`: Tunix's own `PeftTrainer` train step with its default
  next-token loss under a causal mask (the step the block-diffusion
  objective replaces);
* `single`, `clean_prefix`, `two_stream`: `BlockDiffusionTrainer`'s train
  step on the same batch (block-causal mask; `two_stream` runs the clean and
  noised sequences together, length 2L).

Each step is compiled by a warm-up call, then the programs are timed in
interleaved rounds (so machine noise hits them alike). On a shared machine
other work only ever adds time, so the table leads with the fastest round
(and its ratio to the causal step), then the median ratio, then the ratio of
XLA's FLOP count of the loss's forward and backward pass, which is
machine-independent.
The two-stream step runs the model on 2L tokens: twice the projections and
MLP, and with dense attention four times the attention (Splash on TPU skips
the fully masked tiles), so its FLOP ratio is 2x plus the attention share:
about 2.1x at the default shapes, 2.3x at L=1024 with width 512.

    python benchmarks/sft_step.py                 # the README table
    python benchmarks/sft_step.py --rounds 3      # quick
    tunix-blockdiff bench sft_step [flags]        # the same, via the CLI
"""

from __future__ import annotations

import argparse
import statistics
import time

from flax import nnx
import jax
import numpy as np
import optax
from tunix.models.qwen3 import model as qwen3_lib
from tunix.sft import peft_trainer

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff import trainer as trainer_lib

STREAMS = ("single", "clean_prefix", "two_stream")


def make_model(args) -> qwen3_lib.Qwen3:
  config = tiny_models.qwen3_config(
      args.vocab,
      num_layers=args.layers,
      embed_dim=args.width,
      hidden_dim=4 * args.width,
      num_heads=args.heads,
      head_dim=args.width // args.heads,
      num_kv_heads=max(1, args.heads // 2),
  )
  return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(0))


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
      make_model(args),
      optax.adamw(1e-4),
      peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
  )
  step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  return step, batch


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
      peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
      dcfg,
  )
  step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  return step, batch


def loss_gflops(loss_fn, model, batch) -> float:
  """XLA's FLOP count (GFLOP) of `grad(loss_fn)` on `batch`."""
  graphdef, state = nnx.split(model)

  def grad(state, batch):
    return jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), batch))(state)

  cost = jax.jit(grad).lower(state, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) / 1e9


def causal_loss(model, batch):
  return peft_trainer._default_loss_fn(model, **batch)  # pylint: disable=protected-access


def diffusion_loss_for(stream, block):
  loss_fn = trainer_lib.make_diffusion_loss_fn(
      config_lib.BlockDiffusionConfig(
          block_size=block, mask_token_id=3, stream=stream
      )
  )
  return lambda model, batch: loss_fn(
      model, **trainer_lib.diffusion_model_inputs(batch)
  ).primary_loss.unreduced_sum


def run_once(step, batch) -> float:
  start = time.perf_counter()
  jax.block_until_ready(step(batch))
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--block", type=int, default=16)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--rounds", type=int, default=10)
  args = parser.parse_args()

  examples = make_examples(args)
  model = make_model(args)
  causal = "causal LM (Tunix PeftTrainer)"
  programs = {causal: causal_step(args, examples)}
  gflops = {causal: loss_gflops(causal_loss, model, programs[causal][1])}
  for stream in STREAMS:
    name = f"block diffusion, {stream}"
    programs[name] = diffusion_step(args, examples, stream)
    gflops[name] = loss_gflops(
        diffusion_loss_for(stream, args.block), model, programs[name][1]
    )
  compile_seconds = {name: run_once(*p) for name, p in programs.items()}
  times = {name: [] for name in programs}
  for _ in range(args.rounds):
    for name, program in programs.items():
      times[name].append(run_once(*program))

  best = {name: min(values) for name, values in times.items()}
  median = {name: statistics.median(values) for name, values in times.items()}
  print(
      f"Qwen3 {args.layers} layers, width {args.width}, vocab {args.vocab};"
      f" batch {args.batch} x {args.length} tokens, block {args.block};"
      f" {jax.devices()[0].platform}, {args.rounds} interleaved rounds\n"
  )
  print(
      "| step | best s / step | vs causal (best) | vs causal (median) |"
      " FLOPs vs causal | first call (compile) s |"
  )
  print("|---|---|---|---|---|---|")
  for name in programs:
    print(
        f"| {name} | {best[name]:.3f} | {best[name] / best[causal]:.2f}x |"
        f" {median[name] / median[causal]:.2f}x |"
        f" {gflops[name] / gflops[causal]:.2f}x | {compile_seconds[name]:.1f} |"
    )


if __name__ == "__main__":
  main()
