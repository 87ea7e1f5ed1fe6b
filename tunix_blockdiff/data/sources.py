"""Rows from files, by random access, without loading a corpus into memory.

Three formats, chosen by extension under `format="auto"`:

  jsonl    one JSON object per line (`.jsonl`, `.json`); the byte offset of
           every non-blank line is indexed once into an int64 NumPy array,
           and a row is read by seeking to it.
  parquet  `.parquet`; rows are read one row group at a time with pyarrow
           (the last group read is kept).
  hf_disk  a directory written by Hugging Face `datasets`' `save_to_disk`
           (memory-mapped Arrow files).

Every source is a grain `RandomAccessDataSource` (`__len__`, `__getitem__`)
whose item i is `(location, row)`: `location` is `"file:line"` (jsonl: the
1-based line number; parquet and hf_disk: the 1-based row number), `row` a
dict. `open_source` concatenates the files of a path list or glob.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import pathlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tunix_blockdiff import errors

FORMATS = ("auto", "jsonl", "parquet", "hf_disk")
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_CHUNK = 1 << 18


class RowError(errors.UsageError):
  """A row that cannot be read or used; the message starts with file:line."""


def resolve_paths(paths: str | os.PathLike | Sequence[Any]) -> list[str]:
  """Files named by a path, a glob, or a list of them (sorted per glob).

  Raises:
    MissingFileError: A path or glob names nothing.
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  resolved = []
  for pattern in paths:
    pattern = os.path.expanduser(os.fspath(pattern))
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else []
    if not matches:
      if not os.path.exists(pattern):
        raise errors.MissingFileError(
            f"dataset path {pattern!r} does not exist"
        )
      matches = [pattern]
    resolved.extend(matches)
  return resolved


def detect_format(path: str, format: str = "auto") -> str:  # pylint: disable=redefined-builtin
  """The format of `path`: `format` itself unless it is `auto`."""
  if format not in FORMATS:
    raise errors.UsageError(
        f"dataset.format must be one of {FORMATS}, got {format!r}"
    )
  if format != "auto":
    return format
  if os.path.isdir(path):
    return "hf_disk"
  suffix = pathlib.Path(path).suffix.lower()
  if suffix not in _EXTENSIONS:
    raise errors.UsageError(
        f"cannot tell the format of {path!r} from its extension; use"
        f" {sorted(_EXTENSIONS)}, a save_to_disk directory, or set"
        " dataset.format"
    )
  return _EXTENSIONS[suffix]


def sniff_format(path: str) -> str | None:
  """The format `path`'s content shows, or None when it is not clear.

  A directory is `hf_disk`; a file starting with parquet's magic `PAR1` is
  `parquet`; one whose first non-blank byte opens a JSON value (`{`, `[`,
  `"`) is `jsonl`.
  """
  if os.path.isdir(path):
    return "hf_disk"
  try:
    with open(path, "rb") as f:
      head = f.read(4096)
  except OSError:
    return None
  if head.startswith(b"PAR1"):
    return "parquet"
  stripped = head.lstrip()
  if stripped[:1] in (b"{", b"[", b'"'):
    return "jsonl"
  return None


def check_format(path: str, format: str) -> None:  # pylint: disable=redefined-builtin
  """Raises a one-line UsageError when `path`'s content is not `format`."""
  found = sniff_format(path)
  if found is not None and found != format:
    raise errors.UsageError(
        f"{path}: dataset.format is {format!r}, but the file looks like"
        f" {found} ({_EVIDENCE[found]}); set dataset.format={found} or auto"
    )
  if format == "hf_disk" and not os.path.isdir(path):
    raise errors.UsageError(
        f"{path}: dataset.format is 'hf_disk', which is a directory written by"
        " datasets' save_to_disk, but this is a file"
    )


_EVIDENCE = {
    "hf_disk": "a directory",
    "parquet": "it starts with parquet's magic bytes PAR1",
    "jsonl": "its first character opens a JSON value",
}


_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\r\n\v\f")] = True


