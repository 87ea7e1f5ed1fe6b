"""The `tunix-blockdiff sft` job: recipes, overrides, an end-to-end run."""

import json
import math

import kill_resume
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.runs import common

# A few steps of the default recipe on a smaller model and data.
TINY = [
    "task.num_train=128",
    "task.num_eval=12",
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.hidden_dim=64",
    "model.head_dim=8",
    "data.batch_size=8",
    "training.max_steps=4",
    "training.gradient_accumulation_steps=2",
    "training.eval_every_n_steps=2",
    "training.checkpoint_every_n_steps=2",
    "eval.batch_size=8",
    "eval.thresholds=[1.0]",
]


def test_cli_sft_end_to_end_writes_summary_figure_and_checkpoints(
    tmp_path, capsys
):
  out = tmp_path / "sft"
  assert cli.main(["sft", f"output_dir={out}", *TINY]) == 0
  summary = json.loads((out / "summary.json").read_text())
  for key in (
      "train_steps",
      "final_train_loss",
      "eval_loss",
      "eval_exact_match",
      "tokens_per_step",
      "seconds",
  ):
    assert key in summary, key
  assert summary["train_steps"] == 4
  assert (
      math.isfinite(summary["final_train_loss"])
      and summary["final_train_loss"] > 0
  )
  assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] > 0
  assert 0.0 <= summary["eval_exact_match"] <= 1.0
  assert summary["tokens_per_step"] > 0
  assert summary["seconds"] > 0
  assert [row["threshold"] for row in summary["threshold_sweep"]] == [0.9, 1.0]
  # threshold 1.0 commits exactly one slot per call.
  assert summary["threshold_sweep"][-1]["tokens_per_step"] <= 1.0 + 1e-9
  assert summary["recipe"]["diffusion"]["stream"] == "single"
  assert (out / "sft.png").stat().st_size > 0
  assert omegaconf.OmegaConf.load(out / "recipe.yaml").training.max_steps == 4
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4"]
  assert "eval_exact_match" in capsys.readouterr().out
  # Relaunching the finished run changes nothing.
  kill_resume.assert_relaunch_changes_nothing(["sft", *TINY], out, capsys)
  # Killed right after its last checkpoint (no summary yet): the relaunch
  # trains nothing and evaluates the same model.
  (out / "summary.json").unlink()
  assert cli.main(["sft", f"output_dir={out}", *TINY]) == 0
  assert "resuming from the checkpoint of step 4" in capsys.readouterr().err
  again = json.loads((out / "summary.json").read_text())
  assert again["train_steps"] == 4 and again["train_losses"] == []
  for key in ("eval_loss", "eval_exact_match", "tokens_per_step"):
    assert again[key] == pytest.approx(summary[key], rel=1e-6), key
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4"]


def test_default_recipe_and_overrides():
  cfg = common.load_recipe([])
  assert cfg.model.kind == "tiny_qwen3" and cfg.task.name == "reverse"
  cfg = common.load_recipe(
      ["tiny.yaml", "diffusion.stream=single", "eval.thresholds=[0.9]"]
  )
  assert cfg.diffusion.stream == "single" and list(cfg.eval.thresholds) == [0.9]
  with pytest.raises(ValueError, match="unknown recipe key"):
    common.load_recipe(["training.max_step=3"])
  with pytest.raises(ValueError, match="key=value"):
    common.load_recipe(["tiny.yaml", "max_steps"])
  with pytest.raises(FileNotFoundError, match="bundled recipe"):
    common.load_recipe(["nope.yaml"])


@pytest.mark.parametrize("name", ["tiny.yaml", "qwen3_0p6b.yaml"])
def test_bundled_recipes_load_and_build_valid_configs(name):
  cfg = common.load_recipe([name])
  config = common.diffusion_config_from(cfg.diffusion)
  assert config.block_size >= 1
  assert cfg.data.seq_len % config.block_size == 0
  common.make_optimizer(cfg.training)


