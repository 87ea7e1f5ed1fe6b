"""Every command end to end under an 8-device mesh, with and without LoRA.

A finished training run must never be lost to its evaluation step: `sft`
with `mesh.fsdp=8` once crashed in the generation eval (`merge_lora` on a
model without LoRA, because sharding makes a new model object).
"""

import json

import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import opd
from tunix_blockdiff.jobs import rl

TINY = [
    "task.kwargs.min_digits=2",
    "task.kwargs.max_digits=3",
    "task.num_train=64",
    "task.num_eval=8",
    "data.seq_len=14",
    "data.batch_size=8",
    "model.num_layers=1",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.num_heads=2",
    "model.head_dim=8",
    "model.num_kv_heads=2",
    "diffusion.block_size=4",
    "training.max_steps=2",
    "training.warmup_steps=1",
    "training.eval_every_n_steps=1000",
    "training.checkpoint_every_n_steps=2",
    "eval.thresholds=[0.9]",
    "eval.batch_size=8",
]
LORA = [
    "lora.module_path=.*q_proj|.*v_proj",
    "lora.rank=2",
    "lora.alpha=4.0",
]


@pytest.fixture(scope="module", params=["plain", "lora"])
def sft_run(request, tmp_path_factory):
  """An `sft` run under an (fsdp=4, tp=2) mesh, evaluation included."""
  out = tmp_path_factory.mktemp(request.param)
  extra = LORA if request.param == "lora" else []
  assert (
      cli.main([
          "sft",
          f"output_dir={out}",
          "mesh.fsdp=4",
          "mesh.tp=2",
          *TINY,
          *extra,
      ])
      == 0
  )
  return out, request.param


def test_sft_under_a_mesh_finishes_its_evaluation(sft_run):
  out, kind = sft_run
  summary = json.loads((out / "summary.json").read_text())
  assert summary["train_steps"] == 2
  assert 0.0 <= summary["eval_exact_match"] <= 1.0
  assert summary["tokens_per_step"] > 0
  assert (summary["num_lora_params"] > 0) == (kind == "lora")


def test_generate_under_a_mesh_equals_one_device(sft_run):
  out, _ = sft_run
  args = ["generate", str(out), "color=false", "steps_per_block=2"]
  assert cli.main(args) == 0
  single = json.loads((out / "generate.json").read_text())
  assert cli.main([*args, "mesh.fsdp=8"]) == 0
  sharded = json.loads((out / "generate.json").read_text())
  assert sharded["tokens"] == single["tokens"]
  assert sharded["commit_step"] == single["commit_step"]


def _job_recipe(tmp_path, name):
  cfg = omegaconf.OmegaConf.load(common.recipe_path(name))
  cfg.output_dir = str(tmp_path / "run")
  recipe = tmp_path / name
  omegaconf.OmegaConf.save(cfg, recipe)
  return recipe


ROLLOUT = [
    "eval.num_prompts=2",
    "eval.batch_size=2",
    "rollout.max_tokens_to_generate=4",
    "rollout.max_prompt_length=10",
]


def test_rl_and_opd_start_from_an_sft_run_under_a_mesh(sft_run, tmp_path):
  """rl (from the LoRA run) and opd (from the plain run) run one step.

  Both jobs run on one device; what a mesh changes for them is the SFT
  checkpoint they restore (sharded over 8 devices when saved).
  """
  out, kind = sft_run
  if kind == "lora":
    code = rl.main([
        str(_job_recipe(tmp_path, "rl_tiny.yaml")),
        f"init.checkpoint={out}",
        "grpo.steps=1",
        "grpo.prompts_per_step=2",
        "grpo.num_generations=2",
        "grpo.micro_batch_prompts=1",
        "eval.samples_per_prompt=1",
        *ROLLOUT,
    ])
    key = "reward_start"
  else:
    code = opd.main([
        str(_job_recipe(tmp_path, "opd_tiny.yaml")),
        f"student.checkpoint={out}",
        *[
            f"teacher.{k.removeprefix('model.')}"
            for k in TINY
            if k.startswith("model.")
        ],
        "teacher.steps=2",
        "teacher.warmup_steps=1",
        "teacher.batch_size=8",
        "teacher.num_train=32",
        "opd.steps=1",
        "opd.prompts_per_step=2",
        "opd.micro_batch_prompts=1",
        *ROLLOUT,
    ])
    key = "student_exact_match_start"
  assert code == 0
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert 0.0 <= summary[key] <= 1.0
