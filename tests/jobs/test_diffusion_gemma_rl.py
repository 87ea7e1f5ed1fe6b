"""`tunix-blockdiff rl` on a DiffusionGemma sft run: 2 GRPO steps end to end.

Also killed after its step-1 checkpoint (`kill_resume`) and relaunched.
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
from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import diffusion_gemma_generate as dg_generate
from tunix_blockdiff.jobs import diffusion_gemma_rl
from tunix_blockdiff.jobs import rl_checkpoints

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
from hf_tokenizer import write_tiny_hf_tokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position

SMALL = dg_sizes.TWO_STEPS
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


def test_rl_takes_a_diffusion_gemma_sft_run_and_resumes_exactly(
    tmp_path, capsys
):
  sft = tmp_path / "sft"
  cli.main(["sft", "diffusion_gemma_tiny.yaml", *SMALL, f"output_dir={sft}"])
  assert diffusion_gemma_rl.is_policy(
      omegaconf.OmegaConf.create({"checkpoint": str(sft)}))
  assert not diffusion_gemma_rl.is_policy(
      omegaconf.OmegaConf.create({"checkpoint": None}))
  run = ["rl", f"init.checkpoint={sft}", *RL,
         "grpo.checkpoint_every_n_steps=1"]
  out = tmp_path / "rl"
  assert cli.main([*run, f"output_dir={out}"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy_family"] == "diffusion_gemma"
  assert summary["optimizer_steps"] == 2 and summary["rollouts"] == 8
  assert np.isfinite(summary["reward_start"])
  assert np.isfinite(summary["reward_end"])
  assert len(summary["train_step_rewards"]) == 2
  # num_iterations 1: the ratio is exactly 1 at every step.
  assert summary["is_ratio_mean"] == [1.0, 1.0]
  # The policy moved (the KL term's gradient is nonzero even when every
  # group's rewards are equal) and is a DiffusionGemma sft layout.
  step_before, before = _params(sft)
  step_after, after = _params(out / "policy")
  assert step_before == 2 and step_after == 2
  assert any(not np.allclose(a, b) for a, b in zip(before, after))
  # Killed after the step-1 checkpoint and relaunched: the uninterrupted
  # run's summary (rewards, ratios, held-out reward) and policy.
  killed = tmp_path / "killed"
  kill_resume.kill_after_checkpoint(run, killed, 1, tmp_path)
  assert rl_checkpoints.latest_step(killed) == 1
  assert not (killed / "summary.json").exists()
  capsys.readouterr()
  assert cli.main([*run, f"output_dir={killed}"]) == 0
  assert "resuming from the checkpoint of step 1" in capsys.readouterr().err
  kill_resume.assert_same_summary(kill_resume.summary(killed),
                                  kill_resume.summary(out))
  _, resumed = _params(killed / "policy")
  for got, want in zip(resumed, after, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  capsys.readouterr()
  cli.main(["generate", str(out / "policy"), "color=false",
            "prompts=[rev 123456]", "max_new_tokens=8"])
  assert "forward passes per token" in capsys.readouterr().out


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
      "distributed": {"num_processes": 2}, "reward": None, "grpo": {}})
  with pytest.raises(errors.UsageError, match="one process"):
    diffusion_gemma_rl._check(cfg)  # pylint: disable=protected-access
