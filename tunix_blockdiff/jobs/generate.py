"""`tunix-blockdiff generate RUN_DIR [key=value ...]`: generate from a checkpoint.

Loads the recipe and latest checkpoint that `tunix-blockdiff sft` wrote to
RUN_DIR, generates completions for the given prompts with the exact
block-KV-cached driver, prints them with each token coloured by the
denoising step that committed it, and writes the trajectory as a PNG plus a
`generate.json` with tokens, commit steps and log-probs.

Keys (omegaconf dotlist):
  prompts=[...]        prompt strings (default: 4 held-out task prompts)
  threshold=0.9        confidence threshold
  steps_per_block=null static schedule (steps per block) instead
  temperature=0.0      0 is greedy; > 0 samples (with seed)
  max_new_tokens=null  default: the task's longest answer + EOS
  seed=0               PRNG seed for sampling
  png=null             default: RUN_DIR/trajectory.png
  color=true           ANSI colours in the terminal output
  mesh=null            {fsdp, sp, tp}: shard the model, prompts over fsdp
  distributed=null     JAX distributed runtime (see `tunix-blockdiff launch`)
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Sequence

import jax
import numpy as np
import omegaconf
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff.models import checkpoints
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import errors
from tunix_blockdiff import trajectory
from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import sft_data

DEFAULTS = {
    "prompts": None,
    "threshold": 0.9,
    "steps_per_block": None,
    "temperature": 0.0,
    "max_new_tokens": None,
    "seed": 0,
    "png": None,
    "color": True,
    "mesh": None,
    "distributed": None,
}
OUTPUT_FILE = "generate.json"
FIGURE_FILE = "trajectory.png"


def parse_args(argv: Sequence[str]) -> tuple[pathlib.Path, omegaconf.DictConfig]:
  """(run_dir, options) from `RUN_DIR [key=value ...]`."""
  argv = list(argv)
  if not argv or "=" in argv[0]:
    raise errors.UsageError(
        "usage: tunix-blockdiff generate RUN_DIR [key=value ...]; RUN_DIR is"
        " the output_dir of a `tunix-blockdiff sft` run"
    )
  run_dir = pathlib.Path(argv.pop(0)).expanduser().resolve()
  if not (run_dir / common.RECIPE_FILE).is_file():
    raise errors.MissingFileError(
        f"{run_dir / common.RECIPE_FILE} not found: RUN_DIR must be the"
        " output_dir of a `tunix-blockdiff sft` run"
    )
  options = omegaconf.OmegaConf.create(DEFAULTS)
  omegaconf.OmegaConf.set_struct(options, True)
  try:
    options = omegaconf.OmegaConf.merge(
        options, omegaconf.OmegaConf.from_dotlist(argv)
    )
  except omegaconf.errors.ConfigKeyError as e:
    key = str(getattr(e, "full_key", "") or e)
    raise errors.UsageError(
        f"unknown generate option {key!r}"
        + errors.nearest(key, DEFAULTS)
        + f"; known: {sorted(DEFAULTS)}"
    ) from None
  return run_dir, options


def load_trained_model(run_dir: pathlib.Path, cfg, mesh=None):
  """The model of an SFT run with its latest checkpoint (LoRA merged).

  Under a `mesh` the parameters are placed by the model's partition specs
  before the restore, so every process restores its own shards.

  Returns:
    (model, restored_step). Raises if the run has no checkpoint.
  """
  model = common.build_model(cfg.model, seed=int(cfg.seed), mesh=mesh)
  base_model = model
  lora = common.lora_enabled(cfg.get("lora"))
  model = common.apply_lora(model, cfg.lora, seed=int(cfg.seed))
  model = common.shard_model(model, mesh)
  manager = checkpoint_lib.CheckpointManager(str(run_dir / "checkpoints"))
  step, _ = manager.maybe_restore(model, restore_only_lora_params=lora)
  manager.close()
  if step == 0:
    raise FileNotFoundError(f"no checkpoint found under {run_dir / 'checkpoints'}")
  if lora:
    model = checkpoints.merge_lora(
        model, base_model, rank=int(cfg.lora.rank), alpha=float(cfg.lora.alpha)
    )
  return model, step


def run(run_dir: pathlib.Path, options) -> dict[str, Any]:
  """Generates and renders; returns what `generate.json` holds."""
  mesh = common.build_mesh(options.mesh)
  with common.mesh_scope(mesh):
    return _run(run_dir, options, mesh)


def _run(run_dir: pathlib.Path, options, mesh) -> dict[str, Any]:
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  diffusion = common.diffusion_config_from(cfg.diffusion)
  model, step = load_trained_model(run_dir, cfg, mesh)

  task, encoded = None, None
  if options.prompts is None:
    # The run's held-out data: its task, or its dataset's eval split.
    run_data = sft_data.build_sft_data(
        cfg,
        tokenizer,
        seq_len=int(cfg.data.seq_len),
        vocab_size=common.model_vocab_size(model),
        mask_token_id=diffusion.mask_token_id,
        train=False,
    )
    task = run_data.task
    pairs = run_data.eval_pairs[:4]
    prompts = [p for p, _ in pairs]
    answers = [a for _, a in pairs]
    examples = [run_data.eval[i] for i in range(len(pairs))]
    encoded = [list(ex.prompt) for ex in examples]
    longest = max((ex.completion.size for ex in examples), default=0)
    max_answer = getattr(task, "max_answer_chars", longest - 1) + 1
  else:
    prompts = [str(p) for p in options.prompts]
    answers = [None] * len(prompts)
  if not prompts:
    raise errors.UsageError(
        "no prompts: pass prompts=[...] (the run's data has no eval split)"
    )
  if encoded is None:
    encoded = [common.encode_pair(tokenizer, p, "")[0] for p in prompts]
  lengths = np.asarray([len(ids) for ids in encoded], np.int32)
  width = int(lengths.max())
  prompt_tokens = np.full((len(encoded), width), tokenizer.pad_id(), np.int32)
  for b, ids in enumerate(encoded):
    prompt_tokens[b, width - len(ids) :] = ids

  max_new = options.max_new_tokens
  if max_new is None:
    if task is None:
      raise errors.UsageError("max_new_tokens is required with custom prompts")
    max_new = max_answer
  denoise_config = config_lib.DenoiseConfig(
      block_size=diffusion.block_size,
      mask_token_id=diffusion.mask_token_id,
      threshold=float(options.threshold),
      alignment=diffusion.alignment,
      steps_per_block=options.steps_per_block,
      temperature=float(options.temperature),
      eos_token_id=tokenizer.eos_id(),
      pad_token_id=tokenizer.pad_id(),
  )
  from tunix_blockdiff.rollout import cached  # pylint: disable=g-import-not-at-top

  batch = {"prompts": prompt_tokens, "lengths": lengths}
  if mesh is not None:
    # Prompts sharded over fsdp (each process places its rows), padded to a
    # multiple of mesh.fsdp with copies of the last prompt.
    num, fsdp = len(prompts), int(mesh.shape["fsdp"])
    size = -(-num // fsdp) * fsdp
    index = np.minimum(np.arange(size), num - 1)
    lo, hi = distributed.process_rows(mesh, size)
    batch = distributed.global_batch(
        {k: v[index[lo:hi]] for k, v in batch.items()}, mesh, size
    )
  result = cached.generate(
      model,
      batch["prompts"],
      batch["lengths"],
      denoise_config,
      max_new_tokens=int(max_new),
      rng=jax.random.key(int(options.seed)),
  )
  tokens = distributed.gather(result.tokens)[: len(prompts)]
  commit_step = distributed.gather(result.commit_step)[: len(prompts)]
  logprobs = distributed.gather(result.logprobs)[: len(prompts)]
  completions = [tokenizer.decode(row) for row in tokens]
  committed = int((commit_step >= 0).sum())
  # As in the SFT eval: a row takes part in every step until its last commit.
  calls = int(np.sum(commit_step.max(axis=1) + 1))

  def decode_token(i: int) -> str:
    text = tokenizer.decode([i])
    if i == tokenizer.eos_id():
      return "⏎"
    return text or "·"

  png = pathlib.Path(options.png or run_dir / FIGURE_FILE)
  # Every process holds the gathered results; process 0 writes and prints.
  main_process = distributed.is_main_process()
  if main_process:
    trajectory.render_png(
        str(png),
        tokens,
        commit_step,
        decode_token,
        diffusion.block_size,
        first_position=lengths,
        row_labels=prompts,
        title=f"denoising trajectory (threshold {float(options.threshold):g}, step {step})",
    )
  text = trajectory.render_terminal(
      tokens,
      commit_step,
      decode_token,
      diffusion.block_size,
      first_position=lengths,
      prompts=[p + " " for p in prompts],
  )
  if not options.color:
    import re  # pylint: disable=g-import-not-at-top

    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
  if main_process:
    print(text)
  output = {
      "checkpoint_step": step,
      "prompts": prompts,
      "completions": completions,
      "answers": answers,
      "exact_match": (
          None
          if task is None
          else float(np.mean([c == a for c, a in zip(completions, answers)]))
      ),
      "tokens": tokens,
      "commit_step": commit_step,
      "logprobs": logprobs,
      "num_steps": int(result.num_steps),
      "committed_tokens": committed,
      "tokens_per_step": committed / max(calls, 1),
      "png": str(png),
  }
  if main_process:
    (run_dir / OUTPUT_FILE).write_text(
        json.dumps(common._jsonable(output), indent=2) + "\n"  # pylint: disable=protected-access
    )
  return output


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  run_dir, options = parse_args(argv)
  distributed.initialize(common.to_dict(options.distributed))
  output = run(run_dir, options)
  if distributed.is_main_process():
    print(
        f"tokens_per_step: {output['tokens_per_step']:.2f}  exact_match:"
        f" {output['exact_match']}  wrote {output['png']} and"
        f" {run_dir / OUTPUT_FILE}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
