"""Shared test setup (set before JAX is imported).

- 8 simulated CPU devices, compiled at a cheaper CPU optimisation level.
- A persistent JAX compilation cache shared by the xdist workers, by the
  processes they launch (jobs under `launch`, killed and resumed runs,
  notebook kernels) and by later runs on the same machine: on CPU most of a
  tiny end-to-end test is XLA compilation, and many tests compile the same
  programs (the same tiny recipes, a killed run and its resumption, the
  single-process references of the multi-process tests), as does every
  rerun. `TUNIX_BLOCKDIFF_TEST_CACHE` picks it: unset, a lasting directory
  under `~/.cache` (entries unused for 14 days are pruned); `per-run`, a
  fresh one per test run (what a new machine sees); any other value, that
  directory. An explicit `JAX_COMPILATION_CACHE_DIR` wins over all three.
  JAX keys each entry by the program, the jaxlib version and the XLA flags,
  so an entry is never reused for another program or setting. (An earlier
  note here blamed the cache for a two-process gloo hang; the cause was
  OPD's eager, op-by-op divergence over the mesh, fixed in `rl/opd.py`.)
"""

import gc
import os
import shutil
import tempfile
import time

# Cheaper CPU compilation: the tests' programs are tiny, so most of their
# time is XLA compiling them. Backend optimisation level 0 with XLA's older
# (non-MLIR) fusion emitters compiles a DiffusionGemma sft job's programs in
# 6 s instead of 15 s, and a fresh suite ran in 20 minutes instead of 37 on
# the same machine (docs/changelog.md). Either flag alone helps little or
# hurts: level 0 alone took 12 s there, the old emitters at level 1 30 s.
# The float rounding differs from level 1's; the exactness tests
# compare programs within one setting, and the one tie that rounding alone
# decides (an empty prompt's all-mask block) is exempted where it is named.
# One LLVM module per program, not split for parallel code generation: XLA
# splits a large one into up to 32 parts (a DiffusionGemma train step's
# objects were part_00 .. part_31) and the splitting costs more CPU than
# the parallel parts save on 2 cores busy with 2 workers. Compiling that
# step took 2.1-2.6 s of CPU instead of 3.0 s, a 2-layer Qwen3 step 183-209
# ms instead of 275-295 ms, and 4 compile-heavy test modules under
# `pytest -n 2` 182-196 s of CPU instead of 197-206 s (docs/changelog.md).
# Launched processes (jobs under `launch`, notebook kernels) inherit them.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
CACHE_PREFIX = "tunix_blockdiff_test_jax_cache_"
CACHE_ENV = "TUNIX_BLOCKDIFF_TEST_CACHE"
LASTING_CACHE_DAYS = 14


def _prune(directory: str, max_age_seconds: float, prefix: str = "") -> None:
  """Removes entries of `directory` (named `prefix...`) unused for the age."""
  cutoff = time.time() - max_age_seconds
  for entry in os.scandir(directory):
    try:
      stat = entry.stat()
      if entry.name.startswith(prefix) and max(stat.st_mtime,
                                               stat.st_atime) < cutoff:
        if entry.is_dir():
          shutil.rmtree(entry.path, ignore_errors=True)
        else:
          os.remove(entry.path)
    except OSError:
      pass


def _compilation_cache_dir() -> str:
  """The test run's JAX compilation cache directory (see module docstring)."""
  choice = os.environ.get(CACHE_ENV, "")
  if choice == "per-run":
    # One directory per test run (xdist's run id); ones unused for 6 h go.
    root = tempfile.gettempdir()
    _prune(root, 6 * 3600, prefix=CACHE_PREFIX)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return os.path.join(root, CACHE_PREFIX + run)
  if choice:
    return os.path.abspath(os.path.expanduser(choice))
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(
      "~/.cache")
  directory = os.path.join(cache_home, "tunix_blockdiff", "test_jax_cache")
  os.makedirs(directory, exist_ok=True)
  if "PYTEST_XDIST_WORKER" not in os.environ:  # once per run, not per worker
    _prune(directory, LASTING_CACHE_DAYS * 86400)
  return directory


import jax  # noqa: E402

