"""The notebooks' code, top to bottom, each in one plain Python process.

Where a Jupyter kernel cannot run (the lent TPU refuses TCP sockets, which
a kernel talks over) this runs each notebook's code cells in order in a
fresh `python` process: IPython's `%` and `!` lines become `pass`,
`display` prints what it shows (and stands in for `IPython.display` where
IPython is not installed), figures go to files (Agg). It reports each
notebook's wall time, its exit status and the last lines it printed (the
exact match and speed figures the notebooks end with), on whatever JAX
backend the process finds: on a TPU, the times the docs record.

    python benchmarks/notebooks.py                 # all three, as committed
    python benchmarks/notebooks.py --fast --only 01_sft --json rows.json

`--fast` flips the parameters cell to `FAST = True`, the short variant the
test suite runs. The notebooks run one after another (one process holds a
TPU at a time), each in a scratch directory (`--workdir`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
_MAGIC = re.compile(r"^(\s*)[%!].*$")
_PRELUDE = '''\
import sys, types
try:
  from IPython.display import display
except ImportError:  # no IPython here: show what would be displayed
  class Image:
    def __init__(self, data=None, **kwargs):
      self.data = data
    def __repr__(self):
      return f"<Image {self.data!r}>"
  def display(*objects, **kwargs):
    print(*objects)
  _ipython = types.ModuleType("IPython")
  _ipython.display = types.ModuleType("IPython.display")
  _ipython.display.Image, _ipython.display.display = Image, display
  sys.modules["IPython"] = _ipython
  sys.modules["IPython.display"] = _ipython.display
'''


def notebook_source(path: pathlib.Path, fast: bool) -> str:
  """The notebook's code cells as one Python program.

  Raises:
    ValueError: `fast` and the notebook has no `FAST = False` line.
  """
  cells = [
      "".join(cell["source"])
      for cell in json.loads(path.read_text())["cells"]
      if cell["cell_type"] == "code"
  ]
  if fast:
    flagged = [i for i, c in enumerate(cells) if "FAST = False" in c]
    if len(flagged) != 1:
      raise ValueError(f"{path.name}: no single `FAST = False` line to flip")
    cells[flagged[0]] = cells[flagged[0]].replace("FAST = False",
                                                  "FAST = True")
  lines = [
      _MAGIC.sub(r"\1pass", line)
      for cell in cells
      for line in cell.splitlines()
  ]
  return _PRELUDE + "\n".join(lines) + "\n"


def run_notebook(path: pathlib.Path, workdir: pathlib.Path, fast: bool,
                 timeout: float) -> dict:
  """Runs one notebook's code in a fresh process; its row."""
  workdir.mkdir(parents=True, exist_ok=True)
  script = workdir / f"{path.stem}.py"
  script.write_text(notebook_source(path, fast))
  env = dict(os.environ, MPLBACKEND="Agg")
  start = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, str(script)], cwd=workdir,
                          env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    code, out, err = done.returncode, done.stdout, done.stderr
  except subprocess.TimeoutExpired as e:
    code = "timeout"
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
  seconds = time.perf_counter() - start
  tail = [line for line in out.splitlines() if line.strip()][-6:]
  if code != 0:
    tail += [line for line in err.splitlines() if line.strip()][-6:]
  return dict(notebook=path.stem, fast=fast, seconds=seconds, exit=code,
              tail=tail)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--fast", action="store_true",
                      help="the short variant (FAST = True), as the tests")
  parser.add_argument("--only", default=None,
                      help="comma-separated notebook names (default: all)")
  parser.add_argument("--workdir", default=None,
                      help="where the notebooks run (default: a temp dir)")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="seconds per notebook")
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)
  paths = sorted(NOTEBOOKS.glob("*.ipynb"))
  if args.only:
    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - {p.stem for p in paths})
    if unknown:
      parser.error(f"--only: no notebook {unknown}; there are"
                   f" {[p.stem for p in paths]}")
    paths = [p for p in paths if p.stem in wanted]
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="notebooks_"))
  rows = []
  for path in paths:
    row = run_notebook(path, workdir / path.stem, args.fast, args.timeout)
    rows.append(row)
    print(f"| {row['notebook']} | {'fast' if args.fast else 'default'} |"
          f" {row['seconds']:.1f} s | exit {row['exit']} |", flush=True)
    for line in row["tail"]:
      print(f"    {line}", flush=True)
    if args.json:  # after each, so that a run cut short keeps them
      pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
