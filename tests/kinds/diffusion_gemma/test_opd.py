"""`tunix-blockdiff opd` on a DiffusionGemma student (sequence-level OPD)."""

import json

import dg_sizes
from flax import nnx
import hf_layout
import kill_resume
import jax
import jax.numpy as jnp
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff.attention import masks
from tunix_blockdiff import tasks as tasks_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.kinds.diffusion_gemma import generate as dg_generate
from tunix_blockdiff.kinds.diffusion_gemma import opd as diffusion_gemma_opd
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import tiny as tiny_models

OPD = [
    "opd", "teacher.num_layers=1", "teacher.embed_dim=16",
    "teacher.hidden_dim=32", "teacher.num_heads=2", "teacher.head_dim=8",
    "teacher.num_kv_heads=1", "teacher.steps=3", "teacher.warmup_steps=1",
    "teacher.batch_size=8", "teacher.num_train=16", "opd.steps=2",
    "opd.prompts_per_step=2", "opd.micro_batch_prompts=1",
    "opd.num_generations=2", "opd.reference_kl=0.04", "eval.num_prompts=2",
    "eval.batch_size=4",
    "rollout.max_tokens_to_generate=8", "rollout.max_prompt_length=null",
]


@pytest.fixture(name="student")
def _student(dg_two_step_sft):
  """conftest's 2-step DiffusionGemma sft run on 6-10 digit reversal."""
  return dg_two_step_sft


def _params(run_dir):
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  model, _, step = dg_generate.load_run(run_dir, cfg)
  return step, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


@pytest.mark.xdist_group(dg_sizes.SFT_GROUP)
def test_opd_trains_a_diffusion_gemma_student_on_the_teachers_likelihood(
    student, tmp_path, capsys):
  out = tmp_path / "opd"
  assert cli.main([*OPD, f"student.checkpoint={student}",
                   "opd.checkpoint_every_n_steps=2", f"output_dir={out}"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["policy_family"] == "diffusion_gemma"
  assert summary["divergence_kind"] == "teacher_cross_entropy"
  # A cross-entropy: positive and finite, before and after.
  for key in ("divergence_start", "divergence_end"):
    assert 0 < summary[key] < np.inf
  for key in ("divergence_se_start", "divergence_se_end"):
    assert 0 <= summary[key] < np.inf
  assert summary["optimizer_steps"] == 2 and summary["rollouts"] == 8
  # Log-probabilities per token, one mean per step.
  assert len(summary["train_teacher_logprob"]) == 2
  assert all(v <= 0 for v in summary["train_teacher_logprob"])
  assert summary["prompt_truncation"]["truncated_train"] == 0
  _, before = _params(student)
  step, after = _params(out / "policy")
  assert step == 2
  assert any(not np.allclose(a, b) for a, b in zip(before, after))
  capsys.readouterr()
  assert cli.main(["generate", str(out), "color=false",
                   "prompts=[rev 123456]", "max_new_tokens=8"]) == 0
  assert "forward passes per token" in capsys.readouterr().out
  # Relaunching the finished run changes nothing. What a kill during the
  # final policy's write leaves (Orbax's files written, not committed; no
  # policy recipe, no summary): the relaunch resumes at step 2, removes
  # it and rewrites the same policy and summary.
  run = [*OPD, f"student.checkpoint={student}", "opd.checkpoint_every_n_steps=2"]
  kill_resume.assert_relaunch_changes_nothing(run, out, capsys)
  (out / "summary.json").unlink()
  (out / "policy" / "recipe.yaml").unlink()
  policy_checkpoints = out / "policy" / "checkpoints"
  (policy_checkpoints / "2").rename(
      policy_checkpoints / "2.orbax-checkpoint-tmp-1")
  assert cli.main([*run, f"output_dir={out}"]) == 0
  assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
  kill_resume.assert_same_summary(kill_resume.summary(out),
                                  {k: v for k, v in summary.items()
                                   if not k.endswith(("recipe", "seconds"))})
  assert not rl_checkpoints.partial_writes(policy_checkpoints)
  _, rewritten = _params(out / "policy")
  for got, want in zip(rewritten, after, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_teacher_log_prob_is_the_causal_log_likelihood_per_token():
  tokenizer = tasks_lib.CharTokenizer()
  teacher = tiny_models.tiny_qwen3(tokenizer.vocab_size, seed=3,
                                   random_mlp=True, num_layers=1,
                                   embed_dim=16, hidden_dim=32, num_heads=2,
                                   head_dim=8, num_kv_heads=1)
  score = diffusion_gemma_opd.TeacherLogProb(
      teacher, tokenizer, max_prompt_length=9, max_new_tokens=6)
  prompts, completions = ["rev 12", "rev 1234"], ["21", "4321x"]
  got = score(prompts, completions)
  for prompt, completion, value in zip(prompts, completions, got):
    # Unpadded, one row: BOS + prompt + completion + EOS, plain causal mask.
    ids = [tokenizer.bos_id(), *tokenizer.encode(prompt)]
    target = [*tokenizer.encode(completion), tokenizer.eos_id()]
    tokens = jnp.asarray([ids + target], jnp.int32)
    positions = jnp.arange(tokens.shape[1])[None]
    mask = masks.block_causal_mask(positions, positions, 1)
    # One compiled program (op by op: ~60 programs per row).
    logits = nnx.jit(modeling.call_model)(teacher, tokens, positions, mask)[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    want = np.mean([float(logp[len(ids) - 1 + j, t])
                    for j, t in enumerate(target)])
    assert value == pytest.approx(want, abs=1e-5)


def test_bad_keys_and_a_mismatched_teacher_are_refused(student, tmp_path,
                                                       capsys,
                                                       untrained_policy):
  base = [*OPD, f"student.checkpoint={student}", f"output_dir={tmp_path}/a"]
  assert cli.main([*base, "opd.num_generations=1"]) == 2
  assert "num_generations >= 2" in capsys.readouterr().err
  # A block-diffusion student refuses the DiffusionGemma-only keys.
  bd = ["opd", f"student.checkpoint={untrained_policy}",
        f"output_dir={tmp_path}/b"]
  assert cli.main([*bd, "opd.num_generations=2"]) == 2
  assert cli.main([*bd, "opd.reference_kl=0.1"]) == 2
  # An HF teacher with another vocabulary: one line, before any compute.
  teacher = hf_layout.write(tmp_path / "teacher", "qwen3",
                            hf_layout.randomize(tiny_models.tiny_qwen3(
                                64, num_layers=1, embed_dim=16, hidden_dim=32,
                                num_heads=2, head_dim=8, num_kv_heads=1)))
  capsys.readouterr()
  ar_keys = [a for a in base if not a.startswith("teacher.")]
  assert cli.main([*ar_keys, "teacher.kind=hf", f"teacher.path={teacher}"]) == 2
  assert "vocabulary size 64" in capsys.readouterr().err
  assert not (tmp_path / "a" / "summary.json").exists()
