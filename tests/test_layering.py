"""The package-level import arrows of `tunix_blockdiff` form a DAG.

A unit is a subpackage (`attention`, `models`, ...) or a top-level module
(`config`, `trainer`, ...). Every `import` / `from ... import` of a
`tunix_blockdiff` module in a unit's files is an arrow to the unit it names.
"""

import ast
import pathlib

import pytest

import tunix_blockdiff

PACKAGE = pathlib.Path(tunix_blockdiff.__file__).parent
# Known back-arrows, kept visible (none: the rollout engine, which scores
# with rl.likelihood, lives in rl/).
KNOWN_CYCLE_ARROWS: set[tuple[str, str]] = set()


def _unit(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _arrows() -> dict[str, dict[str, set[str]]]:
  """unit -> {imported unit -> files}."""
  arrows: dict[str, dict[str, set[str]]] = {}
  for path in PACKAGE.rglob("*.py"):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    module = ".".join(rel.parts).removesuffix(".__init__")
    source = _unit(module)
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module:
        if node.level == 0 and node.module == "tunix_blockdiff":
          names = [f"tunix_blockdiff.{a.name}" for a in node.names]
        elif node.level == 0 and node.module.startswith("tunix_blockdiff."):
          names = [node.module]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names
                 if a.name.startswith("tunix_blockdiff.")]
      for name in names:
        target = _unit(name)
        if target != source:
          arrows.setdefault(source, {}).setdefault(target, set()).add(
              str(path.relative_to(PACKAGE)))
  return arrows


def test_attention_imports_no_model_code():
  arrows = _arrows()
  assert set(arrows.get("attention", {})) <= {"arrays", "config", "errors"}, (
      arrows["attention"])


def test_modeling_is_gone_from_attention_and_lives_in_models():
  for path in (PACKAGE / "attention").glob("*.py"):
    assert "modeling" not in path.read_text(), path
  assert (PACKAGE / "models" / "logits.py").exists()
  assert (PACKAGE / "models" / "flash.py").exists()


def test_package_arrows_form_a_dag():
  arrows = _arrows()
  graph = {
      source: {t for t in targets if (source, t) not in KNOWN_CYCLE_ARROWS}
      for source, targets in arrows.items()
  }
  state: dict[str, str] = {}

  def visit(unit, stack):
    state[unit] = "open"
    for target in sorted(graph.get(unit, ())):
      if state.get(target) == "open":
        cycle = stack[stack.index(target):] + [target]
        files = {
            f"{a}->{b}": sorted(arrows[a][b])
            for a, b in zip(cycle, cycle[1:])
        }
        pytest.fail(f"import cycle {' -> '.join(cycle)}: {files}")
      if target not in state:
        visit(target, stack + [target])
    state[unit] = "done"

  for unit in sorted(graph):
    if unit not in state:
      visit(unit, [unit])


def test_diffusion_gemma_lives_in_its_kind_package():
  """Besides its model code (`models/diffusion_gemma/`), every module of the
  DiffusionGemma kind is in `kinds/diffusion_gemma/`."""
  outside = [
      str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
      if ("diffusion_gemma" in p.name or "entropy_bound" in p.name)
      and p.parent.name != "diffusion_gemma"
  ]
  assert not outside, outside


def test_no_unit_imports_a_kind_package():
  """Kinds sit above the shared layers: jobs reach them only through the
  `runs.kinds` registry's module references, never by an import."""
  arrows = _arrows()
  importers = {source: sorted(targets["kinds"])
               for source, targets in arrows.items()
               if source != "kinds" and "kinds" in targets}
  assert not importers, importers


def test_jobs_and_kinds_share_runs_and_import_neither_each_other():
  """`jobs` (the verbs) and `kinds` (a kind's implementations) both build on
  `runs` (what every run needs); `runs` imports neither."""
  arrows = _arrows()
  assert "kinds" not in arrows.get("jobs", {}), arrows["jobs"].get("kinds")
  assert "jobs" not in arrows.get("kinds", {}), arrows["kinds"].get("jobs")
  assert not {"jobs", "kinds"} & set(arrows.get("runs", {})), arrows["runs"]
