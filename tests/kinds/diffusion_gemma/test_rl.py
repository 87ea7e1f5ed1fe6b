"""`tunix-blockdiff rl` on a DiffusionGemma sft run: 2 GRPO steps end to end.

Also killed while its step-2 checkpoint is written (`kill_resume`) and
relaunched, and run on 2 processes (`tunix-blockdiff launch`), which must
equal one.
"""

import json
import pathlib
import shutil
import sys

import dg_sizes
from flax import nnx
import jax
import kill_resume
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.kinds.diffusion_gemma import generate as dg_generate
from tunix_blockdiff.kinds.diffusion_gemma import rl as diffusion_gemma_rl
from tunix_blockdiff.jobs import launch
from tunix_blockdiff.runs import rl_checkpoints

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
sys.path.insert(0, str(DATA))
from hf_tokenizer import write_tiny_hf_tokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position

RL = [
    "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=2",
    "grpo.micro_batch_prompts=1", "grpo.num_iterations=1", "grpo.beta=0.04",
    "eval.num_prompts=2", "eval.samples_per_prompt=1", "eval.batch_size=4",
    "rollout.max_tokens_to_generate=8", "rollout.max_prompt_length=null",
]


def _params(run_dir):
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  model, _, step = dg_generate.load_run(run_dir, cfg)
  return step, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def _named_params(run_dir):
  cfg = _recipe(run_dir)
  model, _, _ = dg_generate.load_run(run_dir, cfg)
  return {path: np.asarray(v)
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _recipe(run_dir):
  return omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)


# A reward that differs between rollouts of a barely trained policy (exact
# match is 0 everywhere there, which gives GRPO little to compare).
REWARD = """
def distinct(prompts, completions, **kwargs):
  return [len(set(c)) / 8.0 for c in completions]
"""


