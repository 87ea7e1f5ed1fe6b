"""The `tunix-blockdiff generate` job on a run directory written here."""

import json

import numpy as np
import pytest
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import cli
from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import generate as generate_job
from tunix_blockdiff.rollout import cached

TINY = [
    "task.num_train=8",
    "task.num_eval=4",
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.hidden_dim=64",
    "model.head_dim=8",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run directory as `sft` leaves it: recipe.yaml and a checkpoint."""
  out = tmp_path_factory.mktemp("run")
  cfg = common.load_recipe([f"output_dir={out}", *TINY])
  common.prepare_output_dir(cfg)
  model = common.build_model(cfg.model, seed=3)
  manager = checkpoint_lib.CheckpointManager(str(out / "checkpoints"))
  assert manager.save(7, model, force=True)
  manager.close()
  return out, cfg, model


def test_generate_restores_the_checkpoint_and_matches_generate(run_dir, capsys):
  out, cfg, model = run_dir
  assert cli.main(["generate", str(out), "color=false", "steps_per_block=4"]) == 0
  printed = capsys.readouterr().out
  result = json.loads((out / "generate.json").read_text())
  assert result["checkpoint_step"] == 7
  assert len(result["prompts"]) == 4 and len(result["completions"]) == 4
  assert "|" in printed and "\x1b[" not in printed
  assert (out / "trajectory.png").read_bytes()[:4] == b"\x89PNG"
  # The restored weights are the saved ones: the same tokens as generating
  # with the in-memory model (a model with other weights would differ).
  tokenizer = common.build_tokenizer(cfg.tokenizer)
  encoded = [common.encode_pair(tokenizer, p, "")[0] for p in result["prompts"]]
  lengths = np.array([len(e) for e in encoded], np.int32)
  prompts = np.zeros((4, lengths.max()), np.int32)
  for b, ids in enumerate(encoded):
    prompts[b, prompts.shape[1] - len(ids):] = ids
  diffusion = common.diffusion_config_from(cfg.diffusion)
  expected = cached.generate(
      model,
      prompts,
      lengths,
      generate_job.config_lib.DenoiseConfig(
          block_size=diffusion.block_size,
          mask_token_id=diffusion.mask_token_id,
          steps_per_block=4,
          eos_token_id=tokenizer.eos_id(),
          pad_token_id=tokenizer.pad_id(),
      ),
      max_new_tokens=len(result["tokens"][0]),
  )
  np.testing.assert_array_equal(result["tokens"], np.asarray(expected.tokens))
  np.testing.assert_array_equal(
      result["commit_step"], np.asarray(expected.commit_step)
  )
  # A static schedule of 4 steps per block of 8 commits 2 per call.
  assert result["tokens_per_step"] > 1.0


def test_generate_custom_prompts(run_dir):
  out, _, _ = run_dir
  results = []
  for phases, lockstep, kernels, one in ((1, "false", "false", "false"),
                                        (3, "false", "false", "false"),
                                        (3, "false", "false", "true"),
                                        (1, "true", "true", "false")):
    assert cli.main([
        "generate", str(out), 'prompts=["rev 123>", "rev 9>"]',
        "max_new_tokens=5", "color=false", f"png={out / 'custom.png'}",
        f"cache_phases={phases}", f"lockstep={lockstep}",
        f"ragged_cache={kernels}", f"fused_head={kernels}",
        f"one_program={one}",
    ]) == 0
    results.append(json.loads((out / "generate.json").read_text()))
  result = results[0]
  assert result["prompts"] == ["rev 123>", "rev 9>"]
  assert result["exact_match"] is None
  assert len(result["tokens"][0]) == 5
  assert (out / "custom.png").is_file()
  # The loop in phases (staged or in one program), and in lockstep with the
  # cache and head kernels: the same trajectory.
  for other in results[1:]:
    assert other["tokens"] == result["tokens"]
    assert other["commit_step"] == result["commit_step"]


def test_generate_custom_prompts_default_to_the_runs_eval_budget(
    run_dir, capsys
):
  out, _, _ = run_dir
  # The budget of the run's own held-out prompts (the SFT eval's).
  assert cli.main(["generate", str(out), "color=false"]) == 0
  budget = len(json.loads((out / "generate.json").read_text())["tokens"][0])
  capsys.readouterr()
  assert cli.main([
      "generate", str(out), 'prompts=["rev 123>", "rev 9>"]', "color=false",
  ]) == 0
  err = capsys.readouterr().err
  result = json.loads((out / "generate.json").read_text())
  assert len(result["tokens"][0]) == budget > 5
  assert f"max_new_tokens={budget}: the run's own eval budget" in err


def test_generate_errors(run_dir, tmp_path, capsys):
  out, _, _ = run_dir
  # Usage errors: one line on stderr, exit status 2, no traceback.
  for argv, message in [
      (["generate"], "usage"),
      (["generate", str(tmp_path)], "recipe.yaml not found"),
      (["generate", str(out), "thresold=0.5"], "did you mean 'threshold'"),
      (["generate", str(out), "cache_phases=0"], "cache_phases=0 is not valid: cache_phases must be an int >= 1"),
      (["generate", str(out), "lockstep=2"],
       "lockstep must be true or false"),
      (["generate", str(out), "ragged_cache=3"],
       "ragged_cache must be true or false"),
      (["generate", str(out), "fused_head=1"],
       "fused_head must be true or false"),
      (["generate", str(out), "one_program=2"],
       "one_program must be true or false"),
  ]:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tunix-blockdiff generate: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
