"""README.md and docs/*.md cannot drift from the CLI and the recipes.

Every `tunix-blockdiff ...` command line they show (in code blocks, with
`\\` continuations joined, or in inline code) must parse: the subcommand
exists, `sft`/`rl`/`opd` overrides load against their recipe with the
sections the jobs check (`dataset`, `distributed`, `mesh`), `generate`
options are known, `export` and `launch` arguments parse (and so does the
command after `--`), `bench` names a script in `benchmarks/`. Every recipe key they name
(`training.max_steps`, `dataset.fields.prompt=...`, the keys of YAML
blocks) must exist in a bundled recipe or in the schema of a section the
recipes leave null. Upper-case words (`RUN_DIR`, `NAME`) and `[...]` are
placeholders. Every `tunix_blockdiff` import they show resolves, and every
test file they cite exists (the changelog, a record of past layouts,
aside). Nothing runs: parsing and imports only.
"""

import importlib
import pathlib
import re
import shlex

import omegaconf
import pytest
import yaml

from tunix_blockdiff import cli
from tunix_blockdiff import distributed
from tunix_blockdiff.jobs import bench
from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import export
from tunix_blockdiff.jobs import generate
from tunix_blockdiff.jobs import launch
from tunix_blockdiff.runs import prompt_files
from tunix_blockdiff.runs import sft_data

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_RECIPE = {"sft": "tiny.yaml", "rl": "rl_tiny.yaml", "opd": "opd_tiny.yaml"}
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}
# Keys the docs show on purpose as mistakes (the "did you mean" example).
DELIBERATE_MISTAKES = {"training.max_step"}
FILE_SUFFIXES = (".png", ".json", ".jsonl", ".yaml", ".py", ".md", ".parquet",
                 ".safetensors")
KEY = re.compile(r"^([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?:=(.*)|: (.*))?$")
_MISSING = object()


def _recipes() -> dict[str, omegaconf.DictConfig]:
  return {
      p.name: omegaconf.OmegaConf.load(p)
      for p in sorted(common.RECIPES_DIR.glob("*.yaml"))
  }


RECIPES = _recipes()
SECTIONS = {key for cfg in RECIPES.values() for key in cfg}
# Sections the recipes leave null, and what they may hold.
NULL_SECTIONS = {
    "dataset": set(prompt_files.DATASET_KEYS) | set(sft_data.DATASET_DEFAULTS),
    "distributed": set(distributed.DISTRIBUTED_KEYS),
    "mesh": set(distributed.MESH_AXES),
}
FIELDS = set(prompt_files.FIELD_KEYS) | set(sft_data.DATASET_DEFAULTS["fields"])


def _split_fenced(text: str) -> tuple[list[tuple[str, str]], str]:
  """([(language, body)] of fenced blocks, the text outside them)."""
  blocks, outside, language, body = [], [], None, []
  for line in text.splitlines():
    if line.startswith("```"):
      if language is None:
        language, body = line[3:].strip() or "text", []
      else:
        blocks.append((language, "\n".join(body)))
        language = None
      continue
    (body if language is not None else outside).append(line)
  return blocks, "\n".join(outside)


def _inline_spans(text: str) -> list[str]:
  return [
      " ".join(s.split()) for s in re.findall(r"`([^`]+)`", text, re.DOTALL)
  ]


def _command_lines(text: str) -> list[str]:
  """Every shell line or inline span that mentions `tunix-blockdiff`."""
  blocks, outside = _split_fenced(text)
  lines = []
  for language, body in blocks:
    if language not in ("bash", "sh", "shell", "console", "text"):
      continue
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
      if "tunix-blockdiff " in line:
        # A commented alternative (`# or: tunix-blockdiff ...`) counts too.
        lines.append(line.lstrip().lstrip("#"))
  lines += [s for s in _inline_spans(outside) if s.startswith("tunix-blockdiff ")]
  return lines