@pytest.mark.xdist_group(dg_sizes.SFT_GROUP)
def test_rl_takes_a_diffusion_gemma_sft_run_resumes_and_runs_on_2_processes(
    dg_two_step_sft, tmp_path, monkeypatch, capsys
):
  (tmp_path / "dg_many_processes_reward.py").write_text(REWARD)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH",  # for launched processes
                     kill_resume.python_path_first(tmp_path))
  sft = dg_two_step_sft  # conftest's 2-step run (dg_sizes.TWO_STEPS)
  assert diffusion_gemma_rl.is_policy(
      omegaconf.OmegaConf.create({"checkpoint": str(sft)}))
  assert not diffusion_gemma_rl.is_policy(
      omegaconf.OmegaConf.create({"checkpoint": None}))
  # Rollouts, scores and the held-out reward shard their rows over
  # mesh.fsdp=4 (padded where they do not divide) and gather them.
  run = ["rl", f"init.checkpoint={sft}", *RL, "mesh.fsdp=4",
         "reward=dg_many_processes_reward:distinct",
         "grpo.checkpoint_every_n_steps=1"]
  assert jax.device_count() == 8
  out = tmp_path / "rl"
  assert cli.main([*run, f"output_dir={out}"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy_family"] == "diffusion_gemma"
  assert summary["optimizer_steps"] == 2 and summary["rollouts"] == 8
  assert np.isfinite(summary["reward_start"])
  assert np.isfinite(summary["reward_end"])
  assert np.isfinite(summary["reward_gain_se"])
  assert 0.0 <= summary["greedy_exact_match_start"] <= 1.0
  assert np.isfinite(summary["greedy_reward_gain_se"])
  assert len(summary["train_step_rewards"]) == 2
  # num_iterations 1: the ratio is exactly 1 at every step.
  assert summary["is_ratio_mean"] == [1.0, 1.0]
  # The policy moved (the KL term's gradient is nonzero even when every
  # group's rewards are equal) and is a DiffusionGemma sft layout.
  step_before, before = _params(sft)
  step_after, after = _params(out / "policy")
  assert step_before == 2 and step_after == 2
  assert any(not np.allclose(a, b) for a, b in zip(before, after))
  # Killed during the step-2 checkpoint and relaunched: the uninterrupted
  # run's summary (rewards, ratios, held-out reward) and policy.
  killed = tmp_path / "killed"
  # Killed while Orbax wrote the step-2 checkpoint (not committed yet).
  kill_resume.kill_at("actor:2", run, killed, tmp_path)
  assert rl_checkpoints.latest_step(killed) == 1
  assert rl_checkpoints.partial_writes(killed / "checkpoints" / "actor")
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  assert "resuming from the checkpoint of step 1" in capsys.readouterr().err
  kill_resume.assert_same_summary(kill_resume.summary(killed),
                                  kill_resume.summary(out))
  _, resumed = _params(killed / "policy")
  for got, want in zip(resumed, after, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Relaunching the finished run changes nothing; killed right after its
  # last checkpoint and policy save (no summary yet), the relaunch resumes
  # at step 2 and rewrites the same policy and summary.
  kill_resume.assert_relaunch_changes_nothing(run, killed, capsys)
  (killed / "summary.json").unlink()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
  kill_resume.assert_same_summary(kill_resume.summary(killed),
                                  kill_resume.summary(out))
  _, rewritten = _params(killed / "policy")
  for got, want in zip(rewritten, after, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  capsys.readouterr()
  cli.main(["generate", str(out / "policy"), "color=false",
            "prompts=[rev 123456]", "max_new_tokens=8"])
  assert "forward passes per token" in capsys.readouterr().out
  _check_two_processes_equal_one(run, out, tmp_path / "two", capsys)


def _check_two_processes_equal_one(run, one, two, capsys):
  """2 processes x 2 devices (gloo) give one process's summary and policy.

  The same mesh.fsdp=4 over the two processes' devices; the training
  examples are global arrays.
  """
  capsys.readouterr()
  code = launch.launch([*run, f"output_dir={two}"], processes=2,
                       devices_per_process=2)
  log = capsys.readouterr().out
  assert code == 0, log[-3000:]
  summary = kill_resume.summary(one)
  kill_resume.assert_same_summary(kill_resume.summary(two), summary)
  assert len(set(summary["train_step_rewards"]
                 + [summary["reward_start"]])) > 1
  want = _named_params(one / "policy")
  got = _named_params(two / "policy")
  assert got.keys() == want.keys()
  lr = float(_recipe(one).grpo.learning_rate)
  for name, value in want.items():
    if name[-1] in ("encoder_scalar", "decoder_scalar"):
      # These layer scalars' gradients are at float-rounding level on a
      # 2-step model, and Adam's normalisation turns rounding into steps of
      # up to lr (one device and a one-process mesh differ the same way).
      np.testing.assert_allclose(got[name], value, atol=2 * 2 * lr)
    else:
      np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5,
                                 err_msg=str(name))
  # Outputs from process 0 only.
  assert "[p0] wrote" in log and "[p1] wrote" not in log


def test_rl_takes_an_hf_diffusion_gemma_directory(tmp_path, capsys):
  hf = tmp_path / "hf"
  shutil.copytree(DATA / "diffusion_gemma" / "moe_sliding", hf)
  write_tiny_hf_tokenizer(hf)
  rows = tmp_path / "prompts.jsonl"
  rows.write_text("".join(
      json.dumps({"prompt": f"say {i}", "answer": f"{i}"}) + "\n"
      for i in range(12)))
  run = ["rl", f"init.checkpoint={hf}", *RL]
  out = tmp_path / "rl"
  # Without prompt rows: one line, exit 2, before any compute.
  assert cli.main([*run, f"output_dir={out}"]) == 2
  assert "needs dataset" in capsys.readouterr().err
  assert cli.main([*run, f"output_dir={out}", f"dataset.train={rows}"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy_family"] == "diffusion_gemma"
  assert summary["sft"] == {"checkpoint": str(hf), "checkpoint_step": None}
  assert summary["optimizer_steps"] == 2
  assert summary["prompts_source"].endswith("prompts.jsonl")
  # The directory's generation_config.json sets the sampler.
  assert summary["sampler"]["max_denoising_steps"] == 6
  policy = omegaconf.OmegaConf.load(out / "policy" / common.RECIPE_FILE)
  assert policy.model.kind == "diffusion_gemma_hf"
  assert policy.tokenizer.kind == "hf"
  step, after = _params(out / "policy")
  assert step == 2
  base, _ = diffusion_gemma_rl.load_policy(
      omegaconf.OmegaConf.create({"checkpoint": str(hf)}))[:2]
  before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(base))]
  assert any(not np.allclose(a, b) for a, b in zip(before, after))
  capsys.readouterr()
  assert cli.main(["generate", str(out), "color=false", "prompts=[say 3]",
                   "max_new_tokens=4"]) == 0
  assert "forward passes per token" in capsys.readouterr().out


def test_unsupported_keys_are_one_line_usage_errors(tmp_path):
  cfg = omegaconf.OmegaConf.create({
      "distributed": {"num_processes": 2}, "reward": "no_such_module:fn",
      "grpo": {}})
  with pytest.raises(errors.UsageError, match="no_such_module"):
    diffusion_gemma_rl._check(cfg)  # pylint: disable=protected-access
