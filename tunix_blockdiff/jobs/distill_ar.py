"""`distill-data` from an autoregressive Hugging Face checkpoint.

The checkpoint directory is checked (config.json of a family
`models.checkpoints.load_hf` reads, *.safetensors, tokenizer files) and its
tokenizer loaded before any model is, and every prompt is completed with
Tunix's own `Sampler`. `distill_data` reads the command line and writes the
rows.
"""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

from tunix_blockdiff import errors
from tunix_blockdiff.models import hf_configs

# Any of these makes a directory hold a Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_checkpoint(path: str) -> pathlib.Path:
  """`path` as a Hugging Face model directory with a tokenizer, or raises.

  Raises:
    MissingFileError: No such directory, or no config.json, *.safetensors
      or tokenizer files in it.
    UsageError: config.json is not JSON or not of a supported family.
  """
  directory = pathlib.Path(path).expanduser()
  what = "a Hugging Face model directory (config.json, *.safetensors, tokenizer)"
  if not directory.is_dir():
    raise errors.MissingFileError(f"checkpoint {path} is not a directory: need {what}")
  if not (directory / "config.json").is_file():
    raise errors.MissingFileError(f"checkpoint {path} has no config.json: need {what}")
  if not list(directory.glob("*.safetensors")):
    raise errors.MissingFileError(
        f"checkpoint {path} has no *.safetensors files: need {what}"
    )
  if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
    raise errors.MissingFileError(
        f"checkpoint {path} has no tokenizer files (one of {_TOKENIZER_FILES})"
    )
  try:
    hf_config = json.loads((directory / "config.json").read_text())
    hf_configs.family_of(hf_config)
  except (json.JSONDecodeError, ValueError) as e:
    raise errors.UsageError(f"checkpoint {path}: {errors.one_line(e)}") from None
  return directory


def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
) -> list[list[int]]:
  """Each prompt's generated token ids, with Tunix's `Sampler`.

  One compiled program: every call has `batch_size` rows (the last batch is
  padded by repeating its last prompt) and the prompt width of the longest
  prompt. Greedy when `top_p` is None (Tunix's rule); otherwise nucleus
  sampling at `temperature`, batch i with key `fold_in(PRNGKey(seed), i)`.

  Args:
    model: A Tunix causal LM.
    tokenizer: The checkpoint's tokenizer (`encode`, `decode`, `bos_id`,
      `eos_id`, `pad_id`); the Sampler adds BOS.
    prompts: Prompt strings.
    max_new_tokens: Decoding steps.
    batch_size: Rows per call.
    temperature: Sampling temperature (> 0 when `top_p` is set).
    top_p: Nucleus threshold; None: greedy.
    seed: Sampling seed.

  Returns:
    Per prompt, the ids the Sampler returns (ending before its first EOS,
    or `max_new_tokens` long).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from tunix.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top

  config = model.config

  def make_sampler(cache_size: int):
    return sampler_lib.Sampler(
        model,
        tokenizer,
        sampler_lib.CacheConfig(
            cache_size=cache_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ),
    )

  # The prompt width as the Sampler tokenizes (BOS and all); building a
  # Sampler compiles nothing.
  probe = make_sampler(1)
  max_prompt_length = max(len(probe.tokenize(p)) for p in prompts)
  sampler = make_sampler(max_prompt_length + max_new_tokens)
  out = []
  for i, start in enumerate(range(0, len(prompts), batch_size)):
    chunk = list(prompts[start : start + batch_size])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_size - real)
    result = sampler(
        chunk,
        max_generation_steps=max_new_tokens,
        max_prompt_length=max_prompt_length,
        temperature=temperature,
        top_p=top_p,
        seed=jax.random.fold_in(jax.random.PRNGKey(seed), i),
        eos_tokens=[tokenizer.eos_id()],
    )
    out.extend([int(t) for t in tokens] for tokens in list(result.tokens)[:real])
  return out


def load_tokenizer(directory: pathlib.Path, eos_token: str | None):
  """The checkpoint's `HFTokenizer`; one without an EOS is a `UsageError`."""
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  try:
    tokenizer = checkpoints.HFTokenizer(directory, eos_token=eos_token)
  except (OSError, ValueError) as e:
    raise errors.UsageError(
        f"cannot load the tokenizer of {directory}: {errors.one_line(e)}"
    ) from None
  try:
    eos = tokenizer.eos_id()
  except TypeError:  # int(None): the tokenizer names no EOS.
    eos = None
  if eos is None or (eos_token and eos == tokenizer.unk_id()):
    raise errors.UsageError(
        f"the tokenizer of {directory} has no EOS token"
        + (f" {eos_token!r}" if eos_token else "; pass --eos-token")
    )
  return tokenizer


__all__ = ["check_checkpoint", "load_tokenizer", "sample_completions"]
