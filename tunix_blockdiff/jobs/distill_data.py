"""`tunix-blockdiff distill-data HF_DIR PROMPTS OUT.jsonl`: distillation data.

Sequence-level distillation data for a conversion that decodes in parallel:
an autoregressive Hugging Face checkpoint (any family `models.checkpoints.
load_hf` reads: Qwen3, Qwen2, Llama3, Gemma3) completes every prompt of a
prompts file with Tunix's own `Sampler`, greedily by default, and each
completion is written as a `{"prompt", "completion"}` jsonl row, so any SFT
recipe trains on the model's own outputs with `dataset.train=OUT.jsonl`.

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
from tunix_blockdiff.models import hf_configs

USAGE = "usage: tunix-blockdiff distill-data HF_DIR PROMPTS OUT.jsonl [options]"
DTYPES = ("float32", "bfloat16")
# Any of these makes a directory hold a Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one-line `UsageError`s, not `sys.exit`."""

  def error(self, message: str):
    raise errors.UsageError(f"{message}; {USAGE} (see --help)")


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog="tunix-blockdiff distill-data",
      usage=USAGE.removeprefix("usage: "),
      description=__doc__.split("\n\n", 1)[1],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("checkpoint", metavar="HF_DIR",
                      help="Hugging Face model directory (with its tokenizer)")
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
  parser.add_argument("--dtype", choices=DTYPES, default="float32")
  parser.add_argument("--eos-token", default=None,
                      help="stop token (default: the tokenizer's EOS)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty output file")
  return parser


@dataclasses.dataclass(frozen=True)
class Options:
  """Validated options of `distill-data` (flag names in the messages).

  Attributes:
    checkpoint: Hugging Face model directory.
    prompts: Prompts file(s): a path, a glob.
    output: The jsonl file written.
    max_new_tokens: Decoding steps per prompt (>= 1).
    batch_size: Prompts per `Sampler` call (>= 1).
    temperature: 0 for greedy; > 0 samples.
    top_p: Nucleus threshold in (0, 1] when sampling (None: 1).
    seed: Sampling seed (batch i uses `fold_in(PRNGKey(seed), i)`).
    bad_rows: `skip` or `error`.
    format: Prompts file format (`data.sources.FORMATS`).
    dtype: Model dtype (`float32` or `bfloat16`).
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
  dtype: str = "float32"
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
    if self.dtype not in DTYPES:
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


def check_checkpoint(path: str) -> pathlib.Path:
  """`path` as a Hugging Face model directory with a tokenizer, or raises.

  Raises:
    MissingFileError: No such directory, or no config.json, *.safetensors
      or tokenizer files in it.
    UsageError: config.json is not JSON or not of a supported family.
  """
  directory = pathlib.Path(path).expanduser()
  what = "a Hugging Face model directory (config.json, *.safetensors, tokenizer)"
  if not directory.is_dir():
    raise errors.MissingFileError(f"checkpoint {path} is not a directory: need {what}")
  if not (directory / "config.json").is_file():
    raise errors.MissingFileError(f"checkpoint {path} has no config.json: need {what}")
  if not list(directory.glob("*.safetensors")):
    raise errors.MissingFileError(
        f"checkpoint {path} has no *.safetensors files: need {what}"
    )
  if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
    raise errors.MissingFileError(
        f"checkpoint {path} has no tokenizer files (one of {_TOKENIZER_FILES})"
    )
  try:
    hf_config = json.loads((directory / "config.json").read_text())
    hf_configs.family_of(hf_config)
  except (json.JSONDecodeError, ValueError) as e:
    raise errors.UsageError(f"checkpoint {path}: {errors.one_line(e)}") from None
  return directory


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


def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
) -> list[list[int]]:
  """Each prompt's generated token ids, with Tunix's `Sampler`.

  One compiled program: every call has `batch_size` rows (the last batch is
  padded by repeating its last prompt) and the prompt width of the longest
  prompt. Greedy when `top_p` is None (Tunix's rule); otherwise nucleus
  sampling at `temperature`, batch i with key `fold_in(PRNGKey(seed), i)`.

  Args:
    model: A Tunix causal LM.
    tokenizer: The checkpoint's tokenizer (`encode`, `decode`, `bos_id`,
      `eos_id`, `pad_id`); the Sampler adds BOS.
    prompts: Prompt strings.
    max_new_tokens: Decoding steps.
    batch_size: Rows per call.
    temperature: Sampling temperature (> 0 when `top_p` is set).
    top_p: Nucleus threshold; None: greedy.
    seed: Sampling seed.

  Returns:
    Per prompt, the ids the Sampler returns (ending before its first EOS,
    or `max_new_tokens` long).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from tunix.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top

  config = model.config

  def make_sampler(cache_size: int):
    return sampler_lib.Sampler(
        model,
        tokenizer,
        sampler_lib.CacheConfig(
            cache_size=cache_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ),
    )

  # The prompt width as the Sampler tokenizes (BOS and all); building a
  # Sampler compiles nothing.
  probe = make_sampler(1)
  max_prompt_length = max(len(probe.tokenize(p)) for p in prompts)
  sampler = make_sampler(max_prompt_length + max_new_tokens)
  out = []
  for i, start in enumerate(range(0, len(prompts), batch_size)):
    chunk = list(prompts[start : start + batch_size])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_size - real)
    result = sampler(
        chunk,
        max_generation_steps=max_new_tokens,
        max_prompt_length=max_prompt_length,
        temperature=temperature,
        top_p=top_p,
        seed=jax.random.fold_in(jax.random.PRNGKey(seed), i),
        eos_tokens=[tokenizer.eos_id()],
    )
    out.extend([int(t) for t in tokens] for tokens in list(result.tokens)[:real])
  return out


