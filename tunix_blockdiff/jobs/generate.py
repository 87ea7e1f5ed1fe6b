"""`tunix-blockdiff generate RUN_DIR [key=value ...]`: generate from a checkpoint.

Loads the recipe and latest checkpoint that `tunix-blockdiff sft` wrote to
RUN_DIR (or the Hugging Face directory `tunix-blockdiff export` wrote, whose
config.json `block_diffusion` section supplies the settings and the
defaults below), generates completions for the given prompts with the exact
block-KV-cached driver, prints them with each token coloured by the
denoising step that committed it, and writes the trajectory as a PNG plus a
`generate.json` with tokens, commit steps and log-probs.

Keys (omegaconf dotlist):
  prompts=[...]        prompt strings (default: 4 held-out task prompts)
  threshold=0.9        confidence threshold
  steps_per_block=null static schedule (steps per block) instead
  sub_block_size=null  sub-blocks: commit only in the block's first sub-block
                       with masked slots (Fast-dLLM v2's small blocks)
  cache_phases=1       the cached driver's loop in N phases, each reading
                       only the KV-cache prefix it uses (longer compile)
  lockstep=false       rows start their blocks together (fewer 2W-wide
                       steps when rows fall out of phase; greedy outputs
                       unchanged)
  ragged_cache=false   read the cache with the Pallas kernel that fetches
                       only the slots in use (TPU; interpret mode elsewhere;
                       slower than the default on a v5e)
  fused_head=false     greedy proposals from the Pallas kernel that never
                       writes the logits (TPU; interpret mode elsewhere;
                       temperature 0, same_position alignment)
  one_program=false    with cache_phases > 1, every phase in one program
                       (faster to run, slower to compile)
  temperature=0.0      0 is greedy; > 0 samples (with seed)
  max_new_tokens=null  default: the run's own eval budget (longest eval
                       completion, or the task's longest answer + EOS)
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
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import exported
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import schema
from tunix_blockdiff.runs import sections
from tunix_blockdiff.runs import sft_data

DEFAULTS = {
    "prompts": None,
    "threshold": 0.9,
    "steps_per_block": None,
    "sub_block_size": None,
    "cache_phases": 1,
    "lockstep": False,
    "ragged_cache": False,
    "fused_head": False,
    "one_program": False,
    "temperature": 0.0,
    "max_new_tokens": None,
    "seed": 0,
    "png": None,
    "color": True,
    "mesh": None,
    "distributed": None,
}
# The options' rules (`runs.schema`), checked before anything is loaded.
OPTIONS = schema.section({
    "prompts": schema.sequence(schema.text(), low=1, null=True),
    **sections.DECODING,
    "max_new_tokens": schema.integer(1, null=True),
    "seed": sections.SEED,
    "png": schema.text(null=True),
    "color": schema.boolean(),
    "mesh": sections.MESH,
    "distributed": sections.DISTRIBUTED,
})
OUTPUT_FILE = "generate.json"
FIGURE_FILE = "trajectory.png"


def parse_args(argv: Sequence[str]) -> tuple[pathlib.Path, omegaconf.DictConfig]:
  """(run_dir, options) from `RUN_DIR [key=value ...]`."""
  argv = list(argv)
  if not argv or "=" in argv[0]:
    raise errors.UsageError(
        "usage: tunix-blockdiff generate RUN_DIR [key=value ...]; RUN_DIR is"
        " the output_dir of a `tunix-blockdiff sft`, `rl` or `opd` run"
    )
  run_dir = rl_checkpoints.policy_dir(
      pathlib.Path(argv.pop(0)).expanduser().resolve()
  )
  if exported.is_exported(run_dir):
    decoding = exported.read_section(run_dir)["decoding"]
    return run_dir, parse_options(argv, decoding)
  if not (run_dir / common.RECIPE_FILE).is_file():
    raise errors.MissingFileError(
        f"{run_dir / common.RECIPE_FILE} not found: RUN_DIR must be the"
        " output_dir of a `tunix-blockdiff sft` run or a directory"
        " `tunix-blockdiff export` wrote"
    )
  return run_dir, parse_options(argv)


def parse_options(
    overrides: Sequence[str], defaults: dict[str, Any] | None = None
) -> omegaconf.DictConfig:
  """The generate options (`DEFAULTS`) with `key=value` overrides applied.

  Args:
    overrides: `key=value` strings.
    defaults: Replacements for some `DEFAULTS` (an exported directory's
      decoding defaults).

  Raises:
    UsageError: An unknown option (with the nearest known one).
  """
  return schema.parse_options(overrides, {**DEFAULTS, **(defaults or {})},
                              OPTIONS, "generate option")


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


def eval_budget(run_data) -> int | None:
  """Tokens the run's SFT eval generated per prompt; None without eval rows.

  The SFT job generates `max(completion tokens)` over its eval examples (the
  completion includes EOS); a task that knows its longest answer gives that
  plus EOS instead.
  """
  examples = run_data.eval
  if examples is None or not len(examples):
    return None
  longest = max(examples[i].completion.size for i in range(len(examples)))
  task_max = getattr(run_data.task, "max_answer_chars", None)
  return longest if task_max is None else int(task_max) + 1


def held_out_prompts(cfg, tokenizer, model, diffusion):
  """A run's default prompts and eval budget, from its held-out data.

  Returns:
    ([{prompt, ids, answer}] of the first 4 held-out examples, the eval
    budget (`eval_budget`), whether exact match is scored (a task run)).
  """
  run_data = sft_data.build_sft_data(
      cfg,
      tokenizer,
      seq_len=int(cfg.data.seq_len),
      vocab_size=common.model_vocab_size(model),
      mask_token_id=diffusion.mask_token_id,
      train=False,
  )
  prompts = [
      {"prompt": p, "ids": [int(t) for t in run_data.eval[i].prompt],
       "answer": a}
      for i, (p, a) in enumerate(run_data.eval_pairs[:4])
  ]
  return prompts, eval_budget(run_data), run_data.task is not None


def _load(run_dir: pathlib.Path, options, mesh):
  """(model, tokenizer, diffusion, step, held-out prompts, budget, scored)."""
  if exported.is_exported(run_dir):
    loaded = exported.load(run_dir, mesh)
    return (*loaded[:4], loaded.eval_prompts, None, loaded.scored)
  cfg = omegaconf.OmegaConf.load(run_dir / common.RECIPE_FILE)
  tokenizer = common.build_tokenizer(cfg.tokenizer, cfg.model)
  diffusion = common.diffusion_config_from(cfg.diffusion)
  model, step = load_trained_model(run_dir, cfg, mesh)
  held_out, budget, scored = [], None, False
  if options.prompts is None or options.max_new_tokens is None:
    # The run's held-out data (its task, or its dataset's eval split): the
    # default prompts, and the eval budget the run itself generated with.
    held_out, budget, scored = held_out_prompts(cfg, tokenizer, model, diffusion)
  return model, tokenizer, diffusion, step, held_out, budget, scored


def run(run_dir: pathlib.Path, options) -> dict[str, Any]:
  """Generates and renders; returns what `generate.json` holds."""
  mesh = common.build_mesh(options.mesh)
  with common.mesh_scope(mesh):
    return _run(run_dir, options, mesh)


def _run(run_dir: pathlib.Path, options, mesh) -> dict[str, Any]:
  model, tokenizer, diffusion, step, held_out, budget, scored = _load(
      run_dir, options, mesh
  )
  encoded = None
  if options.prompts is None:
    prompts = [h["prompt"] for h in held_out]
    answers = [h["answer"] for h in held_out]
    encoded = [list(h["ids"]) for h in held_out]
  else:
    scored = False
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
    if budget is None:
      raise errors.UsageError(
          "pass max_new_tokens=N: the run's data has no eval split to take"
          " its generation budget from"
      )
    max_new = budget
    if options.prompts is not None and distributed.is_main_process():
      print(
          f"max_new_tokens={max_new}: the run's own eval budget (its longest"
          " eval completion); pass max_new_tokens=N to change it",
          file=sys.stderr,
      )
  try:
    denoise_config = config_lib.DenoiseConfig(
        block_size=diffusion.block_size,
        mask_token_id=diffusion.mask_token_id,
        threshold=float(options.threshold),
        alignment=diffusion.alignment,
        steps_per_block=options.steps_per_block,
        sub_block_size=options.sub_block_size,
        temperature=float(options.temperature),
        eos_token_id=tokenizer.eos_id(),
        pad_token_id=tokenizer.pad_id(),
    )
  except ValueError as e:
    raise errors.UsageError(f"generate: {e}") from None
  from tunix_blockdiff.rollout import cached  # pylint: disable=g-import-not-at-top
  from tunix_blockdiff.rollout import sampling  # pylint: disable=g-import-not-at-top

  try:
    cache_phases = sampling.optional_positive_int("cache_phases",
                                                  options.cache_phases)
  except (TypeError, ValueError) as e:
    raise errors.UsageError(f"generate: {e}") from None
  for name in ("lockstep", "ragged_cache", "fused_head", "one_program"):
    if not isinstance(options[name], bool):
      raise errors.UsageError(
          f"generate: {name} must be true or false, got {options[name]!r}")

  # On a mesh the prompts are sharded over fsdp (padded to a multiple of it)
  # and the results gathered, so every process holds every row.
  result = distributed.call_sharded(
      lambda tokens, lens: cached.generate(
          model,
          tokens,
          lens,
          denoise_config,
          max_new_tokens=int(max_new),
          rng=jax.random.key(int(options.seed)),
          cache_phases=cache_phases,
          lockstep=options.lockstep,
          ragged_cache=options.ragged_cache,
          fused_head=options.fused_head,
          one_program=options.one_program,
      ),
      mesh,
      prompt_tokens,
      lengths,
  )
  tokens = np.asarray(result.tokens)
  commit_step = np.asarray(result.commit_step)
  logprobs = np.asarray(result.logprobs)
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
          if not scored
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
  return kinds.of_generate_args(argv).call("generate", argv)


def main_block_diffusion(argv: Sequence[str]) -> int:
  """`generate` on a block-diffusion run or export (exit status)."""
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