# Through the environment, so the processes the tests launch use it too.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache_dir()
# A per-run cache keeps programs that took >= 0.2 s to compile (the small
# ones seldom repeat within a run); a lasting one keeps every program, since
# a rerun repeats them all (reading one back takes ~20 ms, compiling a small
# one 15-90 ms).
os.environ.setdefault(
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "0.2" if os.environ.get(CACHE_ENV) == "per-run" else "0",
)
jax.config.update("jax_compilation_cache_dir",
                  os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import pathlib  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# Python's cyclic garbage collector. A worker's heap is large (JAX, Tunix,
# transformers, every traced program's caches), and each full collection
# walks all of it: a whole `pytest -n 2` spent 165 s of its workers' CPU in
# collections (timed with `gc.callbacks`), many of them Tunix's own
# explicit `gc.collect()` calls (rl_cluster). So collections are rarer (one
# per 50,000 net allocations, not 700), and what is alive once the tests
# are collected (the imported libraries) is frozen out of every
# collection: 88 s instead of 165, with the workers' peak memory unchanged
# (6.3 GB). Of the 78 s left, 63 s were 70 explicit full collections (0.9 s
# each), so libraries' `gc.collect()` collects the young generations only
# in the test processes: 24 s, the workers' peak memory 6.25-6.52 GB in
# two whole runs. Reference counting frees all acyclic garbage as before;
# cycles wait longer. The setting lives in
# `child_site/sitecustomize.py`, run here for the workers and, from
# PYTHONPATH, at the start of every process the tests launch (tests that
# add a directory for their children prepend it:
# `kill_resume.python_path_first`).
CHILD_SITE = str(pathlib.Path(__file__).resolve().parent / "child_site")
_SITE = runpy.run_path(os.path.join(CHILD_SITE, "sitecustomize.py"))
if CHILD_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (CHILD_SITE, os.environ.get("PYTHONPATH")) if p)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
  del session
  _SITE["full_collect"]()
  gc.freeze()


# Helper modules beside this file (`kill_resume`, ...) import by name.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# The student/policy of the rl and opd job tests: a one-layer Qwen3.
TINY_POLICY_MODEL = {
    "num_layers": 1,
    "embed_dim": 16,
    "hidden_dim": 32,
    "num_heads": 2,
    "head_dim": 8,
    "num_kv_heads": 1,
}


@pytest.fixture(scope="session")
def untrained_policy(tmp_path_factory) -> pathlib.Path:
  """An SFT output_dir (recipe.yaml + checkpoints/) of an untrained policy.

  What `rl init.checkpoint=` and `opd student.checkpoint=` accept: the tiny
  recipe on 2-3 digit reversal (seq_len 14, block 4) with
  `TINY_POLICY_MODEL`, its initial weights saved as step 1. Built once per
  test process and shared; tests must not write into it.
  """
  from tunix.sft import checkpoint_manager  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff.runs import common  # pylint: disable=g-import-not-at-top

  directory = tmp_path_factory.mktemp("untrained_policy")
  cfg = common.load_recipe([
      "tiny.yaml",
      "task.kwargs.min_digits=2",
      "task.kwargs.max_digits=3",
      "task.num_eval=8",
      "data.seq_len=14",
      "diffusion.block_size=4",
      *[f"model.{k}={v}" for k, v in TINY_POLICY_MODEL.items()],
      f"output_dir={directory}",
  ])
  out = common.prepare_output_dir(cfg)
  model = common.build_model(cfg.model, seed=int(cfg.seed))
  manager = checkpoint_manager.CheckpointManager(str(out / "checkpoints"))
  manager.save(1, model, force=True)
  manager.close()
  return out


@pytest.fixture(scope="session")
def dg_two_step_sft(tmp_path_factory) -> pathlib.Path:
  """A 2-step DiffusionGemma sft output_dir (`dg_sizes.TWO_STEPS`).

  The policy of the DiffusionGemma rl job test and the student of its opd
  job test. Built once per test process and shared; tests must not write
  into it. Its users carry `pytest.mark.xdist_group(dg_sizes.SFT_GROUP)`:
  xdist runs with `--dist loadgroup` (pyproject), so they share a worker
  and the run is made once per suite.
  """
  import dg_sizes  # pylint: disable=g-import-not-at-top

  from tunix_blockdiff import cli  # pylint: disable=g-import-not-at-top

  out = tmp_path_factory.mktemp("dg_two_step_sft")
  assert cli.main(["sft", "diffusion_gemma_tiny.yaml", *dg_sizes.TWO_STEPS,
                   f"output_dir={out}"]) == 0
  return out


# The suite's longest tests (multi-process, kill-and-resume and whole-job
# runs: 30-135 s each on 2 cores), scheduled first so that xdist's two
# workers do not end with one of them alone on a long test. Modules keep
# their own order (stable sort), so module fixtures are built once as before.
_LONG_FIRST = (
    "tests/kinds/diffusion_gemma/test_rl.py",
    "tests/test_distributed.py",
    "tests/jobs/test_rl_resume.py",
    "tests/jobs/test_opd_resume.py",
    "tests/jobs/test_rl_opd_many_processes.py",
    "tests/kinds/diffusion_gemma/test_sft.py",
    "tests/benchmarks/test_convert_code.py",
    "tests/benchmarks/test_default_recipe.py",
    "tests/kinds/diffusion_gemma/test_opd.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  del config

  def module(item) -> str:
    return item.nodeid.split("::", 1)[0]

  def rank(item) -> int:
    return next((i for i, p in enumerate(_LONG_FIRST) if module(item) == p),
                len(_LONG_FIRST))

  items.sort(key=rank)
  # A module's tests share one worker (xdist's loadgroup), so its fixtures
  # and the programs its tests trace, lower and compile are built once, not
  # once in each worker. Explicit groups (session fixtures shared across
  # modules) keep their own names.
  for item in items:
    if not any(item.iter_markers("xdist_group")):
      item.add_marker(pytest.mark.xdist_group(module(item)))
