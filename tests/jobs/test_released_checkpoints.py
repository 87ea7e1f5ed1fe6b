"""The whole chain on a released checkpoint's directory, with no code.

`generate DIR`, `sft sdar_1p7b.yaml model.path=DIR`, `export`, `generate OUT`
and `rl` on tests/data/released/sdar (SDAR's own format, written by its
PyTorch code: `tools/released_goldens.py`) plus a tiny HF tokenizer.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.jobs import sft
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import exported

_TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS / "data"))
import hf_tokenizer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

CHAT = _TESTS / "data" / "chat_tiny.jsonl"
# One worker runs them all, so the module's SFT run is made once.
pytestmark = pytest.mark.xdist_group("released_sdar")
MASK = 63  # the tiny checkpoint's config.json mask_token_id


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
  """The SDAR golden checkpoint with a tokenizer and its remote code file."""
  directory = tmp_path_factory.mktemp("sdar") / "SDAR-tiny"
  shutil.copytree(_TESTS / "data" / "released" / "sdar", directory)
  (directory / "reference.npz").unlink()
  assert hf_tokenizer.write_tiny_hf_tokenizer(directory) < 64
  # What a downloaded SDAR directory carries for trust_remote_code loaders.
  (directory / "modeling_sdar.py").write_text("# SDAR's modeling code\n")
  return directory


def _sft_cfg(sdar_dir, out, *extra):
  return common.load_recipe([
      "sdar_1p7b.yaml", f"model.path={sdar_dir}", f"output_dir={out}",
      f"dataset.train={CHAT}", f"dataset.eval={CHAT}", "dataset.num_eval=4",
      "model.dtype=float32", "model.param_dtype=float32",
      "data.batch_size=4", "data.seq_len=48", "training.max_steps=2",
      "training.warmup_steps=1", "training.eval_every_n_steps=2",
      "training.checkpoint_every_n_steps=2", "eval.batch_size=4",
      "eval.thresholds=[0.85]", "lora.rank=4", "lora.alpha=8.0", *extra,
  ])


def test_generate_reads_the_directory_and_its_decoding_defaults(sdar_dir):
  assert cli.main(["generate", str(sdar_dir), "prompts=[what is 1+1?]",
                   "max_new_tokens=8", "color=false"]) == 0
  out = json.loads((sdar_dir / "generate.json").read_text())
  assert np.asarray(out["tokens"]).shape[0] == 1
  assert out["checkpoint_step"] == 0
  steps = np.asarray(out["commit_step"])
  assert (steps >= 0).sum() == out["committed_tokens"] > 0


def test_a_recipe_that_disagrees_with_the_checkpoint_is_refused(
    sdar_dir, tmp_path):
  # sdar_1p7b.yaml's mask id is the real SDAR's; this checkpoint's is 63.
  with pytest.raises(errors.UsageError,
                     match="diffusion.mask_token_id=151669 differs.*63"):
    sft.run(_sft_cfg(sdar_dir, tmp_path / "run"))


@pytest.fixture(scope="module")
def sdar_run(sdar_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("sdar_run") / "run"
  summary = sft.run(_sft_cfg(sdar_dir, out, f"diffusion.mask_token_id={MASK}"))
  assert summary["train_steps"] == 2 and summary["num_lora_params"] > 0
  assert np.isfinite(summary["final_train_loss"])
  return out


def test_sft_then_export_writes_sdar_back(sdar_run, sdar_dir, tmp_path):
  out = tmp_path / "hf"
  assert cli.main(["export", str(sdar_run), str(out),
                   "--tokenizer-files"]) == 0
  config = json.loads((out / "config.json").read_text())
  base = json.loads((sdar_dir / "config.json").read_text())
  assert config["model_type"] == "sdar"
  assert config["architectures"] == ["SDARForCausalLM"]
  assert config["block_size"] == 4 and config["mask_token_id"] == MASK
  # SDAR's own keys survive; the remote code travels with the weights.
  assert config["fuse_cross_entropy"] == base["fuse_cross_entropy"]
  assert (out / "modeling_sdar.py").is_file()
  assert cli.main(["generate", str(out), "prompts=[what is 1+1?]",
                   "max_new_tokens=8", "color=false"]) == 0
  assert (out / "generate.json").is_file()


def _prompt_file(tmp_path, pairs) -> pathlib.Path:
  """An rl/opd prompt file of `what is a+b?` rows with their answers."""
  train = tmp_path / "prompts.jsonl"
  train.write_text("".join(
      json.dumps({"prompt": f"what is {a}+{b}?", "answer": f"{a}+{b}={a + b}."})
      + "\n" for a, b in pairs))
  return train


def test_grpo_trains_the_sdar_policy_with_the_exact_likelihood(
    sdar_run, tmp_path):
  from tunix_blockdiff.jobs import rl  # pylint: disable=g-import-not-at-top

  train = _prompt_file(tmp_path, ((1, 2), (3, 4), (2, 2), (5, 1)))
  assert rl.main([
      f"output_dir={tmp_path / 'rl'}", f"init.checkpoint={sdar_run}",
      f"dataset.train={train}", "grpo.steps=2", "grpo.prompts_per_step=2",
      "grpo.num_generations=2", "grpo.micro_batch_prompts=1",
      "grpo.likelihood=exact", "eval.num_prompts=2",
      "eval.samples_per_prompt=1", "eval.batch_size=4",
      "rollout.max_tokens_to_generate=8", "rollout.max_prompt_length=16",
  ]) == 0
  summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
  assert summary["steps"] == 2 and summary["optimizer_steps"] == 2
  assert summary["rollouts"] == 8
  assert len(summary["train_step_rewards"]) == 2


def test_generate_reads_a_fast_dllm_v2_directory(tmp_path):
  directory = tmp_path / "Fast_dLLM_tiny"
  shutil.copytree(_TESTS / "data" / "released" / "fast_dllm_v2", directory)
  hf_tokenizer.write_tiny_hf_tokenizer(directory)
  # Its default sub-blocks of 8 do not fit this checkpoint's blocks of 4.
  assert exported.read_section(directory)["decoding"]["sub_block_size"] is None
  for options in ([], ["sub_block_size=2"]):
    assert cli.main(["generate", str(directory), "prompts=[what is 1+1?]",
                     "max_new_tokens=8", "color=false", *options]) == 0
    out = json.loads((directory / "generate.json").read_text())
    assert out["committed_tokens"] > 0
  # A sub-block that does not divide the block: one line, exit status 2.
  assert cli.main(["generate", str(directory), "prompts=[hi]",
                   "max_new_tokens=8", "sub_block_size=3"]) == 2


def test_opd_distils_an_ar_teacher_into_the_sdar_student(sdar_run, tmp_path):
  from tunix_blockdiff.jobs import opd  # pylint: disable=g-import-not-at-top

  train = _prompt_file(
      tmp_path, [(a, b) for a in range(1, 7) for b in range(1, 5)])
  assert opd.main([
      f"output_dir={tmp_path / 'opd'}", f"student.checkpoint={sdar_run}",
      f"dataset.train={train}", "teacher.num_layers=1", "teacher.embed_dim=16",
      "teacher.hidden_dim=32", "teacher.num_heads=2", "teacher.head_dim=8",
      "teacher.num_kv_heads=1", "teacher.steps=3", "teacher.warmup_steps=1",
      "teacher.batch_size=8", "teacher.num_train=8", "opd.steps=2",
      "opd.prompts_per_step=2", "opd.micro_batch_prompts=1",
      "eval.num_prompts=2", "eval.batch_size=4",
      "rollout.max_tokens_to_generate=8", "rollout.max_prompt_length=16",
  ]) == 0
  summary = json.loads((tmp_path / "opd" / "summary.json").read_text())
  assert summary["steps"] == 2 and summary["optimizer_steps"] == 2
  # The loss saw the teacher: a positive divergence at both steps.
  assert len(summary["train_divergence"]) == 2
  assert all(np.isfinite(d) and d > 0 for d in summary["train_divergence"])
  for key in ("divergence_start", "divergence_end"):
    assert np.isfinite(summary[key]) and summary[key] >= 0


def test_sft_and_export_on_a_fast_dllm_v2_directory(tmp_path):
  directory = tmp_path / "Fast_dLLM_tiny"
  shutil.copytree(_TESTS / "data" / "released" / "fast_dllm_v2", directory)
  (directory / "reference.npz").unlink()
  hf_tokenizer.write_tiny_hf_tokenizer(directory)
  run = tmp_path / "run"
  summary = sft.run(common.load_recipe([
      "fast_dllm_v2_7b.yaml", f"model.path={directory}", f"output_dir={run}",
      f"dataset.train={CHAT}", f"dataset.eval={CHAT}", "dataset.num_eval=4",
      "mesh=null", "model.dtype=float32", "model.param_dtype=float32",
      "data.batch_size=4", "data.seq_len=48", "training.max_steps=2",
      "training.warmup_steps=1", "training.eval_every_n_steps=2",
      "training.checkpoint_every_n_steps=2", "eval.batch_size=4",
      "eval.thresholds=[0.9]", "lora.rank=4", "lora.alpha=8.0",
      # The tiny checkpoint's own (the 7B's are 32 and 151665).
      "diffusion.block_size=4", f"diffusion.mask_token_id={MASK}",
  ]))
  assert summary["train_steps"] == 2 and summary["num_lora_params"] > 0
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out), "--tokenizer-files"]) == 0
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "Fast_dLLM_Qwen"
  assert config["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
  assert config["bd_size"] == 4 and config["mask_token_id"] == MASK
  assert cli.main(["generate", str(out), "prompts=[what is 1+1?]",
                   "max_new_tokens=8", "color=false"]) == 0