def _tokens(line: str) -> list[str]:
  tokens = []
  for token in shlex.split(line, comments=True):
    if " " in token and "tunix-blockdiff " in token:
      tokens.extend(shlex.split(token, comments=True))  # `--command "..."`
    else:
      tokens.append(token)
  return tokens


def _invocations(line: str) -> list[list[str]]:
  """The argument lists after each `tunix-blockdiff` of a shell line."""
  tokens = _tokens(line)
  found = []
  for i, token in enumerate(tokens):
    if token != "tunix-blockdiff" or i + 1 >= len(tokens):
      continue
    if tokens[i + 1] in SHELL_OPERATORS:
      continue  # A directory named like the project (`cd tunix-blockdiff`).
    args = []
    for arg in tokens[i + 1 :]:
      if arg in SHELL_OPERATORS:
        break
      args.append(arg)
    found.append(args)
  return found


def _placeholder(arg: str) -> bool:
  return (
      arg.startswith("[")
      or arg in ("...", "...]")
      or arg.endswith("=...")
      or re.fullmatch(r"[A-Z][A-Z0-9_]*", arg) is not None
  )


def _check_recipe_sections(job: str, cfg) -> None:
  if cfg.get("dataset") is not None:
    if job == "sft":
      sft_data.dataset_settings(cfg.dataset)
    else:
      prompt_files.check_dataset_section(cfg.dataset)
  if cfg.get("distributed") is not None:
    unknown = set(common.to_dict(cfg.distributed)) - NULL_SECTIONS["distributed"]
    assert not unknown, f"unknown distributed keys {sorted(unknown)}"
  if cfg.get("mesh") is not None:
    distributed.mesh_shape(common.to_dict(cfg.mesh))


def _generate_option_sets() -> list[set[str]]:
  """Options of `generate` per kind of run (block diffusion first)."""
  sets = [set(generate.DEFAULTS)]
  try:
    from tunix_blockdiff.kinds.diffusion_gemma import sft as diffusion_gemma  # pylint: disable=g-import-not-at-top
  except ImportError:
    return sets
  return sets + [set(getattr(diffusion_gemma, "DEFAULTS", {}))]


def check_invocation(args: list[str]) -> None:
  """Raises (or fails) when `tunix-blockdiff *args` would not parse."""
  assert args, "a bare `tunix-blockdiff`"
  command, rest = args[0], [a for a in args[1:] if not _placeholder(a)]
  if _placeholder(command):
    return
  if command in ("-h", "--help"):  # the usage, as cli.main prints it
    assert not rest, f"{command} takes no arguments, got {rest}"
    return
  assert command in cli.COMMANDS, f"unknown command {command!r}"
  if command in DEFAULT_RECIPE:
    cfg = common.load_recipe(rest, DEFAULT_RECIPE[command])
    _check_recipe_sections(command, cfg)
  elif command == "generate":
    # The run directory is the first argument (a path or a placeholder).
    options = args[2:] if len(args) > 1 and "=" not in args[1] else args[1:]
    options = [a for a in options if not _placeholder(a)]
    keys = {a.split("=", 1)[0] for a in options}
    # A DiffusionGemma run or checkpoint takes its own generate options.
    if not any(keys <= known for known in _generate_option_sets()[1:]):
      generate.parse_options(options)
  elif command == "export":
    export.parse_args(args[1:])
  elif command == "launch" and rest:  # Bare (or `...`): prints its usage.
    parsed = launch.parse_args(args[1:])
    check_invocation(parsed.command[1:] if parsed.command[0] == "--" else
                     parsed.command)
  elif command == "distill-data" and rest:  # Bare: prints its usage.
    from tunix_blockdiff.jobs import distill_data  # pylint: disable=g-import-not-at-top

    distill_data.parse_args(args[1:])
  elif command == "bench":
    name = args[1] if len(args) > 1 else "NAME"
    assert _placeholder(name) or name in bench.available(), (
        f"no benchmarks/{name}.py"
    )


