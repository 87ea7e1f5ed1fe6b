"""Model kinds: what every job needs from a kind of model, in one place.

The package serves two kinds: Tunix causal LMs converted to block diffusion
(`block_diffusion`, the default) and DiffusionGemma (`diffusion_gemma`).
A job never branches on a kind. It asks this registry which kind a recipe,
an rl/opd policy section or a directory belongs to, and calls that kind's
implementation of its verb:

    kinds.of_recipe(cfg).call("sft", cfg)

A `ModelKind` names, for each verb, the function that implements it as a
`"module:function"` reference, imported only when the verb runs (a kind's
code, DiffusionGemma's sampler say, costs nothing to a job of another
kind, and a verb module imports no kind's module). `None` means the kind
does not take the verb; `call` then refuses it in one line. Its
recognisers say which recipes (`model.kind`), policy sections
(`init`/`student`) and directories (`generate DIR`) are its own.

Kinds register by name, as the loss functions do (`register`); the
registry asks them in registration order and falls back on the default
kind, which recognises everything the others do not.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from tunix_blockdiff import errors

VERBS = ("sft", "rl", "opd", "generate", "distill_data", "export")


@dataclasses.dataclass(frozen=True)
class ModelKind:
  """One kind of model and where each job finds its code.

  Attributes:
    name: Registry name.
    description: One line, used in refusals.
    recipe_kinds: The recipe `model.kind` values that are this kind's.
    recognises_policy: `"module:function"`, (section) -> bool: an rl/opd
      `init`/`student` section whose checkpoint is this kind's.
    recognises_path: `"module:function"`, (argv) -> bool: `generate`'s
      arguments naming one of this kind's run or Hugging Face directories.
    verbs: verb -> `"module:function"` implementing it, or None where the
      kind does not take the verb (see `VERBS`).
    recipe_schema: `"module:name"` of the `runs.schema.Section` its sft
      recipes are validated against (`runs.job_schemas.check_recipe`).
  """

  name: str
  description: str
  recipe_kinds: tuple[str, ...] | None
  recognises_policy: str | None
  recognises_path: str | None
  verbs: dict[str, str | None]
  recipe_schema: str = "tunix_blockdiff.runs.sections:SFT"

  def __post_init__(self):
    unknown = set(self.verbs) - set(VERBS)
    if unknown:
      raise ValueError(
          f"verbs: {sorted(unknown)} are not verbs; use {list(VERBS)}")
    missing = set(VERBS) - set(self.verbs)
    if missing:
      raise ValueError(
          f"verbs: {self.name} must say (a reference or None) for"
          f" {sorted(missing)}")

  def implementation(self, verb: str) -> Callable[..., Any]:
    """The function implementing `verb`; a `UsageError` if it has none."""
    if verb not in VERBS:
      raise ValueError(f"verb must be one of {list(VERBS)}, got {verb!r}")
    ref = self.verbs[verb]
    if ref is None:
      takers = [k.name for k in _KINDS.values() if k.verbs.get(verb)]
      raise errors.UsageError(
          f"{verb.replace('_', '-')} does not take a {self.description}"
          f" ({self.name}); it takes: {', '.join(takers)}")
    return _resolve(ref)

  def sft_schema(self):
    """The `runs.schema.Section` of this kind's sft recipes."""
    return _resolve(self.recipe_schema)

  def call(self, verb: str, *args, **kwargs):
    """Runs this kind's `verb`."""
    return self.implementation(verb)(*args, **kwargs)


def _resolve(ref: str) -> Callable[..., Any]:
  module, _, name = ref.partition(":")
  return getattr(importlib.import_module(module), name)


_KINDS: dict[str, ModelKind] = {}
DEFAULT = "block_diffusion"


def register(kind: ModelKind) -> ModelKind:
  """Adds `kind` under its name; a name is registered once."""
  if not isinstance(kind, ModelKind):
    raise TypeError(f"kind must be a ModelKind, got {type(kind).__name__}")
  if kind.name in _KINDS:
    raise ValueError(f"kind {kind.name!r} is already registered")
  _KINDS[kind.name] = kind
  return kind


def get(name: str) -> ModelKind:
  """The kind registered as `name`."""
  if name not in _KINDS:
    raise ValueError(
        f"kind must be one of {sorted(_KINDS)}, got {name!r}"
        f"{errors.nearest(name, _KINDS)}")
  return _KINDS[name]


def names() -> list[str]:
  return list(_KINDS)


def _first(test: Callable[[ModelKind], bool]) -> ModelKind:
  for kind in _KINDS.values():
    if kind.name != DEFAULT and test(kind):
      return kind
  return _KINDS[DEFAULT]


def of_recipe(cfg) -> ModelKind:
  """The kind of a recipe, by its `model.kind`."""
  model = cfg.get("model") if cfg is not None else None
  model_kind = model.get("kind") if model is not None else None
  return _first(lambda k: model_kind in (k.recipe_kinds or ()))


def of_policy(section) -> ModelKind:
  """The kind of an rl `init` or opd `student` section's checkpoint."""
  return _first(lambda k: k.recognises_policy is not None
                and _resolve(k.recognises_policy)(section))


def of_generate_args(argv) -> ModelKind:
  """The kind of the directory `generate argv` names."""
  return _first(lambda k: k.recognises_path is not None
                and _resolve(k.recognises_path)(argv))


_JOBS = "tunix_blockdiff.jobs"
_DG = "tunix_blockdiff.kinds.diffusion_gemma"
register(ModelKind(
    name="block_diffusion",
    description="Tunix causal LM converted to block diffusion",
    recipe_kinds=None,  # the default: every other model.kind
    recognises_policy=None,
    recognises_path=None,
    verbs={
        "sft": f"{_JOBS}.sft:run_block_diffusion",
        "rl": f"{_JOBS}.rl:run_block_diffusion",
        "opd": f"{_JOBS}.opd:run_block_diffusion",
        "generate": f"{_JOBS}.generate:main_block_diffusion",
        "distill_data": f"{_JOBS}.distill_diffusion:source_block_diffusion",
        "export": f"{_JOBS}.export:run_block_diffusion",
    },
))
register(ModelKind(
    name="diffusion_gemma",
    description="DiffusionGemma run",
    recipe_kinds=("tiny_diffusion_gemma", "diffusion_gemma_hf"),
    recognises_policy=f"{_DG}.rl:is_policy",
    recognises_path=f"{_DG}.sft:handles_generate",
    verbs={
        "sft": f"{_DG}.sft:run_sft",
        "rl": f"{_DG}.rl:run",
        "opd": f"{_DG}.opd:run",
        "generate": f"{_DG}.generate:generate_main",
        "distill_data": None,
        "export": None,
    },
    recipe_schema=f"{_DG}.recipe_schema:SFT",
))