def _load_tokenizer(directory: pathlib.Path, eos_token: str | None):
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  try:
    tokenizer = checkpoints.HFTokenizer(directory, eos_token=eos_token)
  except (OSError, ValueError) as e:
    raise errors.UsageError(
        f"cannot load the tokenizer of {directory}: {errors.one_line(e)}"
    ) from None
  try:
    eos = tokenizer.eos_id()
  except TypeError:  # int(None): the tokenizer names no EOS.
    eos = None
  if eos is None or (eos_token and eos == tokenizer.unk_id()):
    raise errors.UsageError(
        f"the tokenizer of {directory} has no EOS token"
        + (f" {eos_token!r}" if eos_token else "; pass --eos-token")
    )
  return tokenizer


def write_rows(path: pathlib.Path, rows: Sequence[Mapping[str, str]]) -> None:
  """Writes jsonl rows to `path` atomically (a sibling file, then renamed)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + ".partial")
  with partial.open("w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(partial, path)


def run(options: Options) -> dict[str, Any]:
  """Checks everything, generates, writes `options.output`; the summary.

  Every check that needs no model (checkpoint directory, output file,
  tokenizer, every prompt row) runs before the model is loaded.

  Returns:
    `{"output", "rows", "skipped_rows", "empty", "truncated"}`.
  """
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  directory = check_checkpoint(options.checkpoint)
  output = check_output(options.output, options.overwrite)
  tokenizer = _load_tokenizer(directory, options.eos_token)
  prompts = prompts_lib.read_prompts(
      options.prompts,
      tokenizer,
      file_format=options.format,
      bad_rows=options.bad_rows,
  )
  try:
    model = checkpoints.load_hf(directory, dtype=options.dtype)
  except ValueError as e:
    raise errors.UsageError(
        f"checkpoint {options.checkpoint}: {errors.one_line(e)}"
    ) from None
  generated = sample_completions(
      model,
      tokenizer,
      prompts.texts,
      max_new_tokens=options.max_new_tokens,
      batch_size=options.batch_size,
      temperature=options.temperature,
      top_p=options.sampling_top_p,
      seed=options.seed,
  )
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
    "Options",
    "check_checkpoint",
    "check_output",
    "cut_at_eos",
    "main",
    "parse_args",
    "run",
    "sample_completions",
    "write_rows",
]
