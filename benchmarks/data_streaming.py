"""How much memory and time reading a jsonl dataset takes, by row count.

Writes a jsonl file of N `{"prompt", "completion"}` rows (digit strings, the
character tokenizer's alphabet), then measures, in a fresh process per
step so peak memory is the step's own: indexing the line offsets
(`data.open_source`), the validating pass of `data.FileExamples` (read,
tokenize, check every row), and random access to rows. Peak memory is the
growth of the process's maximum resident set over the step, compared with
the file size: the index holds 16 bytes per row and never the rows.

    python benchmarks/data_streaming.py                # 500,000 rows
    python benchmarks/data_streaming.py 2000000        # any row count
    tunix-blockdiff bench data_streaming [ROWS]        # the same, via the CLI
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

STEP = r"""
import json, resource, sys, time
from tunix_blockdiff import data, tasks
path, step = sys.argv[1], sys.argv[2]
def peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = peak_mib()
start = time.perf_counter()
source = data.open_source(path)
result = {"rows": len(source), "index_seconds": time.perf_counter() - start}
if step == "validate":
  start = time.perf_counter()
  examples = data.FileExamples(
      source, tokenizer=tasks.CharTokenizer(), seq_len=64, vocab_size=50,
      mask_token_id=3)
  result["validate_seconds"] = time.perf_counter() - start
  start = time.perf_counter()
  for i in range(0, len(examples), max(1, len(examples) // 1000)):
    examples[i]
  result["random_access_ms"] = (time.perf_counter() - start) * 1e3 / 1000
result["peak_growth_mib"] = peak_mib() - before
print(json.dumps(result))
"""


def write_rows(path: pathlib.Path, rows: int) -> None:
  with open(path, "w") as f:
    for i in range(rows):
      digits = f"{i:07d}"
      f.write(
          json.dumps({"prompt": digits * 4, "completion": digits[::-1] * 4})
          + "\n"
      )


def measure(path: pathlib.Path, step: str) -> dict:
  out = subprocess.run(
      [sys.executable, "-c", STEP, str(path), step],
      check=True,
      capture_output=True,
      text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
  rows = int(argv[0]) if argv else 500_000
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "rows.jsonl"
    start = time.perf_counter()
    write_rows(path, rows)
    size = path.stat().st_size / 2**20
    print(
        f"wrote {rows} rows, {size:.1f} MiB in"
        f" {time.perf_counter() - start:.1f}s"
    )
    index = measure(path, "index")
    full = measure(path, "validate")
  print(
      f"index: {index['index_seconds']:.2f}s, peak memory growth"
      f" {index['peak_growth_mib']:.1f} MiB for a {size:.1f} MiB file"
  )
  print(
      f"validating pass: {full['validate_seconds']:.1f}s"
      f" ({1e6 * full['validate_seconds'] / rows:.0f} us/row), peak memory"
      f" growth {full['peak_growth_mib']:.1f} MiB; random access"
      f" {full['random_access_ms']:.2f} ms/row"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
