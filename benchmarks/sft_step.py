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

With `--attention splash` every program runs its attention through Splash
(the causal step through Tunix's own causal flash path on a TPU, dense
elsewhere; the block-diffusion steps through `model.attention: splash`, in
Pallas interpret mode off a TPU), under a one-device mesh; with
`--model qwen3_0p6b --dtype bfloat16` the model is Tunix's Qwen3-0.6B
architecture (random weights, its own vocabulary unless `--vocab`). The
table then also gives tokens/s and MFU (the model FLOPs of `model_gflops`,
6 per parameter per token plus the mask's attended pairs, over the best time
and `--peak-tflops`, 197 for a v5e). `--remat block|decoder` recomputes
activations in the backward pass (the trainer's `remat=`, and the same
`RematConfig` on the causal model). `--head-chunk N` runs every step's
output head and loss N tokens at a time (the trainer's `head_chunk`; the
causal step gets Tunix's next-token loss computed the same way,
`chunked_causal_loss`), without which a real vocabulary's logits (and
Tunix's one-hot of them) fill the chip at batch 4 x 2048. `--micro-batch M`
makes every step one optimizer update of the batch from `--batch / M`
calls of M rows, their gradients accumulated (Tunix's
`gradient_accumulation_steps`): a batch that does not fit at once, without
recomputing activations. `--sequential`
runs each program in its own process, so each reports its own peak.

    python benchmarks/sft_step.py                 # the README table
    python benchmarks/sft_step.py --rounds 3      # quick
    python benchmarks/sft_step.py --model qwen3_0p6b --dtype bfloat16 \
        --attention splash --length 2048 --batch 4 --rounds 3 \
        --sequential --head-chunk 1024                          # a TPU
    python benchmarks/sft_step.py --model qwen3_0p6b --dtype bfloat16 \
        --attention splash --length 4096 --batch 4 --streams two_stream \
        --remat decoder --head-chunk 1024 --sequential --no-causal
    tunix-blockdiff bench sft_step [flags]        # the same, via the CLI
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
from jax.sharding import AxisType
from tunix.models.qwen3 import model as qwen3_lib

from _sft_programs import STREAMS
from _sft_programs import attention_config
from _sft_programs import causal_flash
from _sft_programs import causal_loss_for
from _sft_programs import causal_step
from _sft_programs import diffusion_loss_for
from _sft_programs import diffusion_step
from _sft_programs import make_examples
from _sft_programs import make_model
from _step_cost import loss_gflops
from _step_cost import model_gflops
from _step_cost import peak_gib
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import remat as remat_lib


