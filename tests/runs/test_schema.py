"""Every job's recipe is validated in one pass before any compute.

A property test over each job's default recipe draws a bad override of one
leaf key (another type, a number out of its range, an unknown choice, null
where null is not allowed, an unknown sibling key) and runs the CLI
in-process: exit 2, one line naming the key, nothing written under
`output_dir`, in seconds. The bundled recipes (with the paths they need)
pass unchanged.
"""

import json
import re
import time

import hypothesis
from hypothesis import strategies as st
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import job_schemas
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import schema
from tunix_blockdiff.runs import sections

# (verb, default recipe) of every recipe-driven job and model kind.
JOBS = (("sft", "tiny.yaml"), ("sft", "diffusion_gemma_tiny.yaml"),
        ("rl", "rl_tiny.yaml"), ("opd", "opd_tiny.yaml"))


def _schema(verb, recipe):
  if verb == "sft":
    return kinds.of_recipe(common.load_recipe([recipe])).sft_schema()
  return {"rl": job_schemas.RL, "opd": job_schemas.OPD_RECIPE}[verb]


def _leaves(section, recipe, prefix=""):
  """(dotted key, Key) of every leaf the recipe sets that the schema types."""
  for name, value in recipe.items():
    spec = section.keys.get(name)
    if isinstance(spec, schema.Section) and isinstance(value, dict):
      yield from _leaves(spec, value, f"{prefix}{name}.")
    elif isinstance(spec, schema.Key):
      yield f"{prefix}{name}", spec


def _bad_values(spec: schema.Key) -> list[str]:
  """Override values (as typed on a command line) that `spec` refuses."""
  bad = []
  if not spec.null:
    bad.append("null")
  if spec.kind in ("int", "float"):
    bad.append("[1,2]")
    bad.append("notanumber")
    if spec.low is not None:
      bad.append(str(spec.low if spec.low_open else spec.low - 1))
    if spec.high is not None:
      bad.append(str(spec.high if spec.high_open else spec.high + 1))
  elif spec.kind == "bool":
    bad += ["3", "maybe"]
  elif spec.choices is not None:
    bad += ["no_such_choice", "7"]
  elif spec.kind == "str":
    bad.append("[1,2]")
  elif spec.kind == "list":
    bad.append("5")
  return bad


def _cases():
  cases = []
  for verb, recipe in JOBS:
    cfg = common.to_dict(common.load_recipe([recipe]))
    spec = _schema(verb, recipe)
    for key, leaf in _leaves(spec, cfg):
      if key == "output_dir":
        continue
      cases += [(verb, recipe, key, value) for value in _bad_values(leaf)]
    for section in {k.split(".")[0] for k, _ in _leaves(spec, cfg)}:
      if isinstance(cfg.get(section), dict):
        cases.append((verb, recipe, f"{section}.no_such_key", "1"))
  return cases


CASES = _cases()


def test_the_cases_cover_every_job_and_kind_of_mistake():
  assert {(v, r) for v, r, _, _ in CASES} == set(JOBS)
  values = {value for _, _, _, value in CASES}
  assert {"null", "notanumber", "no_such_choice", "maybe"} <= values
  assert len(CASES) > 200


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(case=st.sampled_from(CASES))
def test_a_bad_override_of_any_key_is_refused_in_one_line(
    case, tmp_path_factory, capsys):
  verb, recipe, key, value = case
  out = tmp_path_factory.mktemp("out") / "run"
  capsys.readouterr()
  clock = time.monotonic()
  status = cli.main([verb, recipe, f"{key}={value}", f"output_dir={out}"])
  seconds = time.monotonic() - clock
  err = capsys.readouterr().err
  assert status == 2, (case, err)
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err.startswith(f"tunix-blockdiff {verb}: error: ")
  assert key in err, (case, err)
  assert not out.exists(), case  # nothing written
  assert seconds < 15, (case, seconds)


def _hf_dir(tmp_path):
  directory = tmp_path / "hf"
  directory.mkdir()
  (directory / "config.json").write_text("{}")
  (directory / "model.safetensors").write_bytes(b"")
  return directory


