"""Writes the released-checkpoint parity goldens under tests/data/released/.

For each format of `tunix_blockdiff.models.released` whose reference code
is given, a tiny random checkpoint is built with the format's *own*
PyTorch modeling code, saved with `save_pretrained` (config.json and
model.safetensors exactly as the format writes them), and its logits on
fixed inputs under the format's inference attention mask are written to
`reference.npz` beside it:

- SDAR (`--sdar-code`: a directory holding `configuration_sdar.py` and
  `modeling_sdar.py`, e.g. a downloaded SDAR checkpoint or
  JetAstra/SDAR's `training/model/SDAR-4B-Chat`): its eval forward with
  the block-causal mask its `generate.py` passes (block 4), two rows, one
  of them with masked slots in its last block;
- Fast-dLLM v2 (`--fast-dllm-code`: a directory holding its
  `configuration.py` and `modeling.py`, e.g. a downloaded
  Efficient-Large-Model/Fast_dLLM_v2_7B): its eval forward, which builds
  its own block-causal mask (`block_size` 4 here);
- dllm's A2D Qwen3 (`--a2d-code`: a directory holding dllm's
  `dllm/pipelines/a2d/models/qwen3/modeling_qwen3.py`): its forward under
  the staircase mask its BD3LM sampler builds (block 4). Its code needs
  transformers >= 4.56, so run this one from a second venv.

The reference code is imported from those directories at run time (copied
into a temporary package, never into this repository). Two imports have
no CPU build and are replaced by their plain-PyTorch equivalents, before
the reference code loads: `flash_attn`'s `rms_norm_fn` (SDAR's own
commented-out fallback formula) and `flash_attn_func` (scaled dot-product
attention without a mask; used only when every key is visible), and SDAR's
fused training loss (a Triton kernel, unused by the eval forward).

Run it in its own venv (torch is several GB; the reference code was
written for transformers 4.52):

  python -m venv /tmp/goldvenv
  /tmp/goldvenv/bin/pip install torch "transformers==4.52.4" safetensors einops
  /tmp/goldvenv/bin/python tools/released_goldens.py \\
      --sdar-code ~/models/SDAR-1.7B-Chat --fast-dllm-code ~/models/Fast_dLLM_v2_7B
  python -m venv /tmp/goldvenv2
  /tmp/goldvenv2/bin/pip install torch "transformers==4.57.6" safetensors
  /tmp/goldvenv2/bin/python tools/released_goldens.py --a2d-code DLLM_A2D_QWEN3_DIR

Rerunning rewrites the files bit for bit (fixed seeds, float32, CPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import shutil
import sys
import tempfile
import types

import numpy as np
import torch
import torch.nn.functional as F

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "released"
VOCAB, MASK, BLOCK, LENGTH = 64, 63, 4, 12
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _stub_flash_attn() -> None:
  """`flash_attn` entries the reference code imports, in plain PyTorch.

  transformers' own modules are imported first, so they see no flash_attn
  (and never dispatch to it); only the reference code's imports get these.
  """
  for name in ("transformers.modeling_flash_attention_utils",
               "transformers.modeling_utils", "transformers.integrations",
               "transformers.generation"):
    importlib.import_module(name)

  def rms_norm_fn(x, weight, bias=None, eps=1e-6):
    del bias
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)

  def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    # [b, l, h, d] in and out; every key visible.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)

  modules = {}
  for name in ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton",
               "flash_attn.ops.triton.layer_norm", "flash_attn.bert_padding"):
    modules[name] = types.ModuleType(name)
  modules["flash_attn.ops.triton.layer_norm"].rms_norm_fn = rms_norm_fn
  modules["flash_attn"].flash_attn_func = flash_attn_func
  modules["flash_attn"].flash_attn_varlen_func = None
  sys.modules.update(modules)


def _package(code: pathlib.Path, files: list[str], name: str,
             extra: dict[str, str]) -> types.ModuleType:
  """`code`'s `files` as a temporary package `name` (plus `extra` stubs)."""
  root = pathlib.Path(tempfile.mkdtemp())
  package = root / name
  package.mkdir()
  (package / "__init__.py").write_text("")
  for file in files:
    source = code / file
    if not source.is_file():
      raise SystemExit(f"{source} not found")
    shutil.copyfile(source, package / file)
  for file, text in extra.items():
    (package / file).write_text(text)
  sys.path.insert(0, str(root))
  return importlib.import_module(name)


