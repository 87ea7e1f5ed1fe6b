"""A tiny character-level Hugging Face tokenizer with a chat template.

Written by tests that need `transformers.AutoTokenizer` (and so
`checkpoints.HFTokenizer`) to render `{"messages"}` rows offline.
"""

import json
import pathlib

SPECIALS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,:?!'-+="
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_hf_tokenizer(directory) -> int:
  """Writes tokenizer.json + tokenizer_config.json; returns the vocab size."""
  from tokenizers import Tokenizer
  from tokenizers import decoders
  from tokenizers import models
  from tokenizers import pre_tokenizers

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  vocab = {token: i for i, token in enumerate(SPECIALS + tuple(CHARS))}
  tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer.add_special_tokens(list(SPECIALS))
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
      json.dumps({
          "tokenizer_class": "PreTrainedTokenizerFast",
          "chat_template": CHAT_TEMPLATE,
          "eos_token": "<|im_end|>",
          "pad_token": "<pad>",
          "unk_token": "<unk>",
      })
  )
  return len(vocab)
