"""Shared test setup: 8 simulated CPU devices (set before JAX is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import pathlib  # noqa: E402

import pytest  # noqa: E402

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

  from tunix_blockdiff.jobs import common  # pylint: disable=g-import-not-at-top

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