def _randomize(model, seed: int) -> None:
  """Every parameter from N(0, 0.3^2) (norms too: a swapped map shows)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _inputs(seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, MASK, (2, LENGTH))
  tokens[1, -3:] = MASK  # masked slots in the last block, as in decoding
  positions = np.broadcast_to(np.arange(LENGTH), (2, LENGTH))
  block = np.arange(LENGTH) // BLOCK
  mask = np.broadcast_to(block[None, :] <= block[:, None], (2, LENGTH, LENGTH))
  return tokens, positions.copy(), mask.copy()


def _save(model, out: pathlib.Path, tokens, positions, mask, logits) -> None:
  if out.exists():
    shutil.rmtree(out)
  model.save_pretrained(out, safe_serialization=True)
  config = json.loads((out / "config.json").read_text())
  config.pop("transformers_version", None)  # the files stay bit-stable
  (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True)
                                   + "\n")
  for extra in out.glob("*.py"):
    extra.unlink()
  np.savez(out / "reference.npz", tokens=tokens.astype(np.int32),
           positions=positions.astype(np.int32), mask=mask,
           logits=logits.astype(np.float32))
  print(f"wrote {out} (logits {tuple(logits.shape)})")


def sdar(code: pathlib.Path) -> None:
  """SDAR's eval forward under its generate.py's block-causal mask."""
  fused = ("class FusedLinearDiffusionCrossEntropyLoss:\n"
           "  def __init__(self, *a, **k):\n"
           "    raise NotImplementedError('training loss: not needed')\n")
  ref = _package(code, ["configuration_sdar.py", "modeling_sdar.py"],
                 "sdar_reference",
                 {"fused_linear_diffusion_cross_entropy.py": fused})
  modeling = importlib.import_module("sdar_reference.modeling_sdar")
  del ref
  config = importlib.import_module(
      "sdar_reference.configuration_sdar").SDARConfig(
          **SIZES, head_dim=8, block_size=BLOCK, mask_token_id=MASK,
          attention_bias=False, use_sliding_window=False,
          sliding_window=None, torch_dtype="float32",
          # The released config.json's own flags (SDAR-4B-Chat).
          fuse_cross_entropy=True, debug=False, micro_forward=False,
          skip_checkpoint=False, use_deepep=False, ep_size=1)
  torch.manual_seed(0)
  model = modeling.SDARForCausalLM(config).eval()
  _randomize(model, seed=1)
  tokens, positions, mask = _inputs(seed=2)
  with torch.no_grad():
    logits = model(
        input_ids=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(mask[:, None].astype(np.float32)),
        position_ids=torch.from_numpy(positions),
        use_cache=False,
    ).logits.numpy()
  _save(model, OUT / "sdar", tokens, positions, mask, logits)


def fast_dllm_v2(code: pathlib.Path) -> None:
  """Fast-dLLM v2's eval forward (its own block-causal mask, block 4)."""
  import transformers.configuration_utils as config_utils  # pylint: disable=g-import-not-at-top

  if not hasattr(config_utils, "layer_type_validation"):
    # Its configuration.py was written for transformers 4.53, which added
    # this check of `layer_types` names; 4.52 (SDAR's) lacks it.
    def layer_type_validation(layer_types):
      for kind in layer_types:
        if kind not in ("full_attention", "sliding_attention"):
          raise ValueError(f"unknown layer type {kind!r}")

    config_utils.layer_type_validation = layer_type_validation
  _package(code, ["configuration.py", "modeling.py"], "fast_dllm_reference",
           {})
  modeling = importlib.import_module("fast_dllm_reference.modeling")
  config = importlib.import_module(
      "fast_dllm_reference.configuration").Fast_dLLM_QwenConfig(
          **SIZES, bd_size=BLOCK, use_sliding_window=False,
          sliding_window=None, torch_dtype="float32",
          # Released configs leave it to the code's default (151665, past
          # this vocabulary); config.json's key is read first.
          mask_token_id=MASK)
  torch.manual_seed(0)
  model = modeling.Fast_dLLM_QwenForCausalLM(config).eval()
  _randomize(model, seed=3)
  tokens, positions, mask = _inputs(seed=4)
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(tokens), block_size=BLOCK,
                   use_cache=False).logits.numpy()
  _save(model, OUT / "fast_dllm_v2", tokens, positions, mask, logits)


