"""`runs.kinds`: the model-kind registry every verb dispatches through.

Which kind a recipe, a policy section and a `generate` directory belong
to; every registered verb reference resolves to a function; a verb a kind
does not take is refused in one line (by the CLI, before any work); no job
module branches on DiffusionGemma outside the kind's own modules.
"""

import ast
import pathlib

from hypothesis import given
from hypothesis import strategies as st
import omegaconf
import pytest

from tunix_blockdiff import cli
from tunix_blockdiff import errors
from tunix_blockdiff.runs import kinds

JOBS = pathlib.Path(kinds.__file__).parents[1] / "jobs"


def _recipe(model_kind):
  return omegaconf.OmegaConf.create({"model": {"kind": model_kind}})


def test_every_verb_reference_of_every_kind_resolves():
  for name in kinds.names():
    kind = kinds.get(name)
    for verb in kinds.VERBS:
      if kind.verbs[verb] is not None:
        assert callable(kind.implementation(verb)), (name, verb)


@given(model_kind=st.sampled_from(
    ["tiny_qwen3", "qwen3_hf", "tiny_gemma3", "llama3_hf", "anything"]))
def test_recipes_of_the_tunix_families_are_block_diffusion(model_kind):
  assert kinds.of_recipe(_recipe(model_kind)).name == "block_diffusion"


@pytest.mark.parametrize("model_kind",
                         ["tiny_diffusion_gemma", "diffusion_gemma_hf"])
def test_diffusion_gemma_recipes_are_its_kind(model_kind):
  assert kinds.of_recipe(_recipe(model_kind)).name == "diffusion_gemma"


def test_a_recipe_without_a_model_is_the_default_kind():
  assert kinds.of_recipe(omegaconf.OmegaConf.create({})).name == (
      kinds.DEFAULT)


def test_generate_args_of_a_diffusion_gemma_hf_dir(tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": "diffusion_gemma"}')
  assert kinds.of_generate_args([str(tmp_path)]).name == "diffusion_gemma"
  (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
  assert kinds.of_generate_args([str(tmp_path)]).name == "block_diffusion"
  assert kinds.of_generate_args(["prompts=x"]).name == "block_diffusion"


def test_a_verb_a_kind_does_not_take_is_a_one_line_usage_error():
  with pytest.raises(errors.UsageError, match=(
      "export does not take a DiffusionGemma run .diffusion_gemma.; it"
      " takes: block_diffusion")):
    kinds.get("diffusion_gemma").implementation("export")


def test_export_of_a_diffusion_gemma_run_is_refused_by_the_cli(
    tmp_path, capsys):
  run = tmp_path / "dg_run"
  run.mkdir()
  (run / "recipe.yaml").write_text("model:\n  kind: tiny_diffusion_gemma\n")
  assert cli.main(["export", str(run), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "export does not take" in err, err
  assert not (tmp_path / "out").exists()


def test_bad_registrations_are_refused():
  with pytest.raises(ValueError, match="already registered"):
    kinds.register(kinds.get("diffusion_gemma"))
  with pytest.raises(TypeError, match="ModelKind"):
    kinds.register("diffusion_gemma")
  with pytest.raises(ValueError, match="must say"):
    kinds.ModelKind("x", "x", None, None, None, verbs={"sft": None})
  with pytest.raises(ValueError, match="not verbs"):
    kinds.ModelKind("x", "x", None, None, None,
                    verbs={v: None for v in (*kinds.VERBS, "train")})
  with pytest.raises(ValueError, match="kind must be one of"):
    kinds.get("difusion_gemma")
  with pytest.raises(ValueError, match="verb must be one of"):
    kinds.get("block_diffusion").implementation("train")


VERB_MODULES = ("sft.py", "rl.py", "opd.py", "generate.py", "export.py",
                "distill_diffusion.py", "distill_data.py", "launch.py",
                "bench.py")


@pytest.mark.parametrize("name", VERB_MODULES)
def test_verb_modules_import_no_diffusion_gemma_module(name):
  tree = ast.parse((JOBS / name).read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      imported = [node.module or ""] + [a.name for a in node.names]
    elif isinstance(node, ast.Import):
      imported = [a.name for a in node.names]
    else:
      continue
    assert not any("diffusion_gemma" in m for m in imported), (name, imported)
