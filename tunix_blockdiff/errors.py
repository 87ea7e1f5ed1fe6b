"""Errors a user makes and can fix: the command line prints them as one line.

`UsageError` marks a bad recipe value, command-line argument or data row. The
`tunix-blockdiff` command catches it (and only it) and prints its message as
one line with exit status 2; any other exception is an internal failure and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Iterable, NoReturn


class UsageError(ValueError):
  """A recipe, argument or data error; the message says what is allowed."""


class MissingFileError(UsageError, FileNotFoundError):
  """A file or directory the user named does not exist."""


class ArgumentParser(argparse.ArgumentParser):
  """An `argparse` parser whose errors are `UsageError`s (one line, exit 2).

  argparse prints its usage and exits on a bad argument; the jobs' parsers
  raise instead, so the `tunix-blockdiff` command reports every usage error
  the same way.
  """

  def error(self, message: str) -> NoReturn:
    usage = " ".join(self.format_usage().split())
    raise UsageError(f"{message}; {usage} (see --help)")


def nearest(name: str, valid: Iterable[str]) -> str:
  """`; did you mean 'x'?` for the closest valid name, or ``."""
  match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
  return f"; did you mean {match[0]!r}?" if match else ""


def one_line(message: str) -> str:
  """`message` with its line breaks folded into spaces."""
  return " ".join(str(message).split())


__all__ = [
    "ArgumentParser", "MissingFileError", "UsageError", "nearest", "one_line"
]
