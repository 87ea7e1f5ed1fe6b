"""`tunix-blockdiff distill-data CHECKPOINT PROMPTS OUT.jsonl`: distillation data.

Sequence-level distillation data for a conversion that decodes in parallel:
a checkpoint completes every prompt of a prompts file and each completion is
written as a `{"prompt", "completion"}` jsonl row, so any SFT recipe trains
on the model's own outputs with `dataset.train=OUT.jsonl`. The checkpoint
is either
- an autoregressive Hugging Face directory (any family `models.checkpoints.
  load_hf` reads: Qwen3, Qwen2, Llama3, Gemma3), decoded with Tunix's own
  `Sampler`, greedily by default (`distill_ar`); or
- a block-diffusion checkpoint: the output_dir of an `sft`, `opd` or `rl`
  run, or a directory `export` wrote, decoded with the block-KV-cached
  denoiser under `--threshold` (default 0.9) or `--steps-per-block`: its own
  trajectories, for certainty-forcing self-distillation (`distill_diffusion`).
  `--top-p`, `--dtype` and `--eos-token` are the AR path's and are refused
  here: the run's settings decide.

Prompts are read through `tunix_blockdiff.data` (jsonl, parquet or a
`save_to_disk` directory): a row is `{"prompt": str}` (other fields, such as
a reference completion, are ignored) or `{"messages": [{"role", "content"},
...]}`, rendered with the checkpoint tokenizer's chat template (the turns
before a final assistant turn, plus the generation prompt). A bad row is
skipped and counted (`--bad-rows skip`, the default) or stops the command
with its `file:line` (`--bad-rows error`).

Each completion is cut at the first EOS and decoded with the checkpoint's
tokenizer; a completion that is empty is not written (an SFT row needs one),
and one that reaches `--max-new-tokens` without EOS is written and counted
as truncated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any, Mapping, Sequence

from tunix_blockdiff import errors
from tunix_blockdiff.data import prompts as prompts_lib
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.data import sources as sources_lib
from tunix_blockdiff.jobs import distill_ar
from tunix_blockdiff.jobs import distill_diffusion

USAGE = (
    "usage: tunix-blockdiff distill-data CHECKPOINT PROMPTS OUT.jsonl [options]"
)
DEFAULT_THRESHOLD = 0.9
DTYPES = ("float32", "bfloat16")


def _parser() -> argparse.ArgumentParser:
  parser = errors.ArgumentParser(
      prog="tunix-blockdiff distill-data",
      usage=USAGE.removeprefix("usage: "),
      description=__doc__.split("\n\n", 1)[1],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
      "checkpoint", metavar="CHECKPOINT",
      help="an AR Hugging Face model directory (with its tokenizer), or a"
      " block-diffusion run's output_dir or exported directory",
  )
  parser.add_argument("prompts", metavar="PROMPTS",
                      help="prompts file(s): a path or a glob")
  parser.add_argument("output", metavar="OUT.jsonl",
                      help="the jsonl file to write")
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument(
      "--temperature", type=float, default=0.0,
      help="0 (default): greedy; > 0: sample (nucleus --top-p, default 1)",
  )
  parser.add_argument("--top-p", type=float, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--bad-rows", choices=rows_lib.BAD_ROW_POLICIES,
                      default="skip")
  parser.add_argument("--format", choices=sources_lib.FORMATS, default="auto",
                      help="prompts file format (default: by extension)")
  parser.add_argument(
      "--threshold", type=float, default=None,
      help="block-diffusion checkpoint: the confidence threshold of its"
      f" schedule (default {DEFAULT_THRESHOLD})",
  )
  parser.add_argument(
      "--steps-per-block", type=int, default=None,
      help="block-diffusion checkpoint: a static schedule instead",
  )
  parser.add_argument("--dtype", choices=DTYPES, default=None,
                      help="AR checkpoint: its dtype (default float32)")
  parser.add_argument("--eos-token", default=None,
                      help="stop token (default: the tokenizer's EOS)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty output file")
  return parser


@dataclasses.dataclass(frozen=True)
class Options:
  """Validated options of `distill-data` (flag names in the messages).

  Attributes:
    checkpoint: An AR Hugging Face model directory, or a block-diffusion
      run's output_dir or exported directory.
    prompts: Prompts file(s): a path, a glob.
    output: The jsonl file written.
    max_new_tokens: Decoding steps per prompt (>= 1).
    batch_size: Prompts per decoding call (>= 1).
    temperature: 0 for greedy; > 0 samples.
    top_p: Nucleus threshold in (0, 1] when sampling (None: 1).
    seed: Sampling seed (batch i uses `fold_in(PRNGKey(seed), i)`).
    bad_rows: `skip` or `error`.
    format: Prompts file format (`data.sources.FORMATS`).
    threshold: Block-diffusion checkpoint: the schedule's confidence
      threshold, 0 < t <= 1 (None: `DEFAULT_THRESHOLD`).
    steps_per_block: Block-diffusion checkpoint: a static schedule (>= 1).
    dtype: AR checkpoint: model dtype (`float32` or `bfloat16`; None:
      float32).
    eos_token: Optional stop token (default: the tokenizer's EOS).
    overwrite: Replace a non-empty output file.
  """

  checkpoint: str
  prompts: str
  output: str
  max_new_tokens: int = 256
  batch_size: int = 8
  temperature: float = 0.0
  top_p: float | None = None
  seed: int = 0
  bad_rows: str = "skip"
  format: str = "auto"
  threshold: float | None = None
  steps_per_block: int | None = None
  dtype: str | None = None
  eos_token: str | None = None
  overwrite: bool = False

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise errors.UsageError(
          f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"
      )
    if self.batch_size < 1:
      raise errors.UsageError(
          f"--batch-size must be >= 1, got {self.batch_size}"
      )
    if not 0.0 <= self.temperature < float("inf"):
      raise errors.UsageError(
          f"--temperature must be >= 0, got {self.temperature}"
      )
    if self.top_p is not None:
      if not 0.0 < self.top_p <= 1.0:
        raise errors.UsageError(
            f"--top-p must satisfy 0 < top_p <= 1, got {self.top_p}"
        )
      if self.temperature == 0.0:
        raise errors.UsageError(
            "--top-p samples, so it needs --temperature > 0 (temperature 0"
            " is greedy)"
        )
    if self.bad_rows not in rows_lib.BAD_ROW_POLICIES:
      raise errors.UsageError(
          f"--bad-rows must be one of {rows_lib.BAD_ROW_POLICIES}, got"
          f" {self.bad_rows!r}"
      )
    if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
      raise errors.UsageError(
          f"--threshold must satisfy 0 < threshold <= 1, got {self.threshold}"
      )
    if self.steps_per_block is not None and self.steps_per_block < 1:
      raise errors.UsageError(
          f"--steps-per-block must be >= 1, got {self.steps_per_block}"
      )
    if self.dtype is not None and self.dtype not in DTYPES:
      raise errors.UsageError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")

  @property
  def sampling_top_p(self) -> float | None:
    """The `top_p` given to `Sampler`: None is greedy there."""
    if self.temperature == 0.0:
      return None
    return 1.0 if self.top_p is None else self.top_p


def parse_args(argv: Sequence[str]) -> Options:
  """`Options` from the command line; a bad one is a `UsageError`."""
  args = vars(_parser().parse_args(list(argv)))
  return Options(**args)


def check_output(path: str, overwrite: bool) -> pathlib.Path:
  """The output file, refusing a non-empty one without `overwrite`."""
  output = pathlib.Path(path).expanduser()
  if output.is_dir():
    raise errors.UsageError(f"output {path} is a directory, not a jsonl file")
  if output.is_file() and output.stat().st_size > 0 and not overwrite:
    raise errors.UsageError(
        f"output {path} exists and is not empty; pass --overwrite to replace it"
    )
  return output


def cut_at_eos(ids: Sequence[int], eos_id: int) -> tuple[list[int], bool]:
  """(ids before the first `eos_id`, whether an EOS was found)."""
  ids = [int(i) for i in ids]
  if eos_id in ids:
    return ids[: ids.index(eos_id)], True
  return ids, False


def write_rows(path: pathlib.Path, rows: Sequence[Mapping[str, str]]) -> None:
  """Writes jsonl rows to `path` atomically (a sibling file, then renamed)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + ".partial")
  with partial.open("w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(partial, path)


def _refuse(options: Options, flags, kind: str) -> None:
  """A `UsageError` naming the first of `flags` (name, value) that is set."""
  for name, value in flags:
    if value is not None:
      raise errors.UsageError(
          f"{name} does not apply to {options.checkpoint}: it is {kind}"
      )


def _generator(options: Options):
  """(tokenizer, prompts, generate) with every check done, no model loaded.

  `generate()` loads the model and returns each prompt's generated ids.
  """
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  found = distill_diffusion.find(options.checkpoint)
  if found is not None:
    _refuse(
        options,
        (("--top-p", options.top_p), ("--dtype", options.dtype),
         ("--eos-token", options.eos_token)),
        "a block-diffusion checkpoint (its run's settings decide)",
    )
    source = distill_diffusion.open_source(found)
    tokenizer = source.tokenizer
  else:
    _refuse(
        options,
        (("--threshold", options.threshold),
         ("--steps-per-block", options.steps_per_block)),
        "an AR checkpoint (not a block-diffusion run or export)",
    )
    directory = distill_ar.check_checkpoint(options.checkpoint)
    tokenizer = distill_ar.load_tokenizer(directory, options.eos_token)
  prompts = prompts_lib.read_prompts(
      options.prompts,
      tokenizer,
      file_format=options.format,
      bad_rows=options.bad_rows,
  )

  def generate() -> list[list[int]]:
    if found is not None:
      return distill_diffusion.denoise_completions(
          distill_diffusion.load_model(source),
          source,
          prompts.texts,
          max_new_tokens=options.max_new_tokens,
          batch_size=options.batch_size,
          threshold=(
              DEFAULT_THRESHOLD
              if options.threshold is None
              else options.threshold
          ),
          steps_per_block=options.steps_per_block,
          temperature=options.temperature,
          seed=options.seed,
      )
    try:
      model = checkpoints.load_hf(directory, dtype=options.dtype or "float32")
    except ValueError as e:
      raise errors.UsageError(
          f"checkpoint {options.checkpoint}: {errors.one_line(e)}"
      ) from None
    return distill_ar.sample_completions(
        model,
        tokenizer,
        prompts.texts,
        max_new_tokens=options.max_new_tokens,
        batch_size=options.batch_size,
        temperature=options.temperature,
        top_p=options.sampling_top_p,
        seed=options.seed,
    )

  return tokenizer, prompts, generate


def run(options: Options) -> dict[str, Any]:
  """Checks everything, generates, writes `options.output`; the summary.

  Every check that needs no model (checkpoint directory and kind, output
  file, tokenizer, every prompt row) runs before the model is loaded.

  Returns:
    `{"output", "rows", "skipped_rows", "empty", "truncated"}`.
  """
  output = check_output(options.output, options.overwrite)
  tokenizer, prompts, generate = _generator(options)
  generated = generate()
  rows, empty, truncated = [], 0, 0
  for prompt, ids in zip(prompts.texts, generated):
    ids, stopped = cut_at_eos(ids, tokenizer.eos_id())
    truncated += not stopped and len(ids) >= options.max_new_tokens
    completion = tokenizer.decode(ids)
    if not completion:
      empty += 1
      continue
    rows.append({"prompt": prompt, "completion": completion})
  write_rows(output, rows)
  return {
      "output": str(output),
      "rows": len(rows),
      "skipped_rows": prompts.skipped,
      "empty": empty,
      "truncated": truncated,
  }


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(_parser().format_help())
    return 0
  summary = run(parse_args(argv))
  print(
      f"wrote {summary['rows']} rows to {summary['output']}"
      f" ({summary['skipped_rows']} bad prompt rows skipped,"
      f" {summary['empty']} empty completions dropped,"
      f" {summary['truncated']} cut at --max-new-tokens)"
  )
  return 0


__all__ = [
    "DEFAULT_THRESHOLD",
    "Options",
    "check_output",
    "cut_at_eos",
    "main",
    "parse_args",
    "run",
    "write_rows",
]