@pytest.mark.parametrize("recipe", [
    "qwen3_0p6b.yaml", "sdar_1p7b.yaml", "convert_code.yaml",
    "fast_dllm_v2_7b.yaml", "diffusiongemma_26b_a4b.yaml"])
def test_bundled_real_model_recipes_pass_with_their_paths(recipe, tmp_path):
  rows = tmp_path / "train.jsonl"
  rows.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
  cfg = common.load_recipe([recipe, f"model.path={_hf_dir(tmp_path)}",
                            f"dataset.train={rows}"])
  job_schemas.check_recipe(common.to_dict(cfg), "sft")
  # And without the model's directory, one line naming the key.
  cfg = common.load_recipe([recipe, f"dataset.train={rows}"])
  with pytest.raises(errors.UsageError, match=r"^model\.path=null"):
    job_schemas.check_recipe(common.to_dict(cfg), "sft")


@pytest.mark.parametrize("verb,recipe", JOBS)
def test_default_recipes_pass(verb, recipe):
  job_schemas.check_recipe(common.to_dict(common.load_recipe([recipe])), verb)


def _refused(verb, *overrides, recipe=None):
  recipe = recipe or {"sft": "tiny.yaml", "rl": "rl_tiny.yaml",
                     "opd": "opd_tiny.yaml"}[verb]
  cfg = common.to_dict(common.load_recipe([recipe, *overrides]))
  with pytest.raises(errors.UsageError) as e:
    job_schemas.check_recipe(cfg, verb)
  message = str(e.value)
  assert "\n" not in message
  return message


CROSS_KEY_RULES = (
    ("rl", ["grpo.micro_batch_prompts=5"],
     "must divide grpo.prompts_per_step=16"),
    ("rl", ["rollout.temperature=0.0"], "rollout.temperature=0"),
    ("rl", ["grpo.checkpoint_every_n_steps=2", "grpo.num_iterations=2"],
     "needs grpo.num_iterations=1"),
    ("rl", ["rollout.steps_per_block=null", "rollout.sub_block_size=3"],
     "must divide the policy's block size 4"),
    ("rl", ["rollout.sub_block_size=2"],
     "must be null with rollout.steps_per_block"),
    # The warm start's sft recipe is validated as one, named as such.
    ("rl", ["init.sft_overrides=[training.max_steps=0]"],
     "init.sft_recipe/init.sft_overrides (the warm start's sft recipe):"
     " training.max_steps=0"),
    ("sft", ["model.vocab_size=10"], "model.vocab_size=10"),
    ("sft", ["diffusion.mask_token_id=50"], "must be < model.vocab_size=50"),
    ("sft", ["data.cp_size=2"], "must equal mesh.sp=1"),
    ("sft", ["distributed.num_processes=2", "distributed.process_id=2"],
     "must be < distributed.num_processes=2"),
    ("sft", ["diffusion.alignment=shifted"],
     "does not pair with alignment='shifted'"),
    ("sft", ["model.kind=null"], "model.kind=null is not valid"),
    ("diffusion_gemma_tiny.yaml", ["sampler.t_min=0.9", "sampler.t_max=0.5"],
     "need 0 < t_min < t_max"),
)


@pytest.mark.parametrize("where,overrides,words", CROSS_KEY_RULES)
def test_cross_key_rules(where, overrides, words):
  verb, recipe = ("sft", where) if where.endswith(".yaml") else (where, None)
  assert words in _refused(verb, *overrides, recipe=recipe)


@pytest.mark.parametrize("overrides", [["eval.threshold=1.0"],
                                       ["diffusion.block_size=64"]])
def test_legal_but_unusual_values_stay_legal(overrides):
  # A threshold of exactly 1.0, a block longer than the sequence.
  job_schemas.check_recipe(
      common.to_dict(common.load_recipe(["tiny.yaml", *overrides])), "sft")


