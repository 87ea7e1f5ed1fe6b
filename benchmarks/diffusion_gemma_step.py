"""DiffusionGemma's LoRA SFT step at a size: time and device memory.

One process, one DiffusionGemma with random weights at a size of
`diffusion_gemma_sampler.py` (`--size 26b_a4b_2layers`: the released
26B-A4B's layer widths, 2 layers, what one TPU chip holds), qwix LoRA on the
attention projections and dense MLPs (the `diffusiongemma_26b_a4b.yaml`
recipe's `module_path`; the routed experts stay frozen), Tunix's jitted
train step of `DiffusionGemmaTrainer` on one batch of random rows (prompt
then whole canvases). Reports the first call (compile) and the median of
`--repeats` steps, tokens per second, the first step's loss, the device's
peak memory after the steps, and the parameter counts, once per
`--attention` (`dense`, and `splash`: every training attention call on the
Splash kernel at `--splash-tile`, `DiffusionGemmaTrainer(splash_tile=)`;
same weights and batch, so the losses agree). Then (unless `--no-sampler`) the sampler
overhead at the same size (`diffusion_gemma_sampler.measure`).

    python benchmarks/diffusion_gemma_step.py                  # tiny, CPU
    python benchmarks/diffusion_gemma_step.py --size 26b_a4b_2layers \\
        --dtype bfloat16 --batch 2 --seq-len 1024              # a TPU chip
    python benchmarks/diffusion_gemma_step.py --size wide --dtype bfloat16 \\
        --batch 4 --seq-len 1024 --attention dense,splash --no-sampler
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from flax import nnx
import jax
import numpy as np
import omegaconf
import optax
from tunix.sft import peft_trainer

from tunix_blockdiff import data as data_lib
from tunix_blockdiff.kinds.diffusion_gemma import data as dg_data
from tunix_blockdiff.kinds.diffusion_gemma import objective as dg_objective
from tunix_blockdiff.kinds.diffusion_gemma import trainer as dg_trainer
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.runs import common

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import diffusion_gemma_sampler  # pylint: disable=g-import-not-at-top,wrong-import-position
from _step_cost import peak_gib  # pylint: disable=g-import-not-at-top,wrong-import-position

# The 26B-A4B recipe's LoRA placement.
LORA_PATH = ".*self_attn/(q|k|v|o)_proj|.*mlp/(gate|up|down)_proj"


def _batch(config: dg.DiffusionGemmaConfig, objective, batch: int,
           seq_len: int):
  """One training batch of random rows: a prompt, then whole canvases."""
  rng = np.random.default_rng(0)
  c = config.canvas_length
  prompt = max(1, (seq_len - c) // 4)
  completion = ((seq_len - prompt) // c) * c
  raw = [(rng.integers(3, config.vocab_size, prompt).tolist(),
          rng.integers(3, config.vocab_size, completion).tolist())
         for _ in range(batch)]
  examples = data_lib.as_examples(raw, seq_len=seq_len,
                                  vocab_size=config.vocab_size)
  data_config = data_lib.DataConfig(seq_len=seq_len, batch_size=batch,
                                    vocab_size=config.vocab_size,
                                    shuffle=False)
  return next(iter(dg_data.DiffusionGemmaBatches(examples, objective,
                                                 data_config)))


def measure_step(size: str, *, dtype: str, batch: int, seq_len: int,
                 lora_rank: int, repeats: int, attention: str = "dense",
                 splash_tile: int | None = None) -> dict:
  """Time and memory of one LoRA SFT step of DiffusionGemma at `size`."""
  config = diffusion_gemma_sampler.config_of(size, dtype)
  model = dg.DiffusionGemma(config, rngs=nnx.Rngs(0))
  lora = omegaconf.OmegaConf.create(
      {"module_path": LORA_PATH, "rank": lora_rank, "alpha": 2.0 * lora_rank})
  model = common.apply_lora(model, lora, seed=0)
  objective = dg_objective.DiffusionGemmaObjective(
      canvas_length=config.canvas_length, vocab_size=config.vocab_size)
  trainer = dg_trainer.DiffusionGemmaTrainer(
      model, optax.adamw(1e-4),
      peft_trainer.TrainingConfig(eval_every_n_steps=10**9), objective,
      splash_tile=splash_tile if attention == "splash" else None)
  step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  data = _batch(config, objective, batch, seq_len)

  losses = []

  def run() -> float:
    start = time.perf_counter()
    out = jax.block_until_ready(step(data))
    losses.append(float(jax.tree.leaves(out)[0]))
    return time.perf_counter() - start

  first = run()
  run()  # the state placed by the first step retraces once more
  seconds = statistics.median(run() for _ in range(repeats))
  return dict(
      size=size, dtype=dtype, batch=batch, seq_len=seq_len,
      attention=attention, lora_rank=lora_rank, first_loss=losses[0],
      first_call_s=first, step_s=seconds,
      tokens_per_s=batch * seq_len / seconds, peak_gib=peak_gib(),
      params=int(sum(x.size for x in jax.tree.leaves(
          nnx.state(trainer.model, nnx.Param)))),
      lora_params=int(sum(x.size for x in jax.tree.leaves(
          nnx.state(trainer.model, nnx.LoRAParam)))),
      platform=jax.devices()[0].platform,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="tiny_recipe",
                      choices=[*diffusion_gemma_sampler.SIZES,
                               *diffusion_gemma_sampler.REAL_WIDTHS])
  parser.add_argument("--dtype", default="float32",
                      choices=("float32", "bfloat16"))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--lora-rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--attention", default="dense",
                      help="comma-separated: dense, splash (each timed)")
  parser.add_argument("--splash-tile", type=int, default=512,
                      help="the Splash tile (it divides --seq-len)")
  parser.add_argument("--no-sampler", action="store_true")
  parser.add_argument("--sampler-steps", type=int, default=4)
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)
  if args.batch < 1 or args.seq_len < 2 or args.repeats < 1:
    parser.error("--batch, --repeats must be >= 1 and --seq-len >= 2")
  attentions = args.attention.split(",")
  if set(attentions) - {"dense", "splash"}:
    parser.error(f"--attention: dense or splash, not {args.attention!r}")
  if "splash" in attentions and (args.splash_tile < 1
                                 or args.seq_len % args.splash_tile):
    parser.error(f"--splash-tile {args.splash_tile} must divide --seq-len"
                 f" {args.seq_len}")
  rows = []
  for attention in attentions:
    r = measure_step(args.size, dtype=args.dtype, batch=args.batch,
                     seq_len=args.seq_len, lora_rank=args.lora_rank,
                     repeats=args.repeats, attention=attention,
                     splash_tile=args.splash_tile)
    rows.append(r)
    print(f"DiffusionGemma {r['size']} ({r['dtype']}, {r['platform']}):"
          f" {r['params'] / 1e6:,.1f}M parameters,"
          f" {r['lora_params'] / 1e6:.2f}M LoRA (rank {r['lora_rank']});"
          f" batch {r['batch']} x {r['seq_len']}")
    print(f"  LoRA SFT step, {attention} attention: {1e3 * r['step_s']:.1f} ms"
          f" (first call {r['first_call_s']:.1f} s), {r['tokens_per_s']:,.0f}"
          f" tokens/s, first loss {r['first_loss']:.6f},"
          f" peak {r['peak_gib']:.2f} GiB", flush=True)
  if not args.no_sampler:
    sampler = diffusion_gemma_sampler.measure(
        args.size, batch=args.batch, prompt=min(64, args.seq_len),
        steps=args.sampler_steps, repeats=args.repeats, dtype=args.dtype)
    rows.append(sampler)
    print(f"  sampler: {sampler['sampler_ms_per_step']:.2f} ms per step vs"
          f" {sampler['decoder_ms_per_call']:.2f} ms per raw decoder call"
          f" ({100 * sampler['overhead']:+.1f}%), peak {peak_gib():.2f} GiB")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
