"""Python source as a corpus (for `convert_code.py`): the stdlib by default.

Any source tree of Python files works the same way (`--corpus DIR`, e.g. an
installed package's directory).

Files are grouped by top-level module (`json/decoder.py` belongs to `json`);
a seeded split by module sends whole modules to evaluation, so nothing of an
evaluation module is seen by the tokenizer, pretraining or fine-tuning.
Fine-tuning rows are functions with a docstring: prompt = the signature and
docstring, completion = the body, cut at a line boundary to a token budget.
"""

from __future__ import annotations

import ast
import json
import pathlib
import sysconfig
import textwrap
from typing import Iterable, Iterator, Sequence

import numpy as np

# Directories never read: tests (code about code), installed packages, caches.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__"}
)
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")


def stdlib_root() -> pathlib.Path:
  """The running Python's standard library directory (`sysconfig`)."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_name(root: str | pathlib.Path | None = None) -> str:
  """What to call the corpus in titles: `stdlib`, or the root's own name."""
  if root is None:
    return "stdlib"
  root = pathlib.Path(root).expanduser().resolve()
  return "stdlib" if root == stdlib_root().resolve() else (root.name or str(root))


def modules(root: pathlib.Path | None = None) -> dict[str, list[pathlib.Path]]:
  """Top-level module name -> its `*.py` files (sorted), tests skipped."""
  root = pathlib.Path(root) if root is not None else stdlib_root()
  if not root.is_dir():
    raise FileNotFoundError(f"corpus directory {root} not found")
  grouped: dict[str, list[pathlib.Path]] = {}
  for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root).parts
    if any(part in SKIP_DIRS for part in parts[:-1]):
      continue
    if parts[-1].startswith("test_"):
      continue
    grouped.setdefault(parts[0].removesuffix(".py"), []).append(path)
  return grouped


