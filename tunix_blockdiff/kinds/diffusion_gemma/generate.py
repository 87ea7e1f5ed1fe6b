"""`tunix-blockdiff generate DIR [key=value ...]` for DiffusionGemma.

Samples from a DiffusionGemma run directory (its recipe and latest
checkpoint, LoRA merged) or from an HF DiffusionGemma directory alone (its
tokenizer, chat template and `generation_config.json` sampler defaults),
colours each token by the denoising step that last changed it, reports
forward passes per token, and writes `generate.json` and a PNG. Options:
`kinds.diffusion_gemma.sft.DEFAULTS` (prompts, chat, max_new_tokens, seed, png,
color and the sampler keys).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any, Sequence

import jax
import numpy as np
import omegaconf
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import errors
from tunix_blockdiff import trajectory
from tunix_blockdiff.runs import common
from tunix_blockdiff.kinds.diffusion_gemma import recipe_schema
from tunix_blockdiff.kinds.diffusion_gemma import sft as dg_job
from tunix_blockdiff.runs import schema
from tunix_blockdiff.runs import sft_data as sft_data_lib
from tunix_blockdiff.models import checkpoints
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout

OUTPUT_FILE = "generate.json"
TRAJECTORY_FILE = "trajectory.png"
DEFAULTS = dg_job.DEFAULTS


def load_run(run_dir: pathlib.Path, cfg):
  """(model with the run's latest checkpoint, LoRA merged; defaults; step)."""
  model, defaults = dg_job.build_model(cfg.model, seed=int(cfg.seed))
  base_model = model
  lora = common.lora_enabled(cfg.get("lora"))
  model = common.apply_lora(model, cfg.get("lora"), seed=int(cfg.seed))
  manager = checkpoint_lib.CheckpointManager(str(run_dir / "checkpoints"))
  step, _ = manager.maybe_restore(model, restore_only_lora_params=lora)
  manager.close()
  if step == 0:
    raise errors.MissingFileError(
        f"no checkpoint found under {run_dir / 'checkpoints'}")
  if lora:
    model = checkpoints.merge_lora(model, base_model, rank=int(cfg.lora.rank),
                                   alpha=float(cfg.lora.alpha))
  return model, defaults, step


# The options' rules (`runs.schema`); the sampler keys as in a recipe.
OPTIONS = schema.section({
    "prompts": schema.sequence(schema.text(), low=1, null=True),
    "chat": schema.boolean(),
    "max_new_tokens": schema.integer(1, null=True),
    "seed": schema.integer(0),
    "png": schema.text(null=True),
    "color": schema.boolean(),
    **recipe_schema.SAMPLER.keys,
}, *recipe_schema.SAMPLER.rules)


def _options(overrides: Sequence[str]):
  return schema.parse_options(overrides, DEFAULTS, OPTIONS,
                              "generate option")


def generate(path: pathlib.Path, options) -> dict[str, Any]:
  """Samples `options.prompts` from a run or HF directory; writes outputs."""
  task_pairs = None
  if dg_job.is_hf_dir(path):
    model, defaults, _ = dg.load(path)
    tokenizer = checkpoints.HFTokenizer(path)
    step, budget = None, None
  else:
    cfg = omegaconf.OmegaConf.load(path / common.RECIPE_FILE)
    tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
    model, defaults, step = load_run(path, cfg)
    budget, run_data = None, None
    # The run's held-out rows give the default prompts and budget; a run
    # without data (an rl run on an HF directory) needs both passed.
    if cfg.get("task") is not None or cfg.get("dataset") is not None:
      run_data = sft_data_lib.build_sft_data(
          cfg, tokenizer, seq_len=int(cfg.data.seq_len),
          vocab_size=model.config.vocab_size, mask_token_id=None, train=False)
    if (run_data is not None and run_data.eval is not None
        and len(run_data.eval)):
      budget = max(run_data.eval[i].completion.size
                   for i in range(len(run_data.eval)))
      task_pairs = run_data.eval_pairs[:4]
  if options.prompts is None:
    if task_pairs is None:
      raise errors.UsageError("pass prompts=[...]")
    prompts = [p for p, _ in task_pairs]
  else:
    prompts = [str(p) for p in options.prompts]
  max_new = options.max_new_tokens
  if max_new is None:
    if budget is None:
      raise errors.UsageError("pass max_new_tokens=N")
    max_new = budget
    print(f"max_new_tokens={max_new}: the run's own eval budget",
          file=sys.stderr)
  if options.chat:
    encoded = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": p}])) for p in prompts]
  else:
    encoded = [common.encode_pair(tokenizer, p, "")[0] for p in prompts]
  lengths = np.asarray([len(e) for e in encoded], np.int32)
  width = int(lengths.max())
  tokens_in = np.full((len(encoded), width), tokenizer.pad_id(), np.int32)
  for b, ids in enumerate(encoded):
    tokens_in[b, width - len(ids):] = ids
  config = dg_job.sampler_config(options, defaults, tokenizer)
  result = dg_rollout.generate(model, tokens_in, lengths, config,
                               max_new_tokens=int(max_new),
                               rng=jax.random.key(int(options.seed)))
  completions = [tokenizer.decode(row) for row in result.tokens]

  def decode_token(i: int) -> str:
    if i == tokenizer.eos_id():
      return "⏎"
    if i == tokenizer.pad_id():
      return "·"
    return tokenizer.decode([i]) or "·"

  # Colour = the denoising step that last changed the token (within its
  # canvas); bars mark canvas boundaries.
  shown_step = np.maximum(result.changed_at - 1, 0)
  shown_step = np.where(result.tokens == config.pad_token_id, -1, shown_step)
  text = trajectory.render_terminal(
      result.tokens, shown_step, decode_token, model.config.canvas_length,
      prompts=[p + " " for p in prompts])
  if not options.color:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
  print(text)
  out_dir = path if not dg_job.is_hf_dir(path) else pathlib.Path.cwd()
  png = pathlib.Path(options.png or out_dir / TRAJECTORY_FILE)
  trajectory.render_png(
      str(png), result.tokens, shown_step, decode_token,
      model.config.canvas_length, row_labels=prompts,
      title="DiffusionGemma: colour = step that last changed the token")
  output = {
      "checkpoint_step": step,
      "prompts": prompts,
      "completions": completions,
      "tokens": result.tokens.tolist(),
      "changed_at": result.changed_at.tolist(),
      "canvas_steps": result.canvas_steps.tolist(),
      "forward_passes": result.forward_passes.tolist(),
      "tokens_per_forward": float(
          (result.tokens != config.pad_token_id).sum()
          / max(result.forward_passes.sum(), 1)),
      "sampler": dict(config.__dict__),
      "png": str(png),
  }
  (out_dir / OUTPUT_FILE).write_text(json.dumps(output, indent=1))
  output["output_file"] = str(out_dir / OUTPUT_FILE)
  return output


def generate_main(argv: Sequence[str]) -> int:
  """`tunix-blockdiff generate DIR [key=value ...]` for DiffusionGemma."""
  from tunix_blockdiff.runs import rl_checkpoints  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(argv[0]).expanduser().resolve()
  if not dg_job.is_hf_dir(path):
    path = rl_checkpoints.policy_dir(path)  # An rl/opd run's policy.
  output = generate(path, _options(argv[1:]))
  print(f"forward passes per token: "
        f"{1 / max(output['tokens_per_forward'], 1e-9):.2f}  (tokens per"
        f" forward {output['tokens_per_forward']:.2f})  wrote"
        f" {output['output_file']}")
  return 0
