"""`tunix-blockdiff export RUN OUT`: an SFT run -> a Hugging Face directory.

Round trips (export -> `load_hf`) in every family with and without LoRA,
`generate` on the exported directory against the run, and the refusals: one
line, exit 2, nothing written.
"""

import importlib.util
import json
import pathlib
import shutil

from flax import nnx
import hf_layout
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import cli
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import exported
from tunix_blockdiff.jobs import generate as generate_job
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import hf_export

_spec = importlib.util.spec_from_file_location(
    "tests_data_hf_tokenizer",
    pathlib.Path(__file__).parents[1] / "data" / "hf_tokenizer.py",
)
hf_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_tokenizer)

SIZES = {
    "num_layers": 2,
    "embed_dim": 16,
    "hidden_dim": 32,
    "num_heads": 2,
    "head_dim": 8,
    "num_kv_heads": 1,
}
LORA_PATHS = {  # Gemma3: its output einsum and MLP merge, q/kv einsums not.
    "qwen3": ".*q_proj|.*v_proj|.*down_proj",
    "qwen2": ".*k_proj|.*o_proj|.*up_proj",
    "llama3": ".*q_proj|.*gate_proj",
    "gemma3": ".*attn_vec_einsum|.*down_proj",
}


def _randomize(model, kind=nnx.Param, seed: int = 0):
  """Every `kind` parameter drawn from N(0, 0.3^2), so no mapping hides."""
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
      nnx.state(model, kind),
  )
  nnx.update(model, state)
  return model


def _make_run(directory, family, *, lora=None, extra=(), **sizes):
  """An SFT output_dir of a random tiny `family` model; returns (dir, model).

  Without LoRA every weight is random and saved; with LoRA the base is the
  recipe's seeded model (what generate rebuilds) and the random LoRA
  factors are saved, as the SFT job does.
  """
  overrides = [
      "tiny.yaml",
      "task.kwargs.min_digits=2",
      "task.kwargs.max_digits=3",
      "task.num_train=8",
      "task.num_eval=4",
      "data.seq_len=14",
      "diffusion.block_size=4",
      f"model.kind=tiny_{family}",
      *[f"model.{k}={v}" for k, v in (SIZES | sizes).items()],
      f"output_dir={directory}",
      *extra,
  ]
  if lora:
    overrides += [f"lora.module_path={lora}", "lora.rank=2", "lora.alpha=4.0"]
  cfg = common.load_recipe(overrides)
  out = common.prepare_output_dir(cfg)
  model = common.build_model(cfg.model, seed=int(cfg.seed))
  if lora:
    model = _randomize(
        common.apply_lora(model, cfg.lora, seed=int(cfg.seed)), nnx.LoRAParam
    )
  else:
    model = _randomize(model)
  manager = checkpoint_lib.CheckpointManager(str(out / "checkpoints"))
  manager.save(3, model, save_only_lora_params=bool(lora), force=True)
  manager.close()
  return out, model


def _generate_both(run, out, *options):
  """generate's results on the run and on the exported directory."""
  options = ["color=false", *options]
  return [
      generate_job.run(*generate_job.parse_args([str(path), *options]))
      for path in (run, out)
  ]


def _logits(model, vocab=50):
  return hf_layout.causal_logits(model, vocab, 9)


