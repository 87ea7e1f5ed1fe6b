"""Where the test suite's time goes: a pytest plugin and its summary.

Run the suite with it (each xdist worker appends one JSON line per test to
`$SUITE_PROFILE_DIR/<worker>.jsonl`):

  SUITE_PROFILE_DIR=/tmp/prof PYTHONPATH=tools pytest -n 2 -p suite_profile

then summarise:

  python tools/suite_profile.py /tmp/prof

Per test it records the wall time, the worker's own CPU, the CPU of the
processes the test waited for (jobs under `launch`, notebook kernels), and
JAX's compile-stage durations in the worker (`jax.monitoring`: tracing,
lowering to StableHLO, XLA backend compilation). Tunix's metrics logger
clears JAX's listeners, so the listener is re-added before every test and
the clearing is disabled while the plugin runs.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
import time

import pytest

_TOTALS: collections.Counter = collections.Counter()
# Lowerings by function name: (count, seconds). Eager ops lower one program
# per primitive and shape (`add`, `dot_general`, ...), so a test that calls
# a model op by op shows here as many lowerings of primitives' names.
_LOWERED: collections.Counter = collections.Counter()
_LOWERED_S: collections.Counter = collections.Counter()
_TRACED_S: collections.Counter = collections.Counter()
_COMPILED_S: collections.Counter = collections.Counter()
SMALL_PROGRAM_S = 0.04
_STAGES = {
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile": "/jax/core/compile/backend_compile_duration",
}


def _listen(event: str, duration: float, **kwargs) -> None:
  _TOTALS[event] += duration
  if event == _STAGES["lower"]:
    name = str(kwargs.get("fun_name", "?"))
    _LOWERED[name] += 1
    _LOWERED_S[name] += duration
  elif event == _STAGES["trace"]:
    _TRACED_S[str(kwargs.get("fun_name", "?"))] += duration
  elif event == _STAGES["compile"]:
    _COMPILED_S[str(kwargs.get("fun_name", "?"))] += duration


def _install() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import monitoring  # pylint: disable=g-import-not-at-top

  jax.monitoring.clear_event_listeners = lambda: None
  monitoring.clear_event_listeners = lambda: None
  if _listen not in monitoring._event_duration_secs_listeners:  # pylint: disable=protected-access
    monitoring._event_duration_secs_listeners.append(_listen)  # pylint: disable=protected-access


def _cpu(times: os.times_result) -> tuple[float, float]:
  return (times.user + times.system,
          times.children_user + times.children_system)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  """Times one test (hookwrapper); see the module docstring."""
  _install()
  start, before = time.time(), dict(_TOTALS)
  _LOWERED.clear()
  _LOWERED_S.clear()
  _TRACED_S.clear()
  _COMPILED_S.clear()
  own, children = _cpu(os.times())
  yield
  own_after, children_after = _cpu(os.times())
  record = {
      "id": item.nodeid,
      "wall": round(time.time() - start, 3),
      "cpu": round(own_after - own, 3),
      "children_cpu": round(children_after - children, 3),
      **{stage: round(_TOTALS[event] - before.get(event, 0.0), 3)
         for stage, event in _STAGES.items()},
      "lowerings": sum(_LOWERED.values()),
      # Every lowered function, most lowering time first: [name, count, s].
      "lowered": [[name, _LOWERED[name], round(seconds, 3)]
                  for name, seconds in _LOWERED_S.most_common()],
      # Every compiled function, most XLA compilation time first: [name, s].
      "compiled": [[name, round(seconds, 3)]
                   for name, seconds in _COMPILED_S.most_common()],
      # The five functions with the most tracing time: [name, s].
      "traced": [[name, round(seconds, 3)]
                 for name, seconds in _TRACED_S.most_common(5)],
  }
  directory = pathlib.Path(os.environ.get("SUITE_PROFILE_DIR", "suite_profile"))
  directory.mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(directory / f"{worker}.jsonl", "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")


def summarize(directory: str | os.PathLike, slowest: int = 10) -> str:
  """Totals over every test, and the slowest tests, as text."""
  records = [
      json.loads(line)
      for path in sorted(pathlib.Path(directory).glob("*.jsonl"))
      for line in path.read_text(encoding="utf-8").splitlines()
  ]
  if not records:
    raise ValueError(f"no *.jsonl records under {directory}")
  total = {key: sum(r[key] for r in records)
           for key in ("wall", "cpu", "children_cpu", *_STAGES)}
  lines = [
      f"{len(records)} tests, {total['wall']:.0f} s of test time;"
      f" the workers' CPU {total['cpu']:.0f} s; launched processes' CPU {total['children_cpu']:.0f} s;"
      f" in-process tracing {total['trace']:.0f} s, lowering"
      f" {total['lower']:.0f} s, XLA compilation {total['compile']:.0f} s",
  ]
  for record in sorted(records, key=lambda r: -r["wall"])[:slowest]:
    lines.append(f"{record['wall']:8.1f} s  {record['id']}")
  # Lowering by function name.
  seconds, counts = collections.Counter(), collections.Counter()
  for record in records:
    for name, count, spent in record.get("lowered", ()):
      seconds[name] += spent
      counts[name] += count
  if seconds:
    lines.append(f"{sum(r.get('lowerings', 0) for r in records)} lowerings;"
                 " the most lowering time, by function:")
    for name, spent in seconds.most_common(slowest):
      lines.append(f"{spent:8.1f} s  x{counts[name]:<5d} {name}")
  compiled = collections.Counter()
  for record in records:
    for name, spent in record.get("compiled", ()):
      compiled[name] += spent
  if compiled:
    lines.append("the most XLA compilation time, by function:")
    for name, spent in compiled.most_common(slowest):
      lines.append(f"{spent:8.1f} s  x{counts[name]:<5d} {name}")
    # Small programs: names whose compilations average under
    # SMALL_PROGRAM_S, mostly eager op-by-op dispatch (a jitted primitive or
    # jnp function per new shape), where a fixed cost per program (an MLIR
    # context per lowering, XLA's per-compile setup) is most of the time.
    small = [name for name in compiled
             if compiled[name] < SMALL_PROGRAM_S * max(counts[name], 1)]
    lines.append(
        f"small programs (< {SMALL_PROGRAM_S * 1000:.0f} ms a compile):"
        f" {sum(counts[n] for n in small)} lowerings,"
        f" {sum(seconds[n] for n in small):.0f} s lowering +"
        f" {sum(compiled[n] for n in small):.0f} s compiling")
  return "\n".join(lines)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python tools/suite_profile.py SUITE_PROFILE_DIR")
  print(summarize(sys.argv[1]))
