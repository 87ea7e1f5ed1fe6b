"""The DiffusionGemma sft and generate jobs, end to end on tiny models."""

import json
import pathlib
import shutil
import signal
import subprocess
import sys

import dg_sizes
import kill_resume
from flax import nnx
import jax
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.kinds.diffusion_gemma import sft as dg_job
from tunix_blockdiff.kinds.diffusion_gemma import generate as dg_generate

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
GOLDEN = DATA / "diffusion_gemma/moe_sliding"
sys.path.insert(0, str(DATA))
from hf_tokenizer import write_tiny_hf_tokenizer  # pylint: disable=g-import-not-at-top,wrong-import-position

SMALL = dg_sizes.SMALL


def _params(run_dir):
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  model, _, step = dg_generate.load_run(run_dir, cfg)
  return step, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_sft_generate_and_killed_resume_to_the_same_parameters(tmp_path,
                                                                capsys):
  run = ["sft", "diffusion_gemma_tiny.yaml", *SMALL, "training.max_steps=12",
         "training.checkpoint_every_n_steps=2", "training.eval_every_n_steps=2"]
  ref, out = tmp_path / "ref", tmp_path / "resumed"
  cli.main([*run, f"output_dir={ref}"])
  summary = json.loads((ref / "summary.json").read_text())
  assert summary["model_kind"] == "tiny_diffusion_gemma"
  assert summary["train_steps"] == 12 and summary["eval_examples"] == 8
  assert 0 < summary["tokens_per_forward"] <= 8
  assert summary["forward_passes_per_token"] == pytest.approx(
      1 / summary["tokens_per_forward"])
  assert (ref / "sft.png").is_file()
  capsys.readouterr()
  cli.main(["generate", str(ref), "color=false", "prompts=[rev 123456]",
            "max_new_tokens=8", "entropy_bound=0.5"])
  printed = capsys.readouterr().out
  assert "forward passes per token" in printed and "rev 123456" in printed
  output = json.loads((ref / "generate.json").read_text())
  assert output["checkpoint_step"] == 12
  assert output["sampler"]["entropy_bound"] == 0.5
  assert len(output["tokens"][0]) == 8 and output["forward_passes"][0] >= 1

  # The same run killed (SIGKILL) after a checkpoint, then relaunched.
  proc = subprocess.Popen(
      [sys.executable, "-m", "tunix_blockdiff.cli", *run, f"output_dir={out}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in proc.stdout:
    if line.startswith("step 7/12"):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=120)
  assert proc.returncode == -signal.SIGKILL
  killed_step, _ = _params(out)
  assert 2 <= killed_step < 12
  cli.main([*run, f"output_dir={out}"])
  ref_step, ref_params = _params(ref)
  step, params = _params(out)
  assert ref_step == step == 12
  assert max(float(np.abs(a - b).max()) for a, b in zip(ref_params, params)) < 1e-6
  resumed = json.loads((out / "summary.json").read_text())
  assert resumed["train_losses"] == pytest.approx(
      summary["train_losses"][-len(resumed["train_losses"]):], rel=1e-5)
  # Relaunching the finished run changes nothing; killed right after its
  # last checkpoint (no summary yet), it trains nothing and evaluates the
  # same model.
  kill_resume.assert_relaunch_changes_nothing(run, out, capsys)
  (out / "summary.json").unlink()
  assert cli.main([*run, f"output_dir={out}"]) == 0
  again = json.loads((out / "summary.json").read_text())
  assert again["train_steps"] == 12 and again["train_losses"] == []
  for key in ("eval_loss", "eval_exact_match", "tokens_per_forward"):
    assert again[key] == pytest.approx(resumed[key], rel=1e-6), key
  assert _params(out)[0] == 12


def _hf_checkpoint(tmp_path):
  target = tmp_path / "hf"
  shutil.copytree(GOLDEN, target)
  write_tiny_hf_tokenizer(target)  # 53 ids < the checkpoint's 64
  return target


def test_lora_sft_on_an_hf_checkpoint_and_generate_from_both(
    tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  hf = _hf_checkpoint(tmp_path)
  rows = tmp_path / "train.jsonl"
  rows.write_text("".join(
      json.dumps({"prompt": f"say {i}", "completion": f"{i} {i}"}) + "\n"
      for i in range(40)))
  out = tmp_path / "lora"
  cli.main([
      "sft", "diffusion_gemma_tiny.yaml", f"output_dir={out}",
      "model.kind=diffusion_gemma_hf", f"model.path={hf}", "tokenizer.kind=hf",
      "task=null", f"dataset.train={rows}", f"dataset.eval={rows}",
      "dataset.num_eval=4", "lora.module_path=.*_proj", "lora.rank=2",
      "lora.alpha=4.0", "training.max_steps=2", "data.batch_size=4",
      "eval.batch_size=4", "training.checkpoint_every_n_steps=2",
  ])
  summary = json.loads((out / "summary.json").read_text())
  assert summary["num_lora_params"] > 0 and summary["eval_examples"] == 4
  # The checkpoint's own sampler defaults are used where the recipe is null.
  capsys.readouterr()
  cli.main(["generate", str(out), "color=false", "prompts=[say 3]"])
  assert json.loads((out / "generate.json").read_text())["checkpoint_step"] == 2
  cli.main(["generate", str(hf), "color=false", "prompts=[say 3]",
            "max_new_tokens=4", "png=" + str(tmp_path / "t.png"), "chat=true"])
  printed = capsys.readouterr().out
  assert "forward passes per token" in printed
  # The HF directory's own generation_config.json sets the sampler.
  output = json.loads((pathlib.Path.cwd() / "generate.json").read_text())
  assert output["sampler"]["max_denoising_steps"] == 6


def test_bad_recipe_values_are_one_line_usage_errors(tmp_path, capsys):
  with pytest.raises(errors.UsageError, match="model"):
    dg_job.build_model(omegaconf.OmegaConf.create(
        dict(kind="tiny_diffusion_gemma", vocab_size=8, hidden_size=8,
             intermediate_size=8, num_heads=3, num_kv_heads=2, head_dim=4,
             global_num_kv_heads=1, global_head_dim=4, sliding_window=4,
             canvas_length=4, layer_types=["full_attention"], num_experts=None,
             final_logit_softcap=30.0, dtype="float32")), seed=0)
  with pytest.raises(errors.UsageError, match="diffusion_gemma_hf needs"):
    dg_job.build_model(omegaconf.OmegaConf.create(
        dict(kind="diffusion_gemma_hf", path=None, dtype="float32")), seed=0)
  assert cli.main(["sft", "diffusion_gemma_tiny.yaml",
                   f"output_dir={tmp_path}", "mesh.sp=2"]) == 2
  err = capsys.readouterr().err.strip()
  assert "mesh" in err and "\n" not in err
  # Splash where it cannot run: seq_len 32 does not tile; several devices.
  for extra, message in [
      ([], "multiple of the tile"),
      (["data.seq_len=128", "mesh.fsdp=2"], "on one device"),
  ]:
    assert cli.main(["sft", "diffusion_gemma_tiny.yaml", "model.attention=splash",
                     f"output_dir={tmp_path}", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.attention" in err and message in err and "\n" not in err


def test_tpu_recipe_loads_through_its_real_path_on_a_tiny_checkpoint(tmp_path):
  hf = _hf_checkpoint(tmp_path)
  cfg = common.load_recipe(["diffusiongemma_26b_a4b.yaml", f"model.path={hf}",
                            "model.dtype=float32", "model.param_dtype=float32"])
  assert cfg.model.kind == "diffusion_gemma_hf" and cfg.lora.rank > 0
  model, sampler = dg_job.build_model(cfg.model, seed=0)
  assert model.config.canvas_length == 4 and sampler.max_denoising_steps == 6
  lora = common.apply_lora(model, cfg.lora, seed=0)
  paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(
      nnx.state(lora, nnx.LoRAParam))]
  assert any("q_proj" in p for p in paths) and any("mlp.down_proj" in p for p in paths)


def test_sft_on_an_fsdp_tp_mesh_matches_one_device(tmp_path):
  run = ["sft", "diffusion_gemma_tiny.yaml", *SMALL, "training.max_steps=3",
         "task.num_eval=2", "eval.batch_size=2",
         "sampler.max_denoising_steps=2",
         "training.checkpoint_every_n_steps=3"]
  # In this process (8 devices): no mesh, then a 2 x 2 mesh over 4 of them.
  for name, extra in (("one", []), ("mesh", ["mesh.fsdp=2", "mesh.tp=2"])):
    assert cli.main([*run, *extra, f"output_dir={tmp_path / name}"]) == 0
  one = json.loads((tmp_path / "one/summary.json").read_text())
  mesh = json.loads((tmp_path / "mesh/summary.json").read_text())
  assert mesh["recipe"]["mesh"] == {"fsdp": 2, "tp": 2}
  np.testing.assert_allclose(mesh["train_losses"], one["train_losses"],
                             rtol=1e-4)