def _index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
  """int64 [N] byte offsets and 1-based numbers of the non-blank lines.

  The file is scanned in chunks with NumPy; memory is 16 bytes per row plus
  one chunk (and the longest line), whatever the file size.
  """
  offsets, numbers = [], []
  position, line, pending = 0, 0, b""  # `position`: offset of pending[0]
  with open(path, "rb") as f:
    while True:
      chunk = f.read(_CHUNK)
      data = np.frombuffer(pending + chunk, np.uint8)
      ends = np.flatnonzero(data == ord("\n"))
      if (
          not chunk
          and data.size
          and (not ends.size or ends[-1] < data.size - 1)
      ):
        ends = np.append(ends, data.size)  # a last line without a newline
      starts = np.concatenate([[0], ends[:-1] + 1]) if ends.size else ends
      content = np.concatenate([[0], np.cumsum(~_BLANK[data], dtype=np.int32)])
      keep = content[np.minimum(ends, data.size)] > content[starts]
      offsets.append((position + starts[keep]).astype(np.int64))
      numbers.append((line + 1 + np.flatnonzero(keep)).astype(np.int64))
      line += ends.size
      consumed = int(ends[-1]) + 1 if ends.size else 0
      pending = bytes(data[consumed:])
      position += consumed
      if not chunk:
        break
  return np.concatenate(offsets), np.concatenate(numbers)


class JsonlSource:
  """Random access to the JSON lines of one file (blank lines skipped)."""

  def __init__(self, path: str):
    self.path = path
    self._offsets, self._lines = _index_lines(path)
    self._file = None

  def __len__(self) -> int:
    return int(self._offsets.size)

  def location(self, index: int) -> str:
    return f"{self.path}:{int(self._lines[index])}"

  def __getitem__(self, index: int) -> tuple[str, Any]:
    if self._file is None:
      self._file = open(self.path, "rb")  # pylint: disable=consider-using-with
    self._file.seek(int(self._offsets[index]))
    text = self._file.readline()
    location = self.location(index)
    try:
      return location, json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RowError(f"{location}: not valid JSON ({e})") from None

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_file"] = None
    return state


class ParquetSource:
  """Random access to the rows of one parquet file, a row group at a time."""

  def __init__(self, path: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    self.path = path
    try:
      metadata = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow.ArrowInvalid and friends.
      first = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise errors.UsageError(
          f"{path}: not a readable parquet file ({type(e).__name__}: {first})"
      ) from None
    sizes = [
        metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)
    ]
    self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    self._cached = (-1, None)

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> tuple[str, Any]:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    group = int(np.searchsorted(self._starts, index, side="right")) - 1
    if self._cached[0] != group:
      table = pq.ParquetFile(self.path).read_row_group(group)
      self._cached = (group, table.to_pylist())
    row = self._cached[1][index - int(self._starts[group])]
    return f"{self.path}:{index + 1}", row


class HFDiskSource:
  """Random access to a `datasets.Dataset` saved with `save_to_disk`."""

  def __init__(self, path: str):
    import datasets  # pylint: disable=g-import-not-at-top

    self.path = path
    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
      raise errors.UsageError(
          f"{path!r} holds a DatasetDict with splits {sorted(dataset)}; point"
          " dataset.train/eval at one split's directory"
      )
    self._dataset = dataset

  def __len__(self) -> int:
    return len(self._dataset)

  def __getitem__(self, index: int) -> tuple[str, Any]:
    return f"{self.path}:{index + 1}", self._dataset[int(index)]


_SOURCES = {
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
    "hf_disk": HFDiskSource,
}


class ConcatSource:
  """Several sources read as one, in order."""

  def __init__(self, sources: Sequence[Any]):
    self.sources = list(sources)
    self._starts = np.concatenate(
        [[0], np.cumsum([len(s) for s in self.sources], dtype=np.int64)]
    ).tolist()

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> tuple[str, Any]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"row {index} out of range [0, {len(self)})")
    source = bisect.bisect_right(self._starts, index) - 1
    return self.sources[source][index - self._starts[source]]


