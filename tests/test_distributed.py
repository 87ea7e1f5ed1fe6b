"""Many processes: 2 processes x 4 CPU devices (gloo) vs one 8-device process.

The multi-process runs go through `tunix-blockdiff launch`, each a tiny SFT
(one layer, 12 steps, a train-only dataset file: no evaluation to compile).
The fsdp=8 run on two processes is killed mid-run and relaunched once, and
serves the tests of equality, resumption and generation alike.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data as data_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import tasks
from tunix_blockdiff.jobs import launch

SMALL = [
    # LeCun-drawn down projections: with the recipe's zero start they are
    # ~6e-3 after 4 steps, and the per-array relative tolerance below would
    # be judging Adam-amplified all-reduce rounding (1e-7) against 6e-8.
    "model.mlp_out_scale=1.0",
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.hidden_dim=64",
    "model.head_dim=8",
    "data.seq_len=16",
    "data.batch_size=8",
    "training.max_steps=4",
    "training.warmup_steps=1",
    "training.eval_every_n_steps=100",
    "training.checkpoint_every_n_steps=2",
    "training.max_checkpoints=2",
]


def _env(devices: int) -> dict:
  return dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=launch.local_device_flags(devices),
  )


def _launch(args, processes=2, timeout=300) -> str:
  """`tunix-blockdiff launch` in a subprocess; its output (asserts rc 0)."""
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "tunix_blockdiff.cli",
          "launch",
          "--processes",
          str(processes),
          "--devices-per-process",
          "4",
          "--",
          *args,
      ],
      env=_env(4),
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _single(args) -> None:
  """One process with this test process's 8 CPU devices (conftest)."""
  assert jax.device_count() == 8
  assert cli.main(args) == 0


def _params(run_dir: pathlib.Path, step: int) -> dict:
  path = run_dir / "checkpoints" / str(step) / "model_params"
  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(path)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = checkpointer.restore(path, restore_args=args)
  return {
      jax.tree_util.keystr(k): v
      for k, v in jax.tree_util.tree_leaves_with_path(restored)
  }


