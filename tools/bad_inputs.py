"""Runs `tunix-blockdiff` on bad inputs as a new user would; one line each.

    python tools/bad_inputs.py [--timeout 30] [--only N ...]

Each case is a command line with one mistake (a value out of range, an
unknown choice, a missing or empty file, a run directory that is none, a
mesh larger than the devices, ...). Each runs as its own process (on CPU,
one device) with `output_dir` under a fresh temporary directory, and the
report says, per case: the exit status, the seconds it took, whether a
traceback was printed, whether anything was written under `output_dir`,
and the last line of stderr. Every case should end with exit status 2, one
line, no traceback and nothing written, in seconds (issue 63); the summary
line counts those that did.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

# `{d}`: the directory of the data files below; `{out}`: the case's
# output_dir.
CASES = (
    "sft training.max_steps=-5",
    "sft model.dtype=float13",
    "sft mesh.fsdp=3",
    "sft dataset.train={d}/missing.jsonl",
    "sft dataset.train={d}/empty.jsonl",
    "sft dataset.train={d}/malformed.jsonl dataset.bad_rows=error",
    "sft dataset.train={d}/columns.jsonl",
    "sft dataset.train={d}/empty_dir",
    "sft training.learning_rate=-1",
    "sft eval.thresholds=[0.5,2]",
    "sft tokenizer.kind=bpe",
    "sft task.name=foo",
    "sft lora.rank=-1",
    "sft model.kind=qwen3_hf",
    "sft diffusion.mask_token_id=999",
    "sft output_dir={d}/empty.jsonl",
    "sft diffusion_gemma_tiny.yaml sampler.t_min=0.9 sampler.t_max=0.1",
    "rl init.checkpoint={d}/empty_dir",
    "rl init.checkpoint={d}/run_without_checkpoint",
    "rl rollout.temperature=0.0",
    "rl reward=no_such_module:fn",
    "rl grpo.num_generations=1",
    "rl grpo.micro_batch_prompts=5",
    "rl init.sft_overrides=[training.max_steps=0]",
    "rl dataset.train={d}/columns.jsonl",
    "rl dataset.train={d}/prompts_bad_later.jsonl dataset.bad_rows=error",
    "opd teacher.kind=hf",
    "opd student.checkpoint={d}/missing",
    "generate {d}/missing",
    "generate {d}/run_without_checkpoint threshold=2",
    "export {d}/missing {out}/hf",
    "distill-data {d}/missing {d}/empty.jsonl {out}/rows.jsonl",
    "launch --processes 0 -- sft",
    "bench no_such_benchmark",
)


def write_data(d: pathlib.Path) -> None:
  """The files and directories the cases name."""
  (d / "empty.jsonl").write_text("")
  (d / "malformed.jsonl").write_text(
      '{"prompt": "1", "completion": "1"}\n{oops\n')
  (d / "columns.jsonl").write_text('{"question": "1", "reply": "1"}\n')
  (d / "prompts_bad_later.jsonl").write_text(
      '{"prompt": "1", "answer": "1"}\n{"prompt": ""}\n')
  (d / "empty_dir").mkdir()
  run = d / "run_without_checkpoint"
  run.mkdir()
  recipes = pathlib.Path(__file__).resolve().parents[1] / "recipes"
  (run / "recipe.yaml").write_text((recipes / "tiny.yaml").read_text())


def run_case(case: str, d: pathlib.Path, out: pathlib.Path,
             timeout: float) -> dict:
  argv = case.format(d=d, out=out).split()
  if argv[0] in ("sft", "rl", "opd") and not any(
      a.startswith("output_dir=") for a in argv):
    argv.append(f"output_dir={out}")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device
  clock = time.monotonic()
  try:
    done = subprocess.run(
        [sys.executable, "-m", "tunix_blockdiff.cli", *argv],
        capture_output=True, text=True, timeout=timeout, env=env)
    status, err = done.returncode, done.stderr
  except subprocess.TimeoutExpired as e:
    status = "timeout"
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (
        e.stderr or "")
  lines = [line for line in err.strip().splitlines() if line.strip()]
  return {
      "case": case,
      "status": status,
      "seconds": time.monotonic() - clock,
      "traceback": "Traceback" in err,
      "wrote": out.exists() and any(out.rglob("*")),
      "lines": len(lines),
      "last": lines[-1] if lines else "",
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--timeout", type=float, default=30.0)
  parser.add_argument("--only", type=int, nargs="*", default=None,
                      help="case numbers to run (default: all)")
  args = parser.parse_args(argv)
  good = 0
  with tempfile.TemporaryDirectory() as tmp:
    d = pathlib.Path(tmp)
    write_data(d)
    chosen = args.only if args.only is not None else range(len(CASES))
    for i in chosen:
      result = run_case(CASES[i], d, d / f"out{i}", args.timeout)
      ok = (result["status"] == 2 and result["lines"] == 1
            and not result["traceback"] and not result["wrote"])
      good += ok
      print(f"[{i}] {'ok ' if ok else 'BAD'} exit {result['status']}"
            f" {result['seconds']:.1f}s traceback={result['traceback']}"
            f" wrote={result['wrote']} :: {result['case']}\n"
            f"    {result['last']}", flush=True)
    print(f"{good} of {len(chosen)} refused in one line, exit 2, nothing"
          " written")
  return 0 if good == len(chosen) else 1


if __name__ == "__main__":
  sys.exit(main())