def split_modules(
    names: Iterable[str], *, eval_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
  """A seeded (train, eval) split of module names; each is sorted.

  Args:
    names: Module names.
    eval_fraction: Fraction of modules held out, in (0, 1).
    seed: Seed of the permutation.

  Returns:
    (train modules, eval modules), disjoint, both non-empty.
  """
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
  names = sorted(set(names))
  if len(names) < 2:
    raise ValueError(f"need at least 2 modules to split, got {len(names)}")
  order = np.random.default_rng(seed).permutation(len(names))
  num_eval = min(max(1, round(eval_fraction * len(names))), len(names) - 1)
  held = {names[i] for i in order[:num_eval]}
  return [n for n in names if n not in held], sorted(held)


def read_text(path: pathlib.Path) -> str | None:
  """A file's text, or None if it is not UTF-8."""
  try:
    return path.read_text(encoding="utf-8")
  except (UnicodeDecodeError, OSError):
    return None


def train_tokenizer(
    texts: Iterable[str], out_dir: pathlib.Path, *, vocab_size: int
):
  """Trains a byte-level BPE on `texts`; saves and returns a HF tokenizer.

  The directory gets `tokenizer.json`, `tokenizer_config.json` and
  `special_tokens_map.json`, so `transformers.AutoTokenizer` (and
  `checkpoints.HFTokenizer`) load it. Special tokens get ids 0-3: `<pad>`,
  `<bos>`, `<eos>`, `<mask>`.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  if vocab_size <= 256 + len(SPECIAL_TOKENS):
    raise ValueError(
        f"vocab_size must exceed 260 bytes+specials, got {vocab_size}"
    )
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False
  )
  bpe.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  bpe.train_from_iterator(texts, trainer=trainer)
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe,
      pad_token="<pad>",
      bos_token="<bos>",
      eos_token="<eos>",
      mask_token="<mask>",
      clean_up_tokenization_spaces=False,
  )
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  tokenizer.save_pretrained(str(out_dir))
  return tokenizer


def _functions(source: str) -> Iterator[ast.FunctionDef]:
  """Every (async) function of `source`, breadth first; none if unparsable."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node


def _first_line(node: ast.FunctionDef) -> int:
  """The 0-based line where `node` starts, its decorators included."""
  return min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1


def function_pairs(source: str) -> Iterator[tuple[str, str]]:
  """(signature + docstring, body) of every documented function in `source`.

  Both are dedented to the `def`'s column; the prompt ends with a newline
  after the docstring, the completion holds the remaining body lines.
  Functions whose body is only the docstring are skipped.
  """
  lines = source.splitlines(keepends=True)
  for node in _functions(source):
    if ast.get_docstring(node) is None or len(node.body) < 2:
      continue
    start = _first_line(node)
    doc_end = node.body[0].end_lineno
    body_start = node.body[1].lineno - 1
    # Comments between the docstring and the first statement stay in body.
    prompt = textwrap.dedent("".join(lines[start:doc_end]))
    indent = node.col_offset
    body = "".join(
        _dedent_line(line, indent) for line in lines[doc_end : node.end_lineno]
    )
    if body.strip() and body_start >= doc_end:
      yield prompt, body


def function_prefixes(source: str) -> Iterator[str]:
  """Prefixes of every function in `source`, cut at its body's statements.

  For each function (documented or not) whose body has a statement besides
  a docstring: its header (decorators, signature and docstring, if any),
  then the header with the body's first 1, 2, ... top-level statements, up
  to all but the last. Each is dedented to the `def`'s column and ends with
  a newline: a prompt whose continuation is the rest of the function.
  """
  lines = source.splitlines(keepends=True)
  for node in _functions(source):
    body = node.body
    if ast.get_docstring(node) is not None:
      if len(body) < 2:
        continue
      cuts = [stmt.end_lineno for stmt in body[:-1]]
    else:
      cuts = [body[0].lineno - 1] + [stmt.end_lineno for stmt in body[:-1]]
    start = _first_line(node)
    for end in cuts:
      if end <= start:
        continue  # a one-line `def f(): return x`: no header line of its own
      yield "".join(
          _dedent_line(line, node.col_offset) for line in lines[start:end]
      )


def _dedent_line(line: str, indent: int) -> str:
  """`line` without the first `indent` columns (they must be blank)."""
  if not line.strip():
    return "\n"
  if line[:indent].strip():
    return line.lstrip()
  return line[indent:]


def budget_lines(text: str, tokenizer, budget: int) -> str | None:
  """The longest prefix of whole lines of `text` within `budget` tokens.

  None when even the first line is over budget.
  """
  kept, used = [], 0
  for line in text.splitlines(keepends=True):
    cost = len(tokenizer.encode(line))
    if used + cost > budget:
      break
    kept.append(line)
    used += cost
  return "".join(kept) if kept else None


def sft_rows(
    files: Sequence[pathlib.Path],
    tokenizer,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    max_rows: int | None,
    seed: int,
) -> list[dict[str, str]]:
  """`{"prompt", "completion", "source"}` rows from the functions of `files`.

  Prompts longer than `prompt_tokens` are skipped (a cut docstring would
  lose the signature or the description); completions keep whole lines up to
  `completion_tokens`. With `max_rows`, a seeded sample of that many rows.
  """
  rows = []
  for path in files:
    text = read_text(path)
    if text is None:
      continue
    for prompt, body in function_pairs(text):
      if len(tokenizer.encode(prompt)) > prompt_tokens:
        continue
      completion = budget_lines(body, tokenizer, completion_tokens)
      if completion is None or not completion.strip():
        continue
      rows.append(
          {"prompt": prompt, "completion": completion, "source": path.name}
      )
  if max_rows is not None and len(rows) > max_rows:
    keep = np.sort(
        np.random.default_rng(seed).permutation(len(rows))[:max_rows]
    )
    rows = [rows[i] for i in keep]
  return rows


def distill_prompts(
    files: Sequence[pathlib.Path],
    tokenizer,
    *,
    base: Sequence[str],
    prompt_tokens: int,
    num_prompts: int,
    seed: int,
) -> list[dict[str, str]]:
  """`{"prompt"}` rows for sequence-level distillation from `files`.

  Every prompt of `base` (the SFT rows' prompts) first, in order, then a
  seeded sample of the other `function_prefixes` of `files` within
  `prompt_tokens` (duplicates dropped) up to `num_prompts` in all. The
  teacher completes each one, so the student sees the teacher continue a
  function from its header and from inside its body: many more rows than
  the documented functions alone, from the same training modules.
  """
  if num_prompts < len(base):
    raise ValueError(
        f"num_prompts ({num_prompts}) must be >= the {len(base)} base prompts"
    )
  seen = set(base)
  extra = []
  for path in files:
    text = read_text(path)
    if text is None:
      continue
    for prompt in function_prefixes(text):
      if prompt in seen or len(tokenizer.encode(prompt)) > prompt_tokens:
        continue
      seen.add(prompt)
      extra.append(prompt)
  order = np.random.default_rng(seed).permutation(len(extra))
  picked = [extra[i] for i in order[: num_prompts - len(base)]]
  return [{"prompt": p} for p in [*base, *picked]]


def write_jsonl(rows: Iterable[dict], path: pathlib.Path) -> pathlib.Path:
  path = pathlib.Path(path)
  with path.open("w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return path


def read_jsonl(path: pathlib.Path) -> list[dict]:
  with pathlib.Path(path).open(encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