@pytest.mark.parametrize(
    "family, lora, sizes",
    [
        ("qwen3", False, {}),
        ("qwen3", True, {}),
        ("qwen2", False, {}),
        ("qwen2", True, {}),
        ("llama3", False, {}),
        ("llama3", True, {}),
        ("gemma3", False, {}),  # q_einsum + kv_einsum
        ("gemma3", False, {"num_kv_heads": 2}),  # qkv_einsum
        ("gemma3", True, {}),
    ],
)
def test_export_loads_back_with_the_same_logits(tmp_path, family, lora, sizes):
  run, model = _make_run(
      tmp_path / "run", family, lora=LORA_PATHS[family] if lora else None,
      **sizes,
  )
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out)]) == 0
  assert sorted(p.name for p in out.iterdir()) == [
      "config.json", "model.safetensors"
  ]
  loaded = checkpoints.load_hf(out)
  expected = _logits(model)
  if lora:  # The merged weights compute what the LoRA model computes.
    np.testing.assert_allclose(_logits(loaded), expected, rtol=1e-5, atol=1e-5)
    cfg = common.load_recipe([str(run / common.RECIPE_FILE)])
    merged, _ = generate_job.load_trained_model(run, cfg)
    expected = _logits(merged)
  np.testing.assert_array_equal(_logits(loaded), expected)
  section = json.loads((out / "config.json").read_text())["block_diffusion"]
  assert section["block_size"] == 4 and section["mask_token_id"] == 3
  assert section["source"]["checkpoint_step"] == 3


def test_generate_on_the_export_matches_the_run(tmp_path, untrained_policy):
  run = tmp_path / "run"  # generate writes into its directory
  shutil.copytree(untrained_policy, run)
  out = tmp_path / "hf"
  out.mkdir()  # an empty OUT is fine
  assert cli.main(
      ["export", str(run), str(out), "--max-shard-size", "4KB"]
  ) == 0
  index = json.loads((out / hf_export.INDEX_FILE).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and all((out / s).is_file() for s in shards)
  assert not list(tmp_path.glob(".hf.partial-*"))
  section = exported.read_section(out)
  assert section["tokenizer"]["kind"] == "char"
  assert section["decoding"]["threshold"] == 0.9
  assert len(section["eval_prompts"]) == 4
  from_run, from_hf = _generate_both(run, out)
  assert from_hf["prompts"] == from_run["prompts"]
  np.testing.assert_array_equal(from_hf["tokens"], from_run["tokens"])
  np.testing.assert_array_equal(from_hf["commit_step"], from_run["commit_step"])
  assert from_hf["completions"] == from_run["completions"]
  assert from_hf["exact_match"] == from_run["exact_match"] is not None
  assert from_hf["checkpoint_step"] == from_run["checkpoint_step"] == 1
  # Custom prompts take the recorded eval budget; options still override.
  custom_run, custom_hf = _generate_both(
      run, out, 'prompts=["rev 12>"]', "steps_per_block=1"
  )
  np.testing.assert_array_equal(custom_hf["tokens"], custom_run["tokens"])
  # On a mesh the exported weights load sharded (load_hf's mesh).
  on_mesh = generate_job.run(
      *generate_job.parse_args([str(out), "color=false", "mesh={fsdp: 2}"])
  )
  np.testing.assert_array_equal(on_mesh["tokens"], from_hf["tokens"])


def _refused(capsys, argv, root: pathlib.Path) -> str:
  """Runs the CLI; asserts one line, exit 2 and no new files under root."""
  before = sorted(root.rglob("*"))
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err.startswith("tunix-blockdiff export: error: ")
  assert sorted(root.rglob("*")) == before
  return err


def test_refusals_are_one_line_and_write_nothing(
    tmp_path, capsys, untrained_policy
):
  root = tmp_path
  out = str(root / "hf")
  no_ckpt = root / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(untrained_policy / common.RECIPE_FILE, no_ckpt)
  err = _refused(capsys, ["export", str(no_ckpt), out], root)
  assert "no checkpoint" in err
  full = root / "full"
  full.mkdir()
  (full / "keep.txt").write_text("mine")
  err = _refused(capsys, ["export", str(untrained_policy), str(full)], root)
  assert "not an empty directory" in err
  assert (full / "keep.txt").read_text() == "mine"
  err = _refused(
      capsys, ["export", str(untrained_policy), out, "--tokenizer-files"], root
  )
  assert "char tokenizer" in err
  err = _refused(
      capsys, ["export", str(untrained_policy), out, "--max-shard-size=5XB"],
      root,
  )
  assert "--max-shard-size" in err
  err = _refused(capsys, ["export", str(untrained_policy), out, "--shard"], root)
  assert "unknown export option" in err
  err = _refused(capsys, ["export", str(untrained_policy)], root)
  assert "usage" in err
  err = _refused(capsys, ["export", str(root / "nope"), out], root)
  assert "recipe.yaml not found" in err


def test_gemma3_lora_on_einsum_weights_is_refused(
    tmp_path, capsys, monkeypatch
):
  run, _ = _make_run(tmp_path / "run", "gemma3", lora=".*q_einsum")

  def no_compute(*unused_args):
    raise AssertionError("refused only after loading the model")

  monkeypatch.setattr(generate_job, "load_trained_model", no_compute)
  err = _refused(capsys, ["export", str(run), str(tmp_path / "hf")], tmp_path)
  assert "cannot be merged" in err and "einsum" in err


def test_an_rl_output_dir_exports_its_final_policy(tmp_path, untrained_policy):
  rl_run = tmp_path / "rl"
  shutil.copytree(untrained_policy, rl_run / "policy")
  out = tmp_path / "hf"
  assert cli.main(["export", str(rl_run), str(out)]) == 0
  section = exported.read_section(out)
  assert section["source"]["run"] == str(rl_run / "policy")


def test_an_hf_tokenizer_travels_with_the_export(tmp_path):
  tokenizer_dir = tmp_path / "tok"
  assert hf_tokenizer.write_tiny_hf_tokenizer(tokenizer_dir) < 64
  run, _ = _make_run(
      tmp_path / "run",
      "llama3",
      extra=[
          "tokenizer.kind=hf",
          f"model.path={tokenizer_dir}",  # where tokenizer.kind=hf reads
          "task.name=add",
          "task.kwargs={min_digits: 1, max_digits: 2}",
          "model.vocab_size=64",
          "diffusion.mask_token_id=60",
      ],
  )
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out), "--tokenizer-files"]) == 0
  assert (out / "tokenizer.json").is_file()
  assert (out / "tokenizer_config.json").is_file()
  config = json.loads((out / "config.json").read_text())
  assert config["block_diffusion"]["tokenizer"] == {
      "kind": "hf", "eos_token": None
  }
  assert config["eos_token_id"] == 3 and config["model_type"] == "llama"
  from_run, from_hf = _generate_both(run, out, "steps_per_block=2")
  np.testing.assert_array_equal(from_hf["tokens"], from_run["tokens"])
  assert from_hf["completions"] == from_run["completions"]


