"""The `tunix-blockdiff` command: sft, generate, export, rl, opd, bench.

Each subcommand lives in `tunix_blockdiff.jobs.<name>` and is imported only
when used, so `tunix-blockdiff --help` is instant.
"""

from __future__ import annotations

import importlib
import sys
import traceback

from tunix_blockdiff import errors

COMMANDS = {
    "sft": "block-diffusion SFT (default: the embedded tiny recipe)",
    "generate": "generate from a checkpoint and render the denoising trajectory",
    "export": "write an SFT run as a Hugging Face directory (LoRA merged)",
    "rl": "GRPO with the block-diffusion rollout",
    "opd": "on-policy distillation into a block-diffusion student",
    "bench": "run a benchmark script from benchmarks/",
    "launch": "run N local processes of a command as one JAX distributed job",
    "distill-data": "a model's own completions of prompts, as SFT jsonl",
}

USAGE = "usage: tunix-blockdiff {%s} [RECIPE.yaml] [key=value ...]\n\n%s" % (
    ",".join(COMMANDS),
    "\n".join(f"  {name:<12} {help_}" for name, help_ in COMMANDS.items()),
)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
  # `distill-data` lives in `jobs/distill_data.py`.
  module = importlib.import_module(
      f"tunix_blockdiff.jobs.{command.replace('-', '_')}"
  )
  try:
    result = module.main(rest)
  except errors.UsageError as e:
    # A recipe, argument or data error: one line, no traceback.
    print(
        f"tunix-blockdiff {command}: error: {errors.one_line(e)}",
        file=sys.stderr,
    )
    return 2
  except Exception as e:  # pylint: disable=broad-exception-caught
    # Not the user's mistake: its traceback, and a line saying what it is
    # (the system refused a file operation, or the package has a bug).
    traceback.print_exc()
    what = (f"system error: {type(e).__name__}: {errors.one_line(e)}"
            if isinstance(e, OSError) else
            "internal error (a bug in tunix-blockdiff, not in your recipe):"
            " please report it with the traceback above")
    print(f"tunix-blockdiff {command}: {what}", file=sys.stderr)
    return 1
  return int(result or 0)


if __name__ == "__main__":
  sys.exit(main())
