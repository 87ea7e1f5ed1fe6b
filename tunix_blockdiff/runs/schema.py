"""One validation pass over a job's resolved recipe, before any compute.

A schema says, for every key a job reads, its type, range, allowed values
and whether null is allowed, plus the rules between keys (cross-key rules:
a threshold against another, a path against a model kind, a section
against a dataclass's own checks). `validate` walks the whole resolved
recipe once and raises a one-line `UsageError` naming the key, the value
given and the rule, so a mistyped key in a long recipe costs seconds, not a
compile.

The sections themselves live beside what they configure: the shared and
block-diffusion ones in `runs.sections`, the rl/opd ones in
`runs.rl_sections`, DiffusionGemma's in its kind's package.

    schema.integer(1)                       # an int >= 1
    schema.number(0, 1, low_open=True)      # a number in (0, 1]
    schema.choice("single", "two_stream")
    schema.section({"rank": schema.integer(1)}, null=True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from tunix_blockdiff import errors

# A cross-key rule: (the section's plain-Python values, the section's dotted
# name) -> None; it raises `UsageError` (see `refuse`).
Rule = Callable[[Mapping[str, Any], str], None]


def show(value: Any) -> str:
  """A value as a recipe writes it (`null`, `true`, `3`, `'x'`)."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  return repr(value)


def refuse(key: str, value: Any, rule: str) -> errors.UsageError:
  """The one-line error of `key=value` breaking `rule` (to raise)."""
  return errors.UsageError(f"{key}={show(value)} is not valid: {key} {rule}")


@dataclasses.dataclass(frozen=True)
class Key:
  """One leaf key: its type (`int|float|bool|str|list|dict|any`) and rule.

  Attributes:
    kind: The value's type; `float` accepts ints, `dict` any mapping.
    low: Smallest allowed number (or list length), None: none.
    high: Largest allowed number, None: none.
    low_open: `low` itself is excluded.
    high_open: `high` itself is excluded.
    choices: The allowed values (strings), None: any of `kind`.
    null: Whether null is allowed.
    item: For lists, each item's `Key`.
    required: Whether the key must be present.
  """

  kind: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[Any, ...] | None = None
  null: bool = False
  item: Key | None = None
  required: bool = False

  def rule(self) -> str:
    """`must be ...`: what the key allows, in words."""
    if self.choices is not None:
      words = f"one of {list(self.choices)}"
    else:
      words = _WORDS[self.kind] + self._range()
    return f"must be {words}" + (" or null" if self.null else "")

  def _range(self) -> str:
    if self.kind == "list":
      return f" of at least {int(self.low)} items" if self.low else ""
    if self.low is not None and self.high is not None:
      return (f" in {'(' if self.low_open else '['}{self.low:g},"
              f" {self.high:g}{')' if self.high_open else ']'}")
    if self.low is not None:
      return f" {'>' if self.low_open else '>='} {self.low:g}"
    if self.high is not None:
      return f" {'<' if self.high_open else '<='} {self.high:g}"
    return ""

  def check(self, key: str, value: Any) -> None:
    """Raises `UsageError` unless `value` is allowed at `key`."""
    if value is None:
      if not self.null:
        raise refuse(key, value, self.rule())
      return
    if not _is(self.kind, value):
      raise refuse(key, value, self.rule())
    if self.choices is not None and value not in self.choices:
      raise errors.UsageError(
          f"{key}={show(value)} is not valid: {key} {self.rule()}"
          + errors.nearest(str(value), [str(c) for c in self.choices]))
    if self.kind == "list":
      if self.low is not None and len(value) < self.low:
        raise refuse(key, value, self.rule())
      if self.item is not None:
        for i, item in enumerate(value):
          self.item.check(f"{key}[{i}]", item)
      return
    if self.kind in ("int", "float") and not self._in_range(value):
      raise refuse(key, value, self.rule())

  def _in_range(self, value) -> bool:
    if not math.isfinite(value):
      return False
    if self.low is not None and (
        value < self.low or (self.low_open and value == self.low)):
      return False
    return self.high is None or not (
        value > self.high or (self.high_open and value == self.high))


_WORDS = {
    "int": "an int",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "list": "a list",
    "dict": "a mapping {key: value}",
    "any": "a value",
}


def _is(kind: str, value: Any) -> bool:
  if kind == "any":
    return True
  if isinstance(value, bool):
    return kind == "bool"
  return {
      "int": lambda: isinstance(value, int),
      "float": lambda: isinstance(value, (int, float)),
      "bool": lambda: False,
      "str": lambda: isinstance(value, str),
      "list": lambda: isinstance(value, (list, tuple)),
      "dict": lambda: isinstance(value, Mapping),
  }[kind]()


