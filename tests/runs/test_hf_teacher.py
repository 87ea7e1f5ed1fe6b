"""`opd` with `teacher.kind: hf`: a Hugging Face checkpoint as the teacher.

Every family `load_hf` reads gets a tiny checkpoint written here (`hf_layout`)
that shares the student's character tokenizer (pad 0, BOS 1, EOS 2, 50 ids);
the teacher loads and scores. Mismatched tokenizers, a missing or non-HF
`teacher.path` and in-job teacher keys with `kind: hf` are one-line usage
errors before any compute. A Qwen3 teacher trained briefly here (saved with
`save_qwen3_hf`) lowers the student's held-out divergence in an `opd` run.
"""

import importlib.util
import json
import pathlib
import sys

from flax import nnx
import jax.numpy as jnp
import numpy as np
import omegaconf
import pytest

from tunix_blockdiff import errors
from tunix_blockdiff import tasks
from tunix_blockdiff.runs import ar_teacher
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import hf_teacher
from tunix_blockdiff.jobs import opd as opd_job
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.jobs import rl_policy
from tunix_blockdiff.runs import rl_reward
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import registry
from tunix_blockdiff.models import tiny as tiny_models
from tunix_blockdiff.rl import opd

_spec = importlib.util.spec_from_file_location(
    "hf_layout", pathlib.Path(__file__).parents[1] / "hf_layout.py"
)
hf_layout = sys.modules.get(_spec.name)
if hf_layout is None:
  hf_layout = importlib.util.module_from_spec(_spec)
  sys.modules[_spec.name] = hf_layout
  _spec.loader.exec_module(hf_layout)

_tok_spec = importlib.util.spec_from_file_location(
    "tests_data_hf_tokenizer",
    pathlib.Path(__file__).parents[1] / "data" / "hf_tokenizer.py",
)
hf_tokenizer = importlib.util.module_from_spec(_tok_spec)
_tok_spec.loader.exec_module(hf_tokenizer)

VOCAB = 50  # The student's (tiny.yaml's model.vocab_size).
CHAR_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TINY_SIZES = {
    "num_layers": 1,
    "embed_dim": 16,
    "hidden_dim": 32,
    "num_heads": 2,
    "head_dim": 8,
    "num_kv_heads": 1,
}


def _write_teacher(directory, family, *, vocab=VOCAB, **ids):
  """A tiny random HF checkpoint of `family` with the char tokenizer's ids."""
  sizes = dict(TINY_SIZES, num_layers=2) if family == "gemma3" else TINY_SIZES
  model = getattr(tiny_models, f"tiny_{family}")(vocab, **sizes)
  hf_layout.write(directory, family, hf_layout.randomize(model))
  config_file = directory / "config.json"
  config = json.loads(config_file.read_text()) | CHAR_IDS | ids
  config_file.write_text(json.dumps(config))
  return directory


def _teacher_cfg(path, **keys):
  return omegaconf.OmegaConf.create(
      {
          "kind": "hf",
          "path": None if path is None else str(path),
          "dtype": "float32",
          **keys,
      }
  )


def _check(path, vocab_size=VOCAB):
  hf_teacher.check_tokenizers_agree(
      path, tasks.CharTokenizer(), vocab_size=vocab_size, mask_token_id=3
  )


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_every_family_loads_and_scores(tmp_path, family):
  path = _write_teacher(tmp_path / family, family)
  cfg = _teacher_cfg(path)
  hf_teacher.check_teacher_section(cfg)
  _check(path)
  teacher = hf_teacher.load_teacher(cfg, rl_common.rl_mesh(None))
  assert opd.model_vocab_size(teacher) == VOCAB
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(4, VOCAB, (2, 5)), jnp.int32)
  prompt_mask = jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
  completion = jnp.asarray(rng.integers(4, VOCAB, (2, 3)), jnp.int32)
  logits = opd.ar_teacher_logits(
      teacher, prompts, prompt_mask, completion, jnp.ones((2, 3), bool)
  )
  assert logits.shape == (2, 3, VOCAB) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  # The summary's teacher_exact_match (Tunix's Sampler) runs on every family.
  exact = ar_teacher.teacher_exact_match(
      teacher,
      tasks.CharTokenizer(),
      rl_reward.exact_match_reward(),
      [{"prompt": "12", "answer": "21"}, {"prompt": "345", "answer": "543"}],
      max_new_tokens=3,
      max_prompt_length=6,
  )
  assert 0.0 <= exact <= 1.0