def test_paths_are_checked_before_anything_runs(tmp_path, untrained_policy):
  empty_dir = tmp_path / "empty"
  empty_dir.mkdir()
  message = _refused("rl", f"init.checkpoint={empty_dir}")
  assert "init.checkpoint=" in message and "recipe.yaml not found" in message
  no_step = tmp_path / "no_step"
  no_step.mkdir()
  (no_step / "recipe.yaml").write_text(
      (untrained_policy / "recipe.yaml").read_text())
  assert "no step under" in _refused("opd", f"student.checkpoint={no_step}")
  job_schemas.check_recipe(common.to_dict(common.load_recipe(
      ["rl_tiny.yaml", f"init.checkpoint={untrained_policy}"])), "rl")
  assert "must name existing files" in _refused(
      "sft", f"dataset.train={tmp_path / 'missing.jsonl'}")
  assert "must be a Hugging Face model directory" in _refused(
      "sft", "model.kind=qwen3_hf", f"model.path={empty_dir}")
  (empty_dir / "config.json").write_text("{}")
  assert "has no *.safetensors files" in _refused(
      "sft", "model.kind=qwen3_hf", f"model.path={empty_dir}")
  assert "teacher.path" in _refused("opd", "teacher.kind=hf")


def _data_error(tmp_path, verb, text, *overrides, name="rows.jsonl"):
  path = tmp_path / name
  path.write_text(text)
  return _refused(verb, f"dataset.train={path}", *overrides), path


def test_data_files_are_named_in_every_error(tmp_path):
  message, path = _data_error(tmp_path, "sft", "")
  assert message == f"dataset.train: {path}: no rows (empty)"
  message, path = _data_error(tmp_path, "sft", '{"question": 1}\n')
  assert str(path) in message and "missing field 'prompt'" in message
  assert "got keys ['question']" in message
  message, path = _data_error(tmp_path, "sft", "{oops\n",
                              "dataset.bad_rows=error")
  assert f"{path}:1: not valid JSON" in message
  message, path = _data_error(tmp_path, "rl", '{"prompt": "x"}\n')
  assert f"{path}:1: bad prompt row" in message and "'answer'" in message
  message, path = _data_error(tmp_path, "rl", '{"text": "x"}\n')
  assert "'prompt' must be a non-empty string" in message
  assert "columns: ['text']" in message
  not_a_dataset = tmp_path / "saved"
  not_a_dataset.mkdir()
  message = _refused("sft", f"dataset.train={not_a_dataset}")
  assert str(not_a_dataset) in message and "not a readable hf_disk" in message


def test_generate_options_are_checked_before_loading(tmp_path, capsys):
  for option, words in (("threshold=2", "threshold=2 is not valid"),
                        ("steps_per_block=0", "steps_per_block=0"),
                        ("temperature=-1", "temperature=-1"),
                        ("prompts=[]", "prompts=[]"),
                        ("tresh=1", "did you mean 'threshold'")):
    with pytest.raises(errors.UsageError, match=re.escape(words)):
      from tunix_blockdiff.jobs import generate  # pylint: disable=g-import-not-at-top

      generate.parse_options([option])


def test_the_mesh_is_checked_against_the_devices(tmp_path, capsys):
  assert cli.main(["sft", "mesh.fsdp=16", f"output_dir={tmp_path / 'o'}"]) == 2
  err = capsys.readouterr().err
  assert "mesh.fsdp * mesh.sp * mesh.tp = 16 must be <= the 8 device(s)" in err
  assert not (tmp_path / "o").exists()
  with pytest.raises(errors.UsageError, match="mesh.sp=2 is not valid"):
    sections.check_devices({"mesh": {"sp": 2}}, sequence=False)


def test_key_rules_in_words():
  assert schema.integer(1).rule() == "must be an int >= 1"
  assert schema.probability(low_open=True).rule() == (
      "must be a number in (0, 1]")
  assert schema.choice("a", "b", null=True).rule() == (
      "must be one of ['a', 'b'] or null")
  with pytest.raises(errors.UsageError, match=r"x=nan is not valid"):
    schema.number(0).check("x", float("nan"))
  with pytest.raises(errors.UsageError, match=r"x=true is not valid"):
    schema.integer(0).check("x", True)
  schema.number(0).check("x", 3)  # an int is a number
  with pytest.raises(errors.UsageError, match=r"did you mean 'single'"):
    schema.choice("single", "two_stream").check("x", "singel")