def _open_one(path: str, format: str):  # pylint: disable=redefined-builtin
  check_format(path, format)
  try:
    return _SOURCES[format](path)
  except errors.UsageError:
    raise
  except OSError as e:  # Permissions, a directory given as a file, ...
    if e.strerror:
      raise errors.UsageError(f"{path}: cannot be read ({e.strerror})"
                              ) from None
    first = (str(e).strip().splitlines() or [""])[0]
    raise errors.UsageError(
        f"{path}: not a readable {format} source ({type(e).__name__}:"
        f" {first})"
    ) from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    # A save_to_disk directory that `datasets` cannot load, and the like.
    first = (str(e).strip().splitlines() or [""])[0]
    raise errors.UsageError(
        f"{path}: not a readable {format} source ({type(e).__name__}:"
        f" {first})"
    ) from None


def describe(source: Any, limit: int = 3) -> str:
  """The files of a source, for messages (`a.jsonl, b.jsonl and 2 more`)."""
  paths = [getattr(s, "path", "?")
           for s in getattr(source, "sources", [source])]
  shown = ", ".join(str(p) for p in paths[:limit])
  return shown + (f" and {len(paths) - limit} more" if len(paths) > limit
                  else "")


def check_rows(
    paths: str | os.PathLike | Sequence[Any],
    check: Callable[[str, Any], None],
    *,
    format: str = "auto",  # pylint: disable=redefined-builtin
    bad_rows: str = "skip",
    limit: int | None = 1000,
) -> None:
  """Opens the files `paths` names and checks their rows with `check`.

  For checks before any compute: an empty, unreadable or malformed source,
  or one of the wrong columns, stops the job here, naming its files.

  Args:
    paths: A path, a glob, or a list of them.
    check: `(location, row) -> None`, raising `UsageError` for a bad row.
    format: One of `FORMATS`.
    bad_rows: `error`: every row read must pass; `skip`: one must.
    limit: Rows read at most (None: all of them).

  Raises:
    UsageError: naming the files (and the first bad row's `file:line`).
  """
  source = open_source(paths, format=format)
  if not len(source):
    raise errors.UsageError(f"{describe(source)}: no rows (empty)")
  count = len(source) if limit is None else min(len(source), limit)
  first = None
  for index in range(count):
    try:
      check(*source[index])
    except errors.UsageError as e:
      if bad_rows == "error":
        raise
      first = first or errors.one_line(e)
      continue
    if bad_rows != "error":
      return
  if bad_rows != "error":
    raise errors.UsageError(
        f"{describe(source)}: none of the first {count} rows is usable; the"
        f" first problem: {first}")


def open_source(
    paths: str | os.PathLike | Sequence[Any],
    *,
    format: str = "auto",  # pylint: disable=redefined-builtin
) -> ConcatSource:
  """A random-access source over every file `paths` names.

  Args:
    paths: A path, a glob, or a list of them.
    format: One of `FORMATS`; `auto` chooses per file by extension (a
      directory is `hf_disk`).

  Returns:
    A `ConcatSource`; item i is `(location, row)`.
  """
  return ConcatSource(
      [_open_one(p, detect_format(p, format)) for p in resolve_paths(paths)]
  )


def read_rows(
    paths: str | os.PathLike | Sequence[Any],
    *,
    format: str = "auto",  # pylint: disable=redefined-builtin
) -> Iterator[tuple[str, Any]]:
  """Streams `(location, row)` over the files `paths` names, in order.

  Args:
    paths: A path, a glob, or a list of them (jsonl, parquet, hf_disk).
    format: One of `FORMATS`.

  Yields:
    `("file:line", row)`; a jsonl line that is not JSON raises `RowError`.
  """
  source = open_source(paths, format=format)
  for index in range(len(source)):
    yield source[index]


__all__ = [
    "ConcatSource",
    "FORMATS",
    "HFDiskSource",
    "JsonlSource",
    "ParquetSource",
    "RowError",
    "check_format",
    "check_rows",
    "describe",
    "detect_format",
    "sniff_format",
    "open_source",
    "read_rows",
    "resolve_paths",
]