def _python_name(path: str) -> bool:
  """Whether `a.b.c` names a tunix_blockdiff module or attribute."""
  parts = path.split(".")
  for split in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module("tunix_blockdiff." + ".".join(parts[:split]))
    except ImportError:
      continue
    try:
      for attribute in parts[split:]:
        obj = getattr(obj, attribute)
    except AttributeError:
      return False
    return True
  return False


def recipe_key_exists(path: str) -> bool:
  parts = path.split(".")
  for cfg in RECIPES.values():
    node = cfg
    for i, part in enumerate(parts):
      value = node.get(part, _MISSING) if isinstance(
          node, omegaconf.DictConfig) else _MISSING
      if value is _MISSING:
        # An empty mapping in the recipe is open (`task.kwargs`).
        if isinstance(node, omegaconf.DictConfig) and not node and i:
          return True
        break
      if value is None and i == 0 and part in NULL_SECTIONS:
        return _null_section_key(parts)
      if i == len(parts) - 1:
        return True
      node = value
  return parts[0] in NULL_SECTIONS and _null_section_key(parts)


def _null_section_key(parts: list[str]) -> bool:
  section, rest = parts[0], parts[1:]
  if not rest or rest[0] not in NULL_SECTIONS[section]:
    return False
  if section == "dataset" and rest[0] == "fields" and len(rest) > 1:
    return len(rest) == 2 and rest[1] in FIELDS
  return len(rest) == 1


def _mentioned_keys(text: str) -> list[str]:
  """Dotted recipe keys of inline code and of YAML blocks."""
  blocks, outside = _split_fenced(text)
  keys = []
  for span in _inline_spans(outside):
    match = KEY.match(span)
    if span.endswith(FILE_SUFFIXES):
      continue
    if match and span.split(".")[0] in SECTIONS | set(NULL_SECTIONS):
      if not _python_name(match.group(1)):
        keys.append(match.group(1))
  for language, body in blocks:
    if language in ("yaml", "yml"):
      keys.extend(_flatten(yaml.safe_load(body) or {}))
  return keys


def _flatten(tree, prefix=""):
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) and value:
      yield from _flatten(value, name + ".")
    else:
      yield name


def _all(collect):
  found = []
  for page in PAGES:
    for item in collect(page.read_text()):
      found.append((page.relative_to(ROOT).as_posix(), item))
  return found


COMMAND_LINES = _all(_command_lines)
RECIPE_KEYS = _all(_mentioned_keys)


def test_the_docs_show_commands_and_keys():
  # The collectors find something on every page that has commands at all.
  assert len(COMMAND_LINES) > 30 and len(RECIPE_KEYS) > 30
  pages = {page for page, _ in COMMAND_LINES}
  assert {"README.md", "docs/many_hosts.md", "docs/sft_data.md"} <= pages


@pytest.mark.parametrize(
    "page, line", COMMAND_LINES, ids=[f"{p}:{l[:60]}" for p, l in COMMAND_LINES]
)
def test_every_command_line_parses(page, line, monkeypatch):
  monkeypatch.chdir(ROOT)  # `recipes/qwen3_0p6b.yaml` is relative to it
  invocations = _invocations(line)
  assert invocations, f"{page}: no invocation in {line!r}"
  for args in invocations:
    try:
      check_invocation(args)
    except SystemExit as e:  # argparse
      pytest.fail(f"{page}: {line!r}: launch arguments do not parse ({e})")


@pytest.mark.parametrize(
    "page, key", RECIPE_KEYS, ids=[f"{p}:{k}" for p, k in RECIPE_KEYS]
)
def test_every_recipe_key_exists(page, key):
  if key in DELIBERATE_MISTAKES:
    assert not recipe_key_exists(key), f"{key} is no longer a mistake"
  else:
    assert recipe_key_exists(key), f"{page}: {key} is in no recipe"