def test_recipe_certainty_keys_reach_the_config_and_are_validated():
  from tunix_blockdiff import errors  # pylint: disable=g-import-not-at-top

  cfg = common.load_recipe(["diffusion.certainty_weight=0.25"])
  config = common.diffusion_config_from(cfg.diffusion)
  assert (config.certainty_weight, config.certainty_temperature) == (0.25, 1.0)
  assert common.diffusion_config_from(
      common.load_recipe([]).diffusion
  ).certainty_weight == 0.0
  cfg = common.load_recipe(["diffusion.certainty_temperature=0"])
  with pytest.raises(errors.UsageError, match="certainty_temperature"):
    common.diffusion_config_from(cfg.diffusion)


def test_write_summary_makes_numbers_plain(tmp_path):
  path = common.write_summary(
      tmp_path, {"a": np.float32(1.5), "b": np.arange(2), "c": float("nan")}
  )
  assert json.loads(path.read_text()) == {"a": 1.5, "b": [0, 1], "c": None}


def test_context_parallel_refuses_a_gemma3_window_it_would_cut(tmp_path):
  from tunix_blockdiff import errors  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.jobs import sft  # pylint: disable=g-import-not-at-top

  cfg = common.load_recipe(
      [f"output_dir={tmp_path}", *TINY, "model.kind=tiny_gemma3", "data.cp_size=2"]
  )
  omegaconf.OmegaConf.set_struct(cfg, False)
  cfg.model.sliding_window_size = 8  # < data.seq_len (32)
  with pytest.raises(errors.UsageError, match="sliding window"):
    sft.run(cfg)
  assert not (tmp_path / "summary.json").exists()


def test_sft_trains_two_stream_with_splash_when_asked(tmp_path):
  """`model.attention=splash` (Pallas interpret mode here) with
  `model.remat=decoder`: a two-stream run at seq_len 64 (2L = 128, one tile)
  trains, and says so."""
  out = tmp_path / "splash"
  assert cli.main([
      "sft", f"output_dir={out}", *TINY, "training.max_steps=2",
      "training.gradient_accumulation_steps=1", "task.num_eval=4",
      "eval.batch_size=4", "data.seq_len=64", "diffusion.stream=two_stream",
      "model.attention=splash", "model.remat=decoder",
      "model.head_chunk=100"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["attention"] == "splash" and summary["train_steps"] == 2
  # packing none: every batch has the static mask's layout, so no lax.cond
  # of both masks (whose gradient keeps both variants' activations).
  assert summary["attention_mask_mode"] == "static"
  assert summary["head_chunk"] == 100
  assert summary["recipe"]["model"]["remat"] == "decoder"
  assert summary["recipe"]["model"]["head_chunk"] == 100
  assert math.isfinite(summary["final_train_loss"])


def test_splash_where_it_cannot_run_is_refused_before_training(tmp_path):
  from tunix_blockdiff import errors  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.jobs import sft  # pylint: disable=g-import-not-at-top

  for overrides, match in (
      (["model.attention=splash"], "multiple of the tile"),  # seq_len 32
      (["model.attention=splash", "model.kind=tiny_llama3",
        "data.seq_len=128"], "Qwen2 and Qwen3"),
      (["model.attention=flash"], "model.attention: implementation"),
      (["model.remat=everything"], "model.remat must be one of"),
      (["model.head_chunk=0"], "model.head_chunk must be >= 1"),
      (["model.attention=splash", "data.seq_len=128",
        "model.attention_mask_mode=static", "data.packing=unaligned"],
       "static needs documents at block multiples"),
      (["model.attention_mask_mode=lazy"], "mask_mode must be one of"),
      (["model.head_chunk=1.5"], "model.head_chunk must be an int"),
  ):
    cfg = common.load_recipe([f"output_dir={tmp_path}", *TINY, *overrides])
    with pytest.raises(errors.UsageError, match=match):
      sft.run(cfg)
    assert not (tmp_path / "summary.json").exists()
