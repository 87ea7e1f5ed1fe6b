"""Causal pretraining of `convert_code.py`'s AR base on the corpus.

A small Tunix Qwen3 (the benchmark's `Sizes`) trained as a causal LM with
the benchmark's Tunix `PeftTrainer` loop (`_causal_lm.train`) on the
training modules, each file framed BOS ... EOS, then saved as a Hugging Face
directory (`hf_export.save_qwen3_hf`): the checkpoint every stage starts
from.
"""

from __future__ import annotations

import pathlib
import time

import _causal_lm
import _code_corpus
from flax import nnx
import numpy as np
import omegaconf
from tunix.models.qwen3 import model as qwen3_lib

from tunix_blockdiff.runs import common
from tunix_blockdiff.models import hf_export
from tunix_blockdiff.models import tiny as tiny_models


def optimizer(steps: int, lr: float, warmup: int):
  """The pretraining optimizer: the jobs' AdamW schedule, no weight decay."""
  return common.make_optimizer(
      omegaconf.OmegaConf.create({
          "max_steps": steps,
          "warmup_steps": warmup,
          "learning_rate": lr,
          "final_lr_fraction": 0.1,
          "weight_decay": 0.0,
          "adam_b2": 0.99,
          "grad_clip": 1.0,
      })
  )


def pretrain(sizes, tokenizer, files, out: pathlib.Path, log) -> dict:
  """Tokenizer-encoded training modules -> a causal Qwen3 -> `out` (HF).

  Args:
    sizes: `convert_code.Sizes` (the model's shape, the pretraining budget).
    tokenizer: The trained `transformers` tokenizer (BOS, EOS, pad ids).
    files: The training modules' source files.
    out: The Hugging Face directory to write.
    log: A one-line logger.

  Returns:
    Files, tokens, steps, tokens seen, final loss, seconds, parameters.
  """
  config = tiny_models.qwen3_config(
      len(tokenizer),
      num_layers=sizes.num_layers,
      embed_dim=sizes.embed_dim,
      hidden_dim=sizes.hidden_dim,
      num_heads=sizes.num_heads,
      head_dim=sizes.head_dim,
      num_kv_heads=sizes.num_kv_heads,
  )
  # Tunix 0.1.7 initialises feed-forward kernels to zero, a saddle where they
  # never receive a gradient: draw them, or the pretrained model has no MLPs.
  model = tiny_models.random_mlps(
      qwen3_lib.Qwen3(config, rngs=nnx.Rngs(sizes.seed)), sizes.seed
  )
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  documents = []
  for path in files:
    text = _code_corpus.read_text(path)
    if text:
      documents.append([bos] + tokenizer.encode(text) + [eos])
  num_tokens = sum(len(d) for d in documents)
  log(f"pretraining on {len(documents)} files, {num_tokens} tokens")
  start = time.perf_counter()
  losses = _causal_lm.train(
      model,
      optimizer(sizes.pretrain_steps, sizes.pretrain_lr, 50),
      _causal_lm.pretraining_batches(
          documents,
          seq_len=sizes.pretrain_seq_len,
          batch_size=sizes.pretrain_batch,
          seed=sizes.seed,
      ),
      max_steps=sizes.pretrain_steps,
      pad_id=tokenizer.pad_token_id,
  )
  seconds = time.perf_counter() - start
  hf_export.save_qwen3_hf(
      model,
      out,
      tokenizer_json=out.parent / "tokenizer",
      bos_token_id=bos,
      eos_token_id=eos,
      pad_token_id=tokenizer.pad_token_id,
  )
  log(
      f"pretrained {sizes.pretrain_steps} steps in {seconds:.0f}s, final"
      f" loss {np.mean(losses[-20:]):.3f}; saved {out}"
  )
  return {
      "files": len(documents),
      "tokens": num_tokens,
      "steps": sizes.pretrain_steps,
      "tokens_seen": (
          sizes.pretrain_steps * sizes.pretrain_batch * sizes.pretrain_seq_len
      ),
      "final_loss": float(np.mean(losses[-20:])),
      "seconds": seconds,
      "num_params": int(
          sum(
              np.size(v.get_value())
              for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          )
      ),
  }