def test_teacher_is_sharded_on_the_job_mesh(tmp_path):
  path = _write_teacher(tmp_path / "qwen3", "qwen3")
  mesh = rl_common.rl_mesh({"fsdp": 2, "tp": 1})
  teacher = hf_teacher.load_teacher(_teacher_cfg(path), mesh)
  embedding = teacher.embedder.input_embedding.get_value()
  assert embedding.sharding.mesh.shape == mesh.shape
  assert len(embedding.sharding.device_set) == 2
  # Sharded, it scores as the unsharded teacher does.
  single = hf_teacher.load_teacher(_teacher_cfg(path), rl_common.rl_mesh(None))
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, VOCAB, (2, 7)))
  args = (tokens[:, :4], jnp.ones((2, 4), bool), tokens[:, 4:],
          jnp.ones((2, 3), bool))
  # One compiled program each, as inside the opd loss (op by op, ~150).
  scores = nnx.jit(opd.ar_teacher_logits)
  with mesh:
    sharded = scores(teacher, *args)
  np.testing.assert_allclose(
      np.asarray(sharded),
      np.asarray(scores(single, *args)),
      rtol=1e-5,
      atol=1e-5,
  )


@pytest.mark.parametrize(
    "ids, vocab, match",
    [
        ({}, 64, "vocabulary size 64 .* the student's 50"),
        ({"eos_token_id": 5}, VOCAB, "eos id 5 differs from the student's 2"),
        ({"pad_token_id": 7}, VOCAB, "pad id 7 differs from the student's 0"),
        ({"bos_token_id": [8, 9]}, VOCAB, r"bos id \[8, 9\] .* student's 1"),
    ],
)
def test_tokenizer_mismatch_is_one_line_naming_both(
    tmp_path, ids, vocab, match
):
  path = _write_teacher(tmp_path / "t", "qwen3", vocab=vocab, **ids)
  with pytest.raises(errors.UsageError, match=match) as e:
    _check(path)
  assert "\n" not in str(e.value)


def test_eos_list_and_absent_ids_agree(tmp_path):
  path = _write_teacher(tmp_path / "t", "llama3", eos_token_id=[2, 9])
  _check(path)
  config = json.loads((path / "config.json").read_text())
  del config["pad_token_id"], config["bos_token_id"]
  (path / "config.json").write_text(json.dumps(config))
  _check(path)


def test_a_teacher_tokenizer_is_compared_too(tmp_path):
  path = _write_teacher(tmp_path / "t", "qwen3", vocab=64)
  config = json.loads((path / "config.json").read_text())
  for key in CHAR_IDS:
    del config[key]
  (path / "config.json").write_text(json.dumps(config))
  size = hf_tokenizer.write_tiny_hf_tokenizer(path)
  ids = hf_teacher.teacher_ids(path)
  assert ids["tokenizer_size"] == size and ids["eos"] == {3}
  # The student shares the teacher's tokenizer: they agree.
  hf_teacher.check_tokenizers_agree(
      path, checkpoints.HFTokenizer(path), vocab_size=64, mask_token_id=60
  )
  with pytest.raises(
      errors.UsageError, match=f"tokenizer has {size} ids, the student's 50"
  ):
    hf_teacher.check_tokenizers_agree(
        path, tasks.CharTokenizer(), vocab_size=64, mask_token_id=3
    )


def test_mask_id_must_be_a_teacher_id(tmp_path):
  path = _write_teacher(tmp_path / "t", "qwen3")
  with pytest.raises(errors.UsageError, match="mask id 60 .* of 50"):
    hf_teacher.check_tokenizers_agree(
        path, tasks.CharTokenizer(), vocab_size=VOCAB, mask_token_id=60
    )