@dataclasses.dataclass(frozen=True)
class Section:
  """A mapping of keys (`Key`s or nested `Section`s) and its cross-key rules.

  Attributes:
    keys: name -> `Key` or `Section`.
    rules: Cross-key rules, run after every key of the section passed.
    null: Whether the whole section may be null.
    required: Whether the section must be present.
    open: Whether keys beyond `keys` are allowed (free-form mappings).
  """

  keys: Mapping[str, Key | Section]
  rules: tuple[Rule, ...] = ()
  null: bool = False
  required: bool = False
  open: bool = False

  def check(self, key: str, value: Any) -> None:
    if value is None:
      if not self.null:
        raise refuse(key or "recipe", value, "must be a section {key: value}")
      return
    if not isinstance(value, Mapping):
      raise refuse(key or "recipe", value,
                   "must be a section {key: value}"
                   + (" or null" if self.null else ""))
    prefix = f"{key}." if key else ""
    if not self.open:
      for name in value:
        if name not in self.keys:
          known = [f"{prefix}{k}" for k in self.keys]
          raise errors.UsageError(
              f"unknown recipe key {prefix + str(name)!r}"
              + errors.nearest(f"{prefix}{name}", known)
              + f"; {key or 'the recipe'} takes {sorted(self.keys)}")
    for name, spec in self.keys.items():
      if name in value:
        spec.check(f"{prefix}{name}", value[name])
    for name, spec in self.keys.items():
      if name not in value and spec.required:
        raise errors.UsageError(
            f"recipe key {prefix}{name} is missing: it {spec.rule()}"
            if isinstance(spec, Key) else
            f"recipe section {prefix}{name} is missing")
    for rule in self.rules:
      rule(value, key)

  def rule(self) -> str:
    return "must be a section {key: value}"


def integer(low: int | None = None, high: int | None = None, *,
            null: bool = False, required: bool = False) -> Key:
  return Key("int", low, high, null=null, required=required)


def number(low: float | None = None, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False,
           null: bool = False, required: bool = False) -> Key:
  return Key("float", low, high, low_open, high_open, null=null,
             required=required)


def probability(*, low_open: bool = False, null: bool = False,
                required: bool = False) -> Key:
  """A number in [0, 1] (`low_open`: in (0, 1])."""
  return number(0.0, 1.0, low_open=low_open, null=null, required=required)


def boolean(*, null: bool = False, required: bool = False) -> Key:
  return Key("bool", null=null, required=required)


def text(*, null: bool = False, required: bool = False) -> Key:
  return Key("str", null=null, required=required)


def choice(*options: Any, null: bool = False, required: bool = False) -> Key:
  return Key("str", choices=tuple(options), null=null, required=required)


def sequence(item: Key | None = None, *, low: int | None = None,
             null: bool = False, required: bool = False) -> Key:
  return Key("list", low, item=item, null=null, required=required)


def mapping(*, null: bool = False, required: bool = False) -> Key:
  return Key("dict", null=null, required=required)


def section(keys: Mapping[str, Key | Section], *rules: Rule,
            null: bool = False, required: bool = False,
            open: bool = False) -> Section:  # pylint: disable=redefined-builtin
  return Section(dict(keys), tuple(rules), null=null, required=required,
                 open=open)


def wrap(key: str, check: Callable[[], Any]) -> Any:
  """`check()`, its `ValueError`/`TypeError` as a `UsageError` on `key`.

  For the rules that build a section's frozen config dataclass, whose own
  `__post_init__` is the one place its checks live.
  """
  try:
    return check()
  except errors.UsageError:
    raise
  except (TypeError, ValueError) as e:
    raise errors.UsageError(
        f"recipe section {key}: {errors.one_line(e)}") from None


def parse_options(overrides: Sequence[str], defaults: Mapping[str, Any],
                  schema: Section, what: str):
  """`key=value` options over `defaults`, checked against `schema`.

  For the verbs that take options rather than a recipe (`generate`).

  Args:
    overrides: `key=value` strings (omegaconf dotlist).
    defaults: Every option's default.
    schema: The options' `Section`.
    what: The options' name in messages (`generate option`).

  Returns:
    A struct-mode `DictConfig`.

  Raises:
    UsageError: an unknown option (with the nearest known one), a value
      that does not parse, or one that breaks its rule.
  """
  import omegaconf  # pylint: disable=g-import-not-at-top
  import yaml  # pylint: disable=g-import-not-at-top

  options = omegaconf.OmegaConf.create(dict(defaults))
  omegaconf.OmegaConf.set_struct(options, True)
  try:
    merged_options = omegaconf.OmegaConf.merge(
        options, omegaconf.OmegaConf.from_dotlist(list(overrides)))
  except omegaconf.errors.ConfigKeyError as e:
    key = str(getattr(e, "full_key", "") or e)
    raise errors.UsageError(
        f"unknown {what} {key!r}" + errors.nearest(key, defaults)
        + f"; known: {sorted(defaults)}") from None
  except (omegaconf.errors.OmegaConfBaseException, yaml.YAMLError) as e:
    raise errors.UsageError(
        f"cannot parse the {what}s {list(overrides)}:"
        f" {errors.one_line(e)}") from None
  validate(omegaconf.OmegaConf.to_container(merged_options, resolve=True),
           schema)
  return merged_options


def validate(recipe: Mapping[str, Any], schema: Section) -> None:
  """Checks a whole resolved recipe (plain Python) against `schema`.

  Raises:
    UsageError: the first key that breaks its rule, an unknown key (with
      the nearest known one) or a broken cross-key rule, in one line.
  """
  schema.check("", recipe)


__all__ = [
    "Key",
    "Rule",
    "Section",
    "boolean",
    "choice",
    "integer",
    "mapping",
    "number",
    "parse_options",
    "probability",
    "refuse",
    "section",
    "sequence",
    "show",
    "text",
    "validate",
    "wrap",
]