def test_the_checks_catch_drift():
  """Each check fails on what it must refuse (so the tests above can fail)."""
  for args in (
      ["exprot", "RUN", "OUT"],                      # no such command
      ["sft", "training.max_stepz=3"],               # unknown key
      ["rl", "dataset.train=x.jsonl", "dataset.formats=parquet"],
      ["generate", "RUN_DIR", "thresold=0.5"],
      ["sft", "mesh.dp=2"],
      ["bench", "no_such_benchmark"],
      ["distill-data", "HF_DIR", "P.jsonl", "OUT.jsonl", "--top-k", "3"],
  ):
    with pytest.raises((AssertionError, ValueError)):
      check_invocation(args)
  with pytest.raises(ValueError, match="--processes"):
    check_invocation(["launch", "--procs", "2", "--", "sft"])
  assert recipe_key_exists("dataset.fields.prompt")
  assert recipe_key_exists("task.kwargs.max_digits")
  assert recipe_key_exists("distributed.process_id")
  for key in ("dataset.field.prompt", "training.max_step", "mesh.dp",
              "distributed.rank"):
    assert not recipe_key_exists(key), key
  assert _python_name("distributed.call_sharded")
  assert not _python_name("data.seq_len")
  assert _invocations(
      'gcloud ssh --command "cd tunix-blockdiff && tunix-blockdiff sft a=1"'
  ) == [["sft", "a=1"]]


# The changelog records past layouts and names modules as they were then.
CURRENT_PAGES = [p for p in PAGES if p.name != "changelog.md"]
IMPORT = re.compile(
    r"^\s*from (tunix_blockdiff[\w.]*) import ([\w, ]+?)(?: as \w+)?\s*$"
    r"|^\s*import (tunix_blockdiff[\w.]*)", re.M)
TEST_FILE = re.compile(r"\btests/[\w/]+\.py\b")


def import_problem(line: str) -> str | None:
  """Why a docs line `from tunix_blockdiff.x import y` fails, or None."""
  match = IMPORT.match(line)
  if match is None:
    return None
  if match.group(3):
    module, names = match.group(3), []
  else:
    module, names = match.group(1), [
        n.strip() for n in match.group(2).split(",") if n.strip()]
  try:
    imported = importlib.import_module(module)
  except ImportError as e:
    return f"{module}: {e}"
  for name in names:
    if not hasattr(imported, name):
      try:
        importlib.import_module(f"{module}.{name}")
      except ImportError:
        return f"{module} has no {name}"
  return None


def _imports(text: str) -> list[str]:
  return [m.group(0).strip() for m in IMPORT.finditer(text)]


DOC_IMPORTS = [(page.relative_to(ROOT).as_posix(), line)
               for page in CURRENT_PAGES for line in _imports(page.read_text())]


def test_the_docs_show_imports():
  assert len(DOC_IMPORTS) > 10


@pytest.mark.parametrize(
    "page, line", DOC_IMPORTS, ids=[f"{p}:{l[:60]}" for p, l in DOC_IMPORTS]
)
def test_every_import_shown_resolves(page, line):
  assert import_problem(line) is None, f"{page}: {import_problem(line)}"


def test_every_cited_test_file_exists():
  missing = sorted(
      (page.relative_to(ROOT).as_posix(), path)
      for page in CURRENT_PAGES
      for path in set(TEST_FILE.findall(page.read_text()))
      if not (ROOT / path).is_file())
  assert not missing, missing


def test_the_import_check_catches_moved_modules():
  assert import_problem(
      "from tunix_blockdiff.rl import diffusion_gemma_cluster") is not None
  assert import_problem("from tunix_blockdiff.nowhere import x") is not None
  assert import_problem(
      "from tunix_blockdiff.kinds.diffusion_gemma import cluster") is None
  assert import_problem("import tunix_blockdiff") is None
