"""Prompt tokenisation for rollouts (`rollout/prompts.py`)."""

import numpy as np
import pytest

from tunix_blockdiff import tasks
from tunix_blockdiff.rl import engine
from tunix_blockdiff.rollout import prompts
from tunix_blockdiff.rollout import sampling
from tunix_blockdiff.rollout import weights


class _Tokenizer:
  """A `TokenizerAdapter`-like view of the character tokenizer."""

  def __init__(self):
    self._tok = tasks.CharTokenizer()

  def encode(self, text):
    return self._tok.encode(text)

  def bos_id(self):
    return self._tok.bos_id()

  def pad_id(self):
    return self._tok.pad_id()


def test_left_padded_with_bos_and_counted_truncation():
  tok = _Tokenizer()
  out = prompts.tokenize_prompts(tok, ["rev 12>", "rev 1234567>"], 8)
  assert out.tokens.shape == (2, 8) and out.tokens.dtype == np.int32
  first = [tok.bos_id(), *tok.encode("rev 12>")]
  np.testing.assert_array_equal(out.tokens[0, -len(first):], first)
  assert (out.tokens[0, : 8 - len(first)] == tok.pad_id()).all()
  # 13 tokens with BOS: the last 8 are kept, and the cut is counted.
  assert out.lengths.tolist() == [len(first), 8]
  np.testing.assert_array_equal(out.tokens[1], tok.encode("rev 1234567>")[-8:])
  assert out.truncated == 1 and out.longest == 13
  mask = prompts.prompt_mask_from_tokens(out.tokens, tok.pad_id())
  assert mask[0].tolist() == [False] * (8 - len(first)) + [True] * len(first)
  assert mask[1].all()
  with pytest.raises(ValueError, match="max_prompt_length"):
    prompts.tokenize_prompts(tok, ["x"], 0)


def test_engine_re_exports_the_split_names():
  assert engine.prompt_mask_from_tokens is prompts.prompt_mask_from_tokens
  assert callable(sampling.denoise_config_for)
  assert callable(weights.update_params)