def _assert_close(a, b, rtol=1e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.maximum(np.abs(b).max(initial=0.0), 1e-12)
  assert np.abs(a - b).max(initial=0.0) <= rtol * scale, (a, b)


def _assert_same_run(out, ref, resumed_at=0):
  """The runs' losses from `resumed_at` (out's first step) on and params."""
  got = json.loads((out / "summary.json").read_text())
  want = json.loads((ref / "summary.json").read_text())
  assert got["train_steps"] == want["train_steps"] == STEPS
  # A summary lists the losses of the steps its own launch ran.
  assert len(want["train_losses"]) == STEPS
  assert len(got["train_losses"]) == STEPS - resumed_at
  for x, y in zip(got["train_losses"], want["train_losses"][resumed_at:],
                  strict=True):
    _assert_close(x, y)
  params, ref_params = _params(out, STEPS), _params(ref, STEPS)
  assert params.keys() == ref_params.keys()
  for name in params:
    _assert_close(params[name], ref_params[name])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "train.jsonl"
  pairs = tasks.get_task("reverse", min_digits=3, max_digits=5).sample(64, 0)
  path.write_text(
      "".join(
          json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in pairs
      )
  )
  return path


# 12 steps (a progress line each, a checkpoint every 2): the two-process
# run is killed at step 3, mid-run, with 9 steps and 4 checkpoints to go.
STEPS = 12
LONG = [*SMALL, f"training.max_steps={STEPS}",
        "training.eval_every_n_steps=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_file):
  """The single-process, 8-device (fsdp=8) run."""
  out = tmp_path_factory.mktemp("ref")
  _single(["sft", f"output_dir={out}", f"dataset.train={data_file}",
           "mesh.fsdp=8", *LONG])
  return out


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, data_file):
  """The same run on 2 processes, killed after a checkpoint and relaunched.

  Returns (output_dir, the killed launcher's exit code and the checkpoint
  steps it left, the relaunch's output).
  """
  out = tmp_path_factory.mktemp("fsdp8")
  run = ["sft", f"dataset.train={data_file}", "mesh.fsdp=8", *LONG,
         f"output_dir={out}"]
  proc = subprocess.Popen(
      [sys.executable, "-m", "tunix_blockdiff.cli", "launch", "--processes",
       "2", "--devices-per-process", "4", "--grace", "0", "--", *run],
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  for line in proc.stdout:
    if line.startswith(f"[p0] step 3/{STEPS}"):
      proc.send_signal(signal.SIGTERM)  # the launcher kills both processes
      break
  rest = proc.stdout.read()
  killed = proc.wait(timeout=60), rest[-2000:]
  saved = sorted(
      int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()
  )
  return out, killed, saved, _launch(run)


def test_mesh_layout_and_rows():
  mesh = distributed.build_mesh({"fsdp": 2, "sp": 4})
  assert dict(mesh.shape) == {"fsdp": 2, "sp": 4, "tp": 1}
  # sp is the outer device axis: each fsdp shard spans devices 0..7.
  ids = np.vectorize(lambda d: d.id)(mesh.devices)[:, :, 0]
  np.testing.assert_array_equal(ids, [[0, 2, 4, 6], [1, 3, 5, 7]])
  assert distributed.process_rows(mesh, 8) == (0, 8)
  assert distributed.check_cp_size(mesh, 1) == 4
  with pytest.raises(ValueError, match="must equal mesh.sp"):
    distributed.check_cp_size(mesh, 2)
  with pytest.raises(ValueError, match="multiple of mesh.fsdp"):
    distributed.process_rows(mesh, 3)
  with pytest.raises(ValueError, match="unknown mesh axes"):
    distributed.build_mesh({"fsdp": 2, "dp": 2})
  with pytest.raises(ValueError, match="mesh.tp must be an int >= 1"):
    distributed.build_mesh({"tp": 0})
  with pytest.raises(ValueError, match="16 devices"):
    distributed.build_mesh({"fsdp": 16})
  batch = distributed.global_batch(
      {"tokens": np.arange(32).reshape(8, 4)}, mesh, 8
  )
  assert batch["tokens"].sharding.spec == jax.sharding.PartitionSpec(
      "fsdp", "sp"
  )
  np.testing.assert_array_equal(
      distributed.gather(batch["tokens"]), np.arange(32).reshape(8, 4)
  )


@pytest.mark.parametrize("packing", ["none", "block_aligned"])
@pytest.mark.parametrize("rows", [(0, 4), (4, 8), (2, 6)])
def test_process_rows_of_sft_batches_are_rows_of_the_full_batch(packing, rows):
  rng = np.random.default_rng(0)
  pairs = [
      (
          rng.integers(4, 20, rng.integers(1, 5)).tolist(),
          rng.integers(4, 20, rng.integers(1, 6)).tolist(),
      )
      for _ in range(40)
  ]
  examples = data_lib.as_examples(
      pairs, seq_len=16, vocab_size=20, mask_token_id=3
  )
  diffusion = config_lib.BlockDiffusionConfig(block_size=4, mask_token_id=3)
  config = data_lib.DataConfig(
      seq_len=16,
      batch_size=8,
      vocab_size=20,
      packing=packing,
      cp_size=2,
      num_epochs=1,
  )
  full = list(data_lib.SFTBatches(examples, diffusion, config))
  part = list(data_lib.SFTBatches(examples, diffusion, config, rows=rows))
  assert len(part) == len(full) > 1
  for a, b in zip(part, full):
    assert a.keys() == b.keys()
    for name in a:
      np.testing.assert_array_equal(a[name], b[name][rows[0] : rows[1]])
  with pytest.raises(ValueError, match="rows must be"):
    data_lib.SFTBatches(examples, diffusion, config, rows=(4, 9))


def test_initialize_validates_before_starting():
  assert distributed.initialize(None) is False
  with pytest.raises(ValueError, match="unknown distributed keys"):
    distributed.initialize({"coordinator": "x:1"})
  with pytest.raises(ValueError, match="process_id must be in"):
    distributed.initialize({"num_processes": 2, "process_id": 2})


def test_two_processes_fsdp8_equal_one_process(reference, two_process_run):
  out, _, saved, log = two_process_run
  _assert_same_run(out, reference, resumed_at=saved[-1])
  # Progress and the summary come from process 0 only.
  assert f"[p0] step {STEPS}/{STEPS}" in log and "[p1] step" not in log
  assert "[p0] wrote" in log and "[p1] wrote" not in log


def test_context_parallel_across_processes_equals_one_process(
    reference, tmp_path, data_file
):
  out = tmp_path / "sp"
  _launch([
      "sft",
      f"output_dir={out}",
      f"dataset.train={data_file}",
      "mesh.fsdp=2",
      "mesh.sp=4",
      *LONG,
  ])
  summary = json.loads((out / "summary.json").read_text())
  assert summary["recipe"]["mesh"] == {"fsdp": 2, "sp": 4}
  _assert_same_run(out, reference)


def test_killed_after_a_checkpoint_resumes_to_the_same_params(
    reference, two_process_run
):
  # The module's two-process run: SIGTERM to the launcher at step 3 (it
  # kills both processes), then the same command again.
  out, (code, rest), saved, log = two_process_run
  assert code == 130, rest
  assert saved and saved[-1] < STEPS, saved
  assert f"resuming from the checkpoint of step {saved[-1]}" in log, log
  summary = json.loads((out / "summary.json").read_text())
  assert summary["train_steps"] == STEPS
  params, ref_params = _params(out, STEPS), _params(reference, STEPS)
  for name in ref_params:
    _assert_close(params[name], ref_params[name])


def test_generate_two_processes_equals_one(two_process_run, tmp_path):
  out = two_process_run[0]
  prompts = "prompts=[rev 123,rev 4567,rev 89]"
  _single(["generate", str(out), prompts, "max_new_tokens=6", "color=false"])
  single = json.loads((out / "generate.json").read_text())
  (out / "generate.json").unlink()
  log = _launch([
      "generate",
      str(out),
      prompts,
      "max_new_tokens=6",
      "color=false",
      "mesh.fsdp=8",
  ])
  multi = json.loads((out / "generate.json").read_text())
  assert multi["tokens"] == single["tokens"]
  assert multi["commit_step"] == single["commit_step"]
  assert multi["completions"] == single["completions"]
  assert "[p1] tokens_per_step" not in log


def test_launcher_fails_fast_and_names_the_failed_process(capsys):
  script = (
      "import sys, time\n"
      "i = int(sys.argv[-1].split('=')[1])\n"
      "print('working', flush=True)\n"
      "time.sleep(1)\n"
      "sys.exit(3) if i == 1 else time.sleep(600)\n"
  )
  start = time.monotonic()
  code = launch.launch(
      ["sft"], processes=2, grace=2, program=[sys.executable, "-c", script]
  )
  assert code == 3
  assert time.monotonic() - start < 30
  captured = capsys.readouterr()
  assert "process 1 of 2 failed with exit code 3" in captured.err
  assert "[p0] working" in captured.out and "[p1] working" in captured.out


def test_a_dying_sft_process_fails_the_launch_and_stops_its_peer(
    tmp_path, data_file, capsys
):
  # Process 1 runs the real `sft` and dies (exit 5) 8 s in; process 0 would
  # wait for it in a collective or at initialisation.
  script = (
      "import os, sys, threading\n"
      "if sys.argv[-1] == 'distributed.process_id=1':\n"
      "  threading.Timer(8, lambda: os._exit(5)).start()\n"
      "from tunix_blockdiff import cli\n"
      "sys.exit(cli.main(sys.argv[1:]))\n"
  )
  start = time.monotonic()
  code = launch.launch(
      [
          "sft",
          f"output_dir={tmp_path}",
          f"dataset.train={data_file}",
          "mesh.fsdp=8",
          *SMALL,
          "training.max_steps=400",
      ],
      processes=2,
      devices_per_process=4,
      grace=2,
      program=[sys.executable, "-c", script],
  )
  assert code == 5
  assert time.monotonic() - start < 60
  assert "process 1 of 2 failed with exit code 5" in capsys.readouterr().err
  assert not (tmp_path / "summary.json").exists()


def test_launch_usage_errors():
  with pytest.raises(errors.UsageError, match="after -- name one of"):
    launch.parse_args(["--processes", "2", "--", "nope"])
  with pytest.raises(errors.UsageError, match="--processes must be >= 1"):
    launch.parse_args(["--processes", "0", "--", "sft"])
  with pytest.raises(errors.UsageError, match="sets the distributed"):
    launch.parse_args(
        ["--processes", "2", "--", "sft", "distributed.process_id=1"]
    )
  with pytest.raises(errors.UsageError, match="invalid int value: 'abc'"):
    launch.parse_args(["--processes", "abc", "--", "sft"])
  args = launch.parse_args(["--processes", "2", "--", "sft", "a=1"])
  assert args.command == ["sft", "a=1"] and args.devices_per_process is None
