"""The conversion recipe chain `convert_code.py` runs, stage by stage.

Every stage is a `tunix-blockdiff` command line, run in this process through
`tunix_blockdiff.cli.main` (what a user types, without a fresh interpreter
per stage), each starting from the previous stage's output:

    RUN/ar_base (AR HF dir) --sft convert_code.yaml--> RUN/sft
    RUN/sft --export--> RUN/sft_hf
    RUN/sft_hf --sft dataset.train=RUN/distilled.jsonl--> RUN/sft_kd
    RUN/sft_hf --sft ... diffusion.certainty_weight=C--> RUN/sft_kd_certainty
    RUN/sft --opd teacher.kind=hf teacher.path=RUN/ar_peer--> RUN/sft_opd
    RUN/sft_kd_certainty --opd ...--> RUN/sft_kd_certainty_opd (all three)
    RUN/ar_peer --sft dataset.train=RUN/distilled.jsonl ...certainty...-->
        RUN/peer_kd_certainty (the task-tuned AR model converted on its own
        outputs)
    RUN/sft_kd_certainty_x4 --distill-data --threshold T--> RUN/self_....jsonl
    RUN/sft_kd_certainty_x4_hf --sft dataset.train=RUN/self_....jsonl
        ...certainty...--> RUN/sft_kd_certainty_x4_self (self-distillation)

`RUN/distilled.jsonl` is `tunix-blockdiff distill-data RUN/ar_peer
RUN/distill_prompts.jsonl`: the AR peer's greedy completions of the training
prompts (with `--distill-prompts N`, also of function prefixes of the same
training modules: `_code_corpus.distill_prompts`). A self-distillation stage
trains on its parent's own decodes of the same prompts (`distill-data
RUN/PARENT ... --threshold T`, the block-diffusion path). Each stage's training
compute is counted as steps x batch x tokens per row (the padded width the
step runs on); a chain from the AR peer counts the peer's causal fine-tuning
as its first stage.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from typing import Any, Callable

from tunix_blockdiff import cli

RECIPE = (
    pathlib.Path(__file__).resolve().parents[1]
    / "recipes"
    / "convert_code.yaml"
)
DISTILLED = "distilled.jsonl"
DISTILL_PROMPTS = "distill_prompts.jsonl"


@dataclasses.dataclass(frozen=True)
class Stage:
  """One command of the chain; `name` is its output_dir under RUN.

  Attributes:
    name: The output directory (and the model's name in the report).
    command: `sft` or `opd`.
    parent: The stage it starts from; None: the AR base checkpoint.
    distilled: Train on the AR peer's completions instead of the references.
    lora: LoRA instead of full fine-tuning (sft only).
    certainty: The SFT certainty term's weight as a multiple of
      `Sizes.certainty_weight` (sft only); 0: off.
    source: The Hugging Face directory under RUN a stage without a parent
      converts: the AR base, or `ar_peer` (the AR model fine-tuned on the
      task, which is also the distillation teacher).
    self_distilled: Train on the parent's own threshold decodes of the
      distillation prompts (`self_data`) instead (needs a parent).
  """

  name: str
  command: str
  parent: str | None = None
  distilled: bool = False
  lora: bool = False
  certainty: float = 0.0
  source: str = "ar_base"
  self_distilled: bool = False


# The certainty term is measured on the KD stage (`sft_kd_certainty` against
# `sft_kd`: the same rows and steps, only the term differs);
# `sft_kd_certainty_opd` combines all three. `peer_kd_certainty` converts the
# teacher itself: the AR peer trained with the block-diffusion objective and
# the certainty term on its own greedy completions (one stage, the KD budget).
# `sft_kd_certainty_x4` is `sft_kd_certainty` with a 4x heavier term (fixed in
# advance, not picked on the held-out modules): how far certainty alone goes.
# `sft_kd_certainty_x4_self` continues it on its own decodes at
# `Sizes.self_threshold` with the same term: dParallel's certainty-forcing
# self-distillation (the KD budget again).
STAGES = (
    Stage("sft", "sft"),
    Stage("sft_lora", "sft", lora=True),
    Stage("sft_kd", "sft", parent="sft", distilled=True),
    Stage(
        "sft_kd_certainty", "sft", parent="sft", distilled=True, certainty=1.0
    ),
    Stage(
        "sft_kd_certainty_x4",
        "sft",
        parent="sft",
        distilled=True,
        certainty=4.0,
    ),
    Stage(
        "sft_kd_certainty_x4_self",
        "sft",
        parent="sft_kd_certainty_x4",
        certainty=4.0,
        self_distilled=True,
    ),
    Stage("sft_opd", "opd", parent="sft"),
    Stage("sft_kd_certainty_opd", "opd", parent="sft_kd_certainty"),
    Stage(
        "peer_kd_certainty",
        "sft",
        distilled=True,
        certainty=1.0,
        source="ar_peer",
    ),
)


def by_name(stages=STAGES) -> dict[str, Stage]:
  """Stage name -> stage."""
  return {s.name: s for s in stages}


def chain(name: str, stages=STAGES) -> list[Stage]:
  """The stages from the AR base to `name`, in the order they run."""
  index = by_name(stages)
  if name not in index:
    raise ValueError(f"unknown stage {name!r}; known: {sorted(index)}")
  out = []
  while name is not None:
    out.append(index[name])
    name = index[name].parent
  return out[::-1]


def row_tokens(sizes) -> int:
  """Tokens per SFT row: BOS + prompt + completion + EOS."""
  return 1 + sizes.prompt_tokens + sizes.completion_tokens + 1


def self_data(parent: str) -> str:
  """The jsonl file of `parent`'s own decodes of the distillation prompts."""
  return f"self_{parent}.jsonl"


def sft_steps(sizes, stage: Stage) -> int:
  """An sft stage's steps: the KD budget on distilled rows, else sft's."""
  if stage.distilled or stage.self_distilled:
    return sizes.stage_steps
  return sizes.sft_steps


def sft_args(sizes, run: pathlib.Path, stage: Stage) -> list[str]:
  """The `sft convert_code.yaml ...` arguments of an sft stage."""
  base = run / (stage.source if stage.parent is None else f"{stage.parent}_hf")
  if stage.self_distilled:
    data = run / self_data(stage.parent)
  else:
    data = run / (DISTILLED if stage.distilled else "sft_train.jsonl")
  steps = sft_steps(sizes, stage)
  args = [
      str(RECIPE),
      f"model.path={base}",
      f"dataset.train={data}",
      f"dataset.eval={run / 'sft_eval.jsonl'}",
      f"output_dir={run / stage.name}",
      f"training.max_steps={steps}",
      f"training.eval_every_n_steps={max(steps // 2, 1)}",
      f"training.checkpoint_every_n_steps={steps}",
      f"data.seq_len={row_tokens(sizes)}",
      f"data.batch_size={sizes.sft_batch}",
      f"diffusion.block_size={sizes.block_size}",
      f"eval.batch_size={sizes.eval_batch}",
      f"seed={sizes.seed}",
  ]
  if stage.lora:
    args += ["lora.enabled=true", f"training.learning_rate={sizes.lora_lr}"]
  if stage.certainty:
    args += [
        "diffusion.certainty_weight="
        f"{sizes.certainty_weight * stage.certainty}",
        f"diffusion.certainty_temperature={sizes.certainty_temperature}",
    ]
  return args


def opd_args(sizes, run: pathlib.Path, stage: Stage) -> list[str]:
  """The `opd teacher.kind=hf ...` arguments of an opd stage."""
  return [
      "teacher.kind=hf",
      f"teacher.path={run / 'ar_peer'}",
      f"student.checkpoint={run / stage.parent}",
      f"output_dir={run / stage.name}",
      f"dataset.train={run / 'sft_train.jsonl'}",
      "dataset.fields.answer=completion",
      f"rollout.max_prompt_length={1 + sizes.prompt_tokens}",
      f"rollout.max_tokens_to_generate={sizes.completion_tokens + 1}",
      f"opd.steps={sizes.opd_steps}",
      f"opd.prompts_per_step={sizes.opd_prompts}",
      f"opd.micro_batch_prompts={sizes.opd_prompts}",
      f"opd.learning_rate={sizes.opd_lr}",
      f"eval.num_prompts={sizes.opd_eval_prompts}",
      f"eval.batch_size={sizes.opd_eval_prompts}",
      f"seed={sizes.seed}",
  ]


def distill_args(sizes, run: pathlib.Path) -> list[str]:
  """`distill-data` of the AR peer on the training prompts."""
  return [
      str(run / "ar_peer"),
      str(run / DISTILL_PROMPTS),
      str(run / DISTILLED),
      f"--max-new-tokens={sizes.completion_tokens}",
      f"--batch-size={sizes.eval_batch}",
      "--overwrite",
  ]


def run_cli(argv: list[str], log: Callable[[str], None]) -> float:
  """`tunix-blockdiff ARGV` in this process; its seconds. Fails loudly."""
  log("$ tunix-blockdiff " + " ".join(argv))
  start = time.perf_counter()
  code = cli.main(list(argv))
  if code != 0:
    raise RuntimeError(f"tunix-blockdiff {argv[0]} exited with {code}")
  return time.perf_counter() - start


def compute(kind: str, steps: int, batch: int, tokens: int, seconds: float):
  """A stage's compute record: steps x batch x tokens token slots."""
  return {
      "stage": kind,
      "steps": int(steps),
      "batch": int(batch),
      "tokens": int(tokens),
      "token_slots": int(steps) * int(batch) * int(tokens),
      "seconds": float(seconds),
  }


def self_distill_args(sizes, run: pathlib.Path, parent: str) -> list[str]:
  """`distill-data` of a block-diffusion stage on the same prompts."""
  return [
      str(run / parent),
      str(run / DISTILL_PROMPTS),
      str(run / self_data(parent)),
      f"--threshold={sizes.self_threshold}",
      f"--max-new-tokens={sizes.completion_tokens}",
      f"--batch-size={sizes.eval_batch}",
      "--overwrite",
  ]


def distill(sizes, run: pathlib.Path, log, parent=None) -> dict[str, Any]:
  """Writes RUN/distilled.jsonl (or `parent`'s own decodes); its cost.

  The cost is inference: decoding batches x batch x tokens per row.
  """
  args = (
      distill_args(sizes, run)
      if parent is None
      else self_distill_args(sizes, run, parent)
  )
  seconds = run_cli(["distill-data", *args], log)
  num_prompts = sum(
      1 for line in (run / DISTILL_PROMPTS).open() if line.strip()
  )
  batches = -(-num_prompts // sizes.eval_batch)
  return compute(
      "distill-data", batches, sizes.eval_batch, row_tokens(sizes), seconds
  )


def export(run: pathlib.Path, name: str, log) -> float:
  """RUN/NAME -> RUN/NAME_hf (replaced), the next sft stage's model.path."""
  shutil.rmtree(run / f"{name}_hf", ignore_errors=True)
  return run_cli(["export", str(run / name), str(run / f"{name}_hf")], log)


def certainty_label(multiple: float) -> str:
  """`+certainty`, or `+certainty xN` for a heavier term."""
  return "+certainty" + ("" if multiple == 1.0 else f" x{multiple:g}")


def run_stage(sizes, run: pathlib.Path, stage: Stage, log) -> dict[str, Any]:
  """Runs one stage into a fresh RUN/NAME; its compute record."""
  shutil.rmtree(run / stage.name, ignore_errors=True)
  if stage.command == "sft":
    seconds = run_cli(["sft", *sft_args(sizes, run, stage)], log)
    steps = sft_steps(sizes, stage)
    label = "sft" + "".join(
        suffix
        for suffix, on in (
            ("+lora", stage.lora),
            ("+kd", stage.distilled),
            ("+self", stage.self_distilled),
            (certainty_label(stage.certainty), stage.certainty),
        )
        if on
    )
    record = compute(label, steps, sizes.sft_batch, row_tokens(sizes), seconds)
  elif stage.command == "opd":
    seconds = run_cli(["opd", *opd_args(sizes, run, stage)], log)
    record = compute(
        "opd", sizes.opd_steps, sizes.opd_prompts, row_tokens(sizes), seconds
    )
  else:
    raise ValueError(f"unknown stage command {stage.command!r}")
  return record


def run_all(
    sizes, run: pathlib.Path, log, stages=STAGES, sources=None
) -> dict[str, Any]:
  """Runs every stage once (parents first); the compute per model.

  Args:
    sizes: The benchmark's `Sizes`.
    run: RUN, holding `ar_base`, `ar_peer` and the jsonl files.
    log: A one-line logger.
    stages: The stages to report; their parents (from `STAGES`) run first.
    sources: Source name -> the compute record of its training (`ar_peer`:
      its causal fine-tuning), the first record of a chain from it.

  Returns:
    name -> `{"stages": [records along its chain], "extra_token_slots":
    training token slots beyond its first stage, "distill_token_slots":
    the distillation data's generation (the AR peer's and, for a
    self-distillation stage, its parent's), when its chain uses it}`.
  """
  records: dict[str, dict] = {}
  exported: set[str] = set()
  distilled = None
  self_distilled: dict[str, dict] = {}
  for stage in stages:
    for step in chain(stage.name):
      if step.name in records:
        continue
      if step.distilled and distilled is None:
        distilled = distill(sizes, run, log)
      if step.self_distilled:
        self_distilled[step.name] = distill(sizes, run, log, step.parent)
      if step.command == "sft" and step.parent and step.parent not in exported:
        export(run, step.parent, log)
        exported.add(step.parent)
      records[step.name] = run_stage(sizes, run, step, log)
  out = {}
  sources = sources or {}
  for stage in stages:
    path = chain(stage.name)
    steps = [records[s.name] for s in path]
    if path[0].source in sources:
      steps = [sources[path[0].source], *steps]
    uses_kd = any(s.distilled for s in path)
    decodes = [self_distilled[s.name] for s in path if s.self_distilled]
    out[stage.name] = {
        "stages": steps,
        "extra_token_slots": sum(s["token_slots"] for s in steps[1:]),
        "distill_token_slots": (
            (distilled["token_slots"] if uses_kd else 0)
            + sum(d["token_slots"] for d in decodes)
        ),
        "train_seconds": sum(s["seconds"] for s in steps),
    }
    if uses_kd:
      out[stage.name]["distill"] = distilled
    if decodes:
      out[stage.name]["self_distill"] = decodes
  return out