def test_a_failed_write_leaves_nothing(tmp_path, untrained_policy, monkeypatch,
                                       capsys):
  real_write = hf_export.write_safetensors

  def write_then_fail(tensors, out, **kwargs):
    real_write(tensors, out, **kwargs)
    raise OSError("disk full")

  monkeypatch.setattr(hf_export, "write_safetensors", write_then_fail)
  assert cli.main(
      ["export", str(untrained_policy), str(tmp_path / "a" / "b" / "hf")]) == 1
  assert "tunix-blockdiff export: system error: OSError: disk full" in (
      capsys.readouterr().err)
  assert not list(tmp_path.iterdir())


def test_an_hf_run_keeps_its_base_config_keys(tmp_path):
  from tunix_blockdiff.models import tiny as tiny_models  # pylint: disable=g-import-not-at-top

  base = tmp_path / "base"
  hf_export.save_hf(
      tiny_models.tiny_qwen2(50, **SIZES), base, max_position_embeddings=123
  )
  run, model = _make_run(
      tmp_path / "run",
      "qwen2",
      extra=["model.kind=qwen2_hf", f"model.path={base}"],
  )
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out)]) == 0
  config = json.loads((out / "config.json").read_text())
  assert config["max_position_embeddings"] == 123
  assert config["block_diffusion"]["dtype"] == "float32"
  assert config["block_diffusion"]["source"]["model_kind"] == "qwen2_hf"
  np.testing.assert_array_equal(
      _logits(checkpoints.load_hf(out)), _logits(model)
  )