def a2d_qwen3(code: pathlib.Path) -> None:
  """dllm's A2D Qwen3 forward under its BD3LM sampler's staircase mask."""
  _package(code, ["modeling_qwen3.py"], "a2d_reference", {})
  modeling = importlib.import_module("a2d_reference.modeling_qwen3")
  config = modeling.A2DQwen3Config(
      **SIZES, head_dim=8, attention_bias=False, use_sliding_window=False,
      sliding_window=None, torch_dtype="float32", mask_token_id=MASK)
  torch.manual_seed(0)
  model = modeling.A2DQwen3LMHeadModel(config).eval()
  _randomize(model, seed=5)
  tokens, positions, mask = _inputs(seed=6)
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(tokens),
                   attention_mask=torch.from_numpy(mask[:, None]),
                   position_ids=torch.from_numpy(positions),
                   use_cache=False).logits.numpy()
  _save(model, OUT / "a2d_qwen3", tokens, positions, mask, logits)


def sdar_reference_of(directory: pathlib.Path) -> None:
  """Logits of an SDAR directory through the code it carries (`*.py`).

  What SDAR's own tools do with a directory `tunix-blockdiff export` wrote
  (`trust_remote_code`): the weights loaded by its `modeling_sdar.py`, the
  golden inputs and mask; written to `DIR/reference.npz`, which
  `released.compare_reference` (and `tools/released_goldens.py`'s docs)
  compare with the Tunix model loaded from the same directory.
  """
  _package(directory, ["configuration_sdar.py", "modeling_sdar.py"],
           "sdar_export_reference",
           {"fused_linear_diffusion_cross_entropy.py":
            "class FusedLinearDiffusionCrossEntropyLoss:\n  pass\n"})
  modeling = importlib.import_module("sdar_export_reference.modeling_sdar")
  model = modeling.SDARForCausalLM.from_pretrained(
      directory, torch_dtype=torch.float32).eval()
  tokens, positions, mask = _inputs(seed=2)
  with torch.no_grad():
    logits = model(
        input_ids=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(mask[:, None].astype(np.float32)),
        position_ids=torch.from_numpy(positions), use_cache=False,
    ).logits.numpy()
  np.savez(directory / "reference.npz", tokens=tokens.astype(np.int32),
           positions=positions.astype(np.int32), mask=mask,
           logits=logits.astype(np.float32))
  print(f"wrote {directory / 'reference.npz'} (SDAR's code on the export)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sdar-code", type=pathlib.Path, default=None)
  parser.add_argument("--fast-dllm-code", type=pathlib.Path, default=None)
  parser.add_argument("--a2d-code", type=pathlib.Path, default=None)
  parser.add_argument("--sdar-reference-of", type=pathlib.Path, default=None,
                      help="an exported SDAR directory: its logits through"
                      " the modeling code it carries")
  args = parser.parse_args()
  torch.set_default_dtype(torch.float32)
  _stub_flash_attn()
  if args.sdar_code:
    sdar(args.sdar_code.expanduser())
  if args.fast_dllm_code:
    fast_dllm_v2(args.fast_dllm_code.expanduser())
  if args.a2d_code:
    a2d_qwen3(args.a2d_code.expanduser())
  if args.sdar_reference_of:
    sdar_reference_of(args.sdar_reference_of.expanduser())


if __name__ == "__main__":
  main()