def run_once(step, batch) -> float:
  start = time.perf_counter()
  jax.block_until_ready(step(batch))
  return time.perf_counter() - start


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="tiny", choices=("tiny", "qwen3_0p6b"))
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--attention", default="dense",
                      choices=("dense", "splash", "auto"),
                      help="auto: splash on a TPU, dense elsewhere")
  parser.add_argument("--tile", type=int, default=None,
                      help="Splash tile (default: from the length)")
  parser.add_argument("--streams", default=",".join(STREAMS))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--block", type=int, default=16)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=None,
                      help="default: the model's own (8192 for tiny)")
  parser.add_argument("--remat", default="none",
                      choices=remat_lib.REMAT_POLICIES,
                      help="rematerialise each layer's attention block or"
                      " whole decoder layer in the backward pass")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--peak-tflops", type=float, default=197.0)
  parser.add_argument("--head-chunk", type=int, default=None,
                      help="every step's output head and loss run this many"
                      " tokens at a time (the trainer's head_chunk; the"
                      " causal step's next-token loss alike)")
  parser.add_argument("--micro-batch", type=int, default=None,
                      help="rows a call; the batch's gradients accumulated"
                      " over --batch / M calls (must divide --batch)")
  parser.add_argument("--sequential", action="store_true",
                      help="build, time and free one program at a time, each"
                      " in its own process (a real size on one chip cannot"
                      " hold every program's model and optimizer state at"
                      " once); also reports each program's peak memory")
  parser.add_argument("--no-causal", action="store_true",
                      help="leave out the causal step (ratios then n/a)")
  parser.add_argument("--program", default=None, help=argparse.SUPPRESS)
  flags = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.head_chunk is not None and args.head_chunk < 1:
    parser.error("--head-chunk must be >= 1")
  if args.micro_batch is not None and (
      args.micro_batch < 1 or args.batch % args.micro_batch):
    parser.error(f"--micro-batch must be >= 1 and divide --batch"
                 f" {args.batch}, got {args.micro_batch}")
  streams = args.streams.split(",")
  for stream in streams:
    if stream not in STREAMS:
      parser.error(f"--streams: {stream!r} is not one of {STREAMS}")
  if args.sequential and args.program is None:
    # Each program in its own process; this one never opens the device (a
    # TPU is held by one process at a time).
    return _sequential(args, flags, streams)
  if args.vocab is None:
    args.vocab = (qwen3_lib.ModelConfig.qwen3_0p6b().vocab_size
                  if args.model == "qwen3_0p6b" else 8192)
  if args.attention == "auto":
    args.attention = "splash" if jax.default_backend() == "tpu" else "dense"
  if args.attention == "splash" and args.tile is None:
    args.tile = config_lib.AttentionConfig("splash").tile_for(
        args.length, jax.default_backend())
    if args.tile is None:
      parser.error("--attention splash needs --length a multiple of 128")
  mesh = jax.make_mesh((1, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(AxisType.Auto,) * 3)
  with mesh:  # Tunix's flash branch reads the legacy mesh context
    return _measure(args, streams)


def _header(args, title: str | None = None) -> None:
  print(title or _title(args))
  print(
      "| step | best s / step | vs causal (best) | vs causal (median) |"
      " FLOPs vs causal | tokens/s | MFU | first call (compile) s |"
      + (" peak GiB |" if args.sequential else "")
  )
  print("|---|---|---|---|---|---|---|---|" + ("---|" if args.sequential else ""),
        flush=True)


def _title(args) -> str:
  return (
      f"Qwen3 ({args.model}) {args.dtype}, vocab {args.vocab}; batch"
      f" {args.batch} x {args.length} tokens"
      f"{f' ({args.micro_batch} a call)' if args.micro_batch else ''},"
      f" block {args.block}; remat"
      f" {args.remat}; head chunk {args.head_chunk or 'off'}; attention"
      f" {args.attention}{f' (tile {args.tile})' if args.tile else ''}"
      f"{'' if causal_flash(args) or args.attention == 'dense' else ', the causal step dense (Tunix flash: TPU only)'};"
      f" {jax.devices()[0].platform}, {args.rounds}"
      f" {'rounds per program, one at a time' if args.sequential else 'interleaved rounds'};"
      f" MFU at {args.peak_tflops:g} TFLOP/s\n"
  )


def _row(args, name: str, m: dict, causal: dict | None) -> str:
  """One table row from measure `m` (and the causal step's, if measured)."""
  if "oom" in m:
    return f"| {name} | out of memory |" + " |" * (7 + args.sequential)
  best, median = min(m["times"]), statistics.median(m["times"])
  nan = float("nan")
  c_best = causal["best"] if causal else nan
  c_median = causal["median"] if causal else nan
  ratio = m["gflops"] / (causal["gflops"] if causal else nan)
  # The optimizer update's FLOPs are left out (small next to the pass).
  mfu = m["useful"] * 1e9 / best / (args.peak_tflops * 1e12)
  tokens = args.batch * args.length
  def times(x):  # n/a without the causal step (--no-causal)
    return "n/a" if x != x else f"{x:.2f}x"

  return (
      f"| {name} | {best:.3f} | {times(best / c_best)} |"
      f" {times(median / c_median)} | {times(ratio)} |"
      f" {tokens / best:,.0f} | {100 * mfu:.1f}% | {m['compile']:.1f} |"
      + (f" {m['peak']:.2f} |" if args.sequential else "")
  )


CAUSAL = "causal LM (Tunix PeftTrainer)"


def _plans(args, streams) -> dict:
  """Program name -> (build, loss_fn, loss model, stream), causal first."""
  examples = make_examples(args)
  plans = {} if args.no_causal else {CAUSAL: (
      lambda: causal_step(args, examples), causal_loss_for(args.head_chunk),
      lambda: make_model(args, flash=causal_flash(args)), None)}
  for stream in streams:
    plans[f"block diffusion, {stream}"] = (
        lambda stream=stream: diffusion_step(args, examples, stream),
        diffusion_loss_for(stream, args.block, attention_config(args),
                           args.head_chunk),
        lambda: make_model(args), stream)
  return plans


def _measure_program(args, plan, timed: bool) -> dict:
  """Builds and compiles one program (and times it, if `timed`)."""
  build, loss_fn, loss_model, stream = plan
  model = loss_model()
  m = {"useful": model_gflops(model, args, stream), "times": []}
  try:
    program = build()
    m["gflops"] = loss_gflops(loss_fn, model, program[1])
    del model
    m["compile"] = run_once(*program)
    if timed:
      m["times"] = [run_once(*program) for _ in range(args.rounds)]
      m["peak"] = peak_gib()
    else:
      m["program"] = program
  except jax.errors.JaxRuntimeError as e:
    if not args.sequential or "RESOURCE_EXHAUSTED" not in str(e):
      raise
    m["oom"] = str(e).splitlines()[0][:300]  # does not fit: say so
  return m


def _measure(args, streams) -> int:
  if args.program is not None:  # one program of a --sequential run
    m = _measure_program(args, _plans(args, streams)[args.program], True)
    m["title"] = _title(args)
    print(_RESULT + json.dumps(m), flush=True)
    return 0
  _header(args)
  measured = {}
  for name, plan in _plans(args, streams).items():
    measured[name] = _measure_program(args, plan, False)
  for _ in range(args.rounds):
    for m in measured.values():
      m["times"].append(run_once(*m["program"]))
  for name in measured:
    _print_row(args, name, measured)
  return 0


_RESULT = "sft_step program result: "


def _sequential(args, flags: list[str], streams) -> int:
  """Measures each program in its own process (`--program NAME`): its own
  device memory (nothing left over from the programs before it) and its
  own peak. Rows are printed as they are measured."""
  measured = {}
  names = [] if args.no_causal else [CAUSAL]
  for name in names + [f"block diffusion, {s}" for s in streams]:
    done = subprocess.run(
        [sys.executable, __file__, *flags, "--program", name],
        capture_output=True, text=True, check=False)
    result = [line for line in done.stdout.splitlines()
              if line.startswith(_RESULT)]
    if not result:
      raise RuntimeError(f"sft_step program {name!r} failed (rc"
                         f" {done.returncode}):\n{done.stderr[-3000:]}")
    measured[name] = json.loads(result[-1][len(_RESULT):])
    if len(measured) == 1:
      _header(args, measured[name]["title"])
    if "oom" in measured[name]:
      print(f"({name}: {measured[name]['oom']})", file=sys.stderr)
    _print_row(args, name, measured)
  return 0


def _print_row(args, name, measured) -> None:
  base = measured.get(CAUSAL)
  if base is not None and "oom" not in base:
    base = dict(base, best=min(base["times"]),
                median=statistics.median(base["times"]))
  else:
    base = None
  print(_row(args, name, measured[name], base), flush=True)


if __name__ == "__main__":
  raise SystemExit(main())