def test_bad_teacher_sections_are_refused(tmp_path):
  path = _write_teacher(tmp_path / "t", "qwen3")
  not_hf = tmp_path / "not_hf"
  not_hf.mkdir()
  for cfg, match in (
      (_teacher_cfg(None), "teacher.path=null is not valid: teacher.path"
       " must be set"),
      (_teacher_cfg(tmp_path / "missing"), "is not a directory"),
      (_teacher_cfg(not_hf), "has no config.json"),
      (_teacher_cfg(path, num_layers=4), "teacher.num_layers=4 is a key of"),
      (_teacher_cfg(path, steps=10), "teacher.steps=10 is a key of"),
      (_teacher_cfg(path, kind="bf"), "teacher.kind must be one of"),
      (_teacher_cfg(path, kind="ar"), "is for teacher.kind=hf"),
  ):
    with pytest.raises(errors.UsageError, match=match) as e:
      hf_teacher.check_teacher_section(cfg)
    assert "\n" not in str(e.value)
  with pytest.raises(errors.UsageError, match="dtype must be one of"):
    hf_teacher.check_teacher_section(_teacher_cfg(path, dtype="float8"))
  yarn = _write_teacher(
      tmp_path / "yarn", "llama3", rope_scaling={"rope_type": "yarn"}
  )
  with pytest.raises(errors.UsageError, match="plain RoPE"):
    hf_teacher.check_teacher_section(_teacher_cfg(yarn))
  (not_hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  (not_hf / "model.safetensors").write_bytes(b"")
  with pytest.raises(errors.UsageError, match="not a Tunix causal LM"):
    hf_teacher.check_teacher_section(_teacher_cfg(not_hf))
  # The bundled recipe's in-job keys (unchanged) go with kind hf.
  bundled = omegaconf.OmegaConf.load(common.recipe_path("opd_tiny.yaml"))
  bundled.teacher.kind, bundled.teacher.path = "hf", str(path)
  hf_teacher.check_teacher_section(bundled.teacher)


def _opd_args(student_dir, out, *extra):
  return [
      f"student.checkpoint={student_dir}",
      f"output_dir={out}",
      "teacher.kind=hf",
      "eval.num_prompts=8",
      "eval.batch_size=8",
      "rollout.max_tokens_to_generate=4",
      "rollout.max_prompt_length=10",
      *extra,
  ]


def test_opd_refuses_a_mismatched_teacher_before_compute(
    untrained_policy, tmp_path, monkeypatch
):
  path = _write_teacher(tmp_path / "t", "qwen3", eos_token_id=5)

  def no_compute(*unused_args, **unused_kwargs):
    raise AssertionError("the student was loaded before the check")

  monkeypatch.setattr(rl_policy, "load_policy", no_compute)
  with pytest.raises(errors.UsageError, match="eos id 5 differs"):
    opd_job.main(
        _opd_args(untrained_policy, tmp_path / "run", f"teacher.path={path}")
    )


def _trained_qwen3_teacher(directory):
  """A tiny Qwen3 trained briefly on 2-3 digit reversal, saved as HF."""
  tokenizer = tasks.CharTokenizer()
  task = tasks.get_task("reverse", min_digits=2, max_digits=3)
  cfg = omegaconf.OmegaConf.create(
      dict(
          TINY_SIZES,
          embed_dim=32,
          hidden_dim=64,
          random_mlp=True,
          steps=60,
          batch_size=16,
          learning_rate=0.01,
          warmup_steps=5,
      )
  )
  model, _ = ar_teacher.train_ar_teacher(
      cfg,
      tokenizer,
      VOCAB,
      task.sample(512, seed=3),
      seq_len=14,
      seed=0,
      mesh=rl_common.rl_mesh(None),
  )
  return hf_export.save_qwen3_hf(model, directory, **CHAR_IDS)


def test_opd_with_an_hf_teacher_lowers_the_divergence(
    untrained_policy, tmp_path
):
  path = _trained_qwen3_teacher(tmp_path / "teacher")
  out = tmp_path / "run"
  code = opd_job.main(
      _opd_args(
          untrained_policy,
          out,
          f"teacher.path={path}",
          "opd.steps=8",
          "opd.prompts_per_step=4",
          "opd.micro_batch_prompts=4",
          "opd.learning_rate=0.01",
      )
  )
  assert code == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["teacher_kind"] == "hf"
  assert summary["teacher_final_loss"] is None
  assert 0.0 <= summary["teacher_exact_match"] <= 1.0
  assert summary["optimizer_steps"] == 8
  assert summary["divergence_end"] < summary["divergence_start"]
