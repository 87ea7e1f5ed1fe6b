"""`tunix-blockdiff launch --processes N [--devices-per-process K] -- CMD ...`.

Starts N local processes of `tunix-blockdiff CMD ...` that form one JAX
distributed job: each gets the overrides `distributed.coordinator_address`
(a free local port), `distributed.num_processes=N` and its own
`distributed.process_id`, and, with `--devices-per-process K`, K simulated
CPU devices (XLA_FLAGS). Their output is forwarded line by line with a `[pN]`
prefix. When one process fails, the others are stopped (SIGTERM, then
SIGKILL after `--grace` seconds) and the launcher exits non-zero naming the
process that failed first; it exits 0 only when every process does.

For testing on one machine and for hosts with several accelerators; on a
TPU pod slice or under SLURM, run the command itself on every host with
`distributed={}` (auto-detection) instead (docs/many_hosts.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from tunix_blockdiff import errors


COMMANDS = ("sft", "generate", "rl", "opd")


def local_device_flags(num_devices: int) -> str:
  """XLA_FLAGS (the current ones plus a CPU device count) for a child process."""
  flags = [
      f
      for f in os.environ.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
  ]
  flags.append(f"--xla_force_host_platform_device_count={int(num_devices)}")
  return " ".join(flags)


def free_port() -> int:
  """A TCP port nobody listens on now (bound to 0, then released)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return int(sock.getsockname()[1])


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = errors.ArgumentParser(
      prog="tunix-blockdiff launch",
      description=__doc__.split("\n\n")[1],
  )
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument(
      "--devices-per-process",
      type=int,
      default=None,
      help="simulated CPU devices per process (default: leave XLA_FLAGS)",
  )
  parser.add_argument(
      "--grace",
      type=float,
      default=10.0,
      help="seconds between SIGTERM and SIGKILL of the survivors",
  )
  parser.add_argument("--port", type=int, default=None)
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(list(argv))
  command = list(args.command)
  if command and command[0] == "--":
    command = command[1:]
  if not command or command[0] not in COMMANDS:
    parser.error(f"after -- name one of {list(COMMANDS)}, got {command}")
  if args.processes < 1:
    parser.error(f"--processes must be >= 1, got {args.processes}")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error(
        f"--devices-per-process must be >= 1, got {args.devices_per_process}"
    )
  if any(arg.startswith("distributed.") for arg in command[1:]):
    parser.error("launch sets the distributed.* keys itself")
  args.command = command
  return args


PROGRAM = (sys.executable, "-m", "tunix_blockdiff.cli")


def process_argv(
    command: Sequence[str],
    port: int,
    n: int,
    i: int,
    program: Sequence[str] = PROGRAM,
) -> list[str]:
  """`tunix-blockdiff CMD ...` (or `program CMD ...`) for process i of n."""
  return [
      *program,
      *command,
      f"distributed.coordinator_address=127.0.0.1:{port}",
      f"distributed.num_processes={n}",
      f"distributed.process_id={i}",
  ]


def _forward(stream, prefix: str, sink) -> None:
  for line in iter(stream.readline, ""):
    sink.write(prefix + line)
    sink.flush()
  stream.close()


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int | None = None,
    grace: float = 10.0,
    port: int | None = None,
    program: Sequence[str] = PROGRAM,
) -> int:
  """Runs the N processes; 0 iff all exit 0 (see the module docstring).

  Args:
    command: `CMD [args ...]`, e.g. `["sft", "mesh.fsdp=8"]`.
    processes: N.
    devices_per_process: Simulated CPU devices per process (None: leave
      XLA_FLAGS as it is).
    grace: Seconds between SIGTERM and SIGKILL of the survivors.
    port: Coordinator port (None: a free one).
    program: What runs `command` (default `python -m tunix_blockdiff.cli`).

  Returns:
    0 when every process exits 0; else the first failure's exit code (1
    if it was 0 or negative), 130 after SIGINT or SIGTERM.
  """
  port = port or free_port()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if devices_per_process is not None:
    env["XLA_FLAGS"] = local_device_flags(devices_per_process)
    env.setdefault("JAX_PLATFORMS", "cpu")
  procs, threads = [], []
  for i in range(processes):
    proc = subprocess.Popen(
        process_argv(command, port, processes, i, program),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    procs.append(proc)
    thread = threading.Thread(
        target=_forward, args=(proc.stdout, f"[p{i}] ", sys.stdout), daemon=True
    )
    thread.start()
    threads.append(thread)
  failed = None
  # SIGTERM (a scheduler, `kill`) stops the children too, as Ctrl-C does.
  previous = signal.signal(signal.SIGTERM, _interrupt)
  try:
    while True:
      codes = [p.poll() for p in procs]
      bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if bad:
        failed = bad[0]
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    failed = -1
  finally:
    signal.signal(signal.SIGTERM, previous)
  if failed is not None:
    _stop(procs, grace)
  for thread in threads:
    thread.join(timeout=5)
  if failed == -1:
    print("launch: interrupted; stopped every process", file=sys.stderr)
    return 130
  if failed is not None:
    print(
        f"launch: process {failed} of {processes} failed with exit code"
        f" {procs[failed].returncode}; stopped the others",
        file=sys.stderr,
    )
    code = procs[failed].returncode
    return code if code and code > 0 else 1
  return 0


def _interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _stop(procs, grace: float) -> None:
  """SIGTERM every live process group, SIGKILL what is left after `grace`."""
  for proc in procs:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for proc in procs:
    try:
      proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  args = parse_args(argv)
  return launch(
      args.command,
      processes=args.processes,
      devices_per_process=args.devices_per_process,
      grace=args.grace,
      port=args.port,
  )


if __name__ == "__main__":
  sys.exit(main())
