"""Every job's one validation pass (`check_recipe`), and the rl/opd schemas.

`check_recipe` validates a resolved recipe against its job's schema
(`runs.schema`): sft's comes from the recipe's model kind (`runs.sections`
for converted causal LMs, DiffusionGemma's beside its kind), rl's and
opd's are below.

`init` (rl) and `student` (opd) name the policy: a run to start from
(checked to hold a recipe and a checkpoint, or a directory a model kind
recognises, such as a Hugging Face DiffusionGemma), or the warm start's sft
recipe and overrides, which are validated as an sft recipe of their own.
`rollout`, `grpo`, `opd`, `teacher`, `eval` and `dataset` are checked key
by key, with the rules between them (micro-batches that divide a step,
greedy rollouts that need `likelihood: committed_only`, sub-blocks that
divide the policy's block).
"""

from __future__ import annotations

import omegaconf

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import errors
from tunix_blockdiff.rl import divergence as divergence_lib
from tunix_blockdiff.rl import grpo as grpo_lib
from tunix_blockdiff.rl import likelihood as likelihood_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import kinds
from tunix_blockdiff.runs import prompt_files
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import recipe_paths
from tunix_blockdiff.runs import schema as s
from tunix_blockdiff.runs import sections


def policy_recipe(section, key: str) -> omegaconf.DictConfig | None:
  """The sft recipe of the policy an `init`/`student` section names.

  A run's saved recipe, or the warm start's (its overrides applied and the
  whole validated as an sft recipe); None for a directory that a model kind
  other than the default recognises (its job reads it).

  Raises:
    UsageError: a checkpoint that is no run, or a warm start recipe that
      breaks the sft schema (named as `KEY.sft_overrides`).
  """
  checkpoint = section.get("checkpoint")
  if checkpoint is None:
    overrides = [str(o) for o in section.get("sft_overrides") or []]
    try:
      cfg = common.load_recipe([str(section["sft_recipe"]), *overrides])
      check_recipe(common.to_dict(cfg), "sft")
    except errors.UsageError as e:
      raise errors.UsageError(
          f"{key}.sft_recipe/{key}.sft_overrides (the warm start's sft"
          f" recipe): {e}") from None
    return cfg
  if kinds.of_policy(omegaconf.OmegaConf.create(dict(section))) is not (
      kinds.get(kinds.DEFAULT)):
    return None  # Another kind's directory (e.g. a Hugging Face one).
  path = recipe_paths.check_run_dir(f"{key}.checkpoint", checkpoint)
  return omegaconf.OmegaConf.load(
      rl_checkpoints.policy_dir(path) / common.RECIPE_FILE)


def policy_section(key: str) -> s.Section:
  """`init` (rl) or `student` (opd)."""
  return s.section({
      "checkpoint": s.text(null=True),
      "output_subdir": s.text(),
      "sft_recipe": s.text(),
      "sft_overrides": s.sequence(s.text(), null=True),
  }, required=True)  # The policy itself: `_rollout_fits_policy`.


def _reward(value, key):
  del key
  spec = value.get("reward")
  if spec is not None:
    from tunix_blockdiff.runs import rl_reward  # pylint: disable=g-import-not-at-top

    rl_reward.load_reward_fn(str(spec), columns=None)


ROLLOUT = s.section({
    **sections.DECODING,
    "max_tokens_to_generate": s.integer(1, required=True),
    "max_prompt_length": s.integer(1, null=True),
    "attention": s.choice(*config_lib.ATTENTION_IMPLEMENTATIONS, null=True),
    "attention_tile": s.integer(128, null=True),
}, sections.attention_keys, required=True)

_LIKELIHOOD = s.choice(*likelihood_lib.LIKELIHOODS)
_CHECKPOINTS = {
    "checkpoint_every_n_steps": s.integer(1, null=True),
    "max_checkpoints": s.integer(1),
}
_OPTIMIZER = {
    "learning_rate": s.number(0, low_open=True, required=True),
    "grad_clip": s.number(0),
    "adam_b2": s.number(0, 1, high_open=True),
    "weight_decay": s.number(0),
}


def _micro_batches(value, key):
  per_step, micro = value["prompts_per_step"], value.get(
      "micro_batch_prompts", value["prompts_per_step"])
  if per_step % micro:
    raise s.refuse(f"{key}.micro_batch_prompts", micro,
                   f"must divide {key}.prompts_per_step={per_step}")


def _one_iteration_checkpoints(value, key):
  if (value.get("checkpoint_every_n_steps") is not None
      and value.get("num_iterations", 1) != 1):
    raise s.refuse(f"{key}.checkpoint_every_n_steps",
                   value["checkpoint_every_n_steps"],
                   f"needs {key}.num_iterations=1 (Tunix's resume skips"
                   " num_iterations times too many prompts) or null")


GRPO = s.section({
    "steps": s.integer(1, required=True),
    "prompts_per_step": s.integer(1, required=True),
    "num_generations": s.integer(2, required=True),
    "num_iterations": s.integer(1),
    "micro_batch_prompts": s.integer(1),
    "beta": s.number(0),
    "epsilon": s.number(0, low_open=True),
    "loss_agg_mode": s.choice(*grpo_lib.LOSS_AGG_MODES),
    "likelihood": _LIKELIHOOD,
    **_OPTIMIZER,
    **_CHECKPOINTS,
}, _micro_batches, _one_iteration_checkpoints, required=True)

OPD = s.section({
    "steps": s.integer(1, required=True),
    "prompts_per_step": s.integer(1, required=True),
    "micro_batch_prompts": s.integer(1),
    "divergence": s.choice(*divergence_lib.DIVERGENCES),
    "estimator": s.choice(*divergence_lib.ESTIMATORS),
    "beta": s.probability(),
    "temperature": s.number(0, low_open=True),
    "likelihood": _LIKELIHOOD,
    "num_generations": s.integer(1),
    "reference_kl": s.number(0),
    **_OPTIMIZER,
    **_CHECKPOINTS,
}, _micro_batches, required=True)


def _teacher(value, key):
  del key
  from tunix_blockdiff.runs import hf_teacher  # pylint: disable=g-import-not-at-top

  hf_teacher.check_teacher_section(omegaconf.OmegaConf.create(dict(value)))


TEACHER = s.section({
    "kind": s.choice("ar", "hf", required=True),
    "path": s.text(null=True),
    "dtype": s.choice(*sections.DTYPES),
    "eos_token": s.text(null=True),
    "random_mlp": s.boolean(null=True),
    **{k: s.integer(1, null=True) for k in (
        "num_layers", "embed_dim", "hidden_dim", "num_heads", "head_dim",
        "num_kv_heads", "steps", "batch_size", "num_train")},
    "warmup_steps": s.integer(0, null=True),
    "learning_rate": s.number(0, low_open=True, null=True),
}, _teacher, required=True)

RL_EVAL = s.section({
    "num_prompts": s.integer(1, required=True),
    "samples_per_prompt": s.integer(1),
    "batch_size": s.integer(1, required=True),
}, required=True)


def _rl_dataset(value, key):
  """The section's own checks (`rl_data`); its files hold a prompt row."""
  del key
  dataset = value.get("dataset")
  if dataset is None:
    return
  checked = prompt_files.check_dataset_section(
      omegaconf.OmegaConf.create(dict(dataset)))
  prompt_files.check_prompt_files(checked,
                                  need_answer=value.get("reward") is None)


RL_DATASET = s.Section(sections.DATASET.keys, sections.DATASET.rules,
                       null=True)


def _rollout_fits_policy(policy_key: str, algo_key: str):
  """The policy (`policy_recipe`, read and checked once), then the rules
  between the rollout, the algorithm and the policy's recipe.

  Those rules are the block-diffusion rollout's; another kind's policy (a
  DiffusionGemma run or directory, whose sampler ignores these keys) is
  left to its own job.
  """

  def rule(value, key):
    del key
    policy = policy_recipe(value[policy_key], policy_key)
    if policy is None or kinds.of_recipe(policy) is not kinds.get(
        kinds.DEFAULT):
      return
    rollout, algo = value["rollout"], value[algo_key]
    if (rollout.get("temperature", 1.0) == 0
        and algo.get("likelihood", "exact") == "exact"):
      raise s.refuse(f"{algo_key}.likelihood", "exact",
                     "must be committed_only with rollout.temperature=0"
                     " (greedy rollouts have no density)")
    sub = rollout.get("sub_block_size")
    if sub is not None and rollout.get("steps_per_block") is not None:
      raise s.refuse("rollout.sub_block_size", sub,
                     "must be null with rollout.steps_per_block (sub-blocks"
                     " take the threshold rule)")
    block = int(policy.diffusion.block_size)
    if sub is not None and block % sub:
      raise s.refuse("rollout.sub_block_size", sub,
                     f"must divide the policy's block size {block}")

  return rule


_RL_BASE = {**sections.BASE, "reward": s.text(null=True),
            "dataset": RL_DATASET, "rollout": ROLLOUT}
RL = s.section(
    {**_RL_BASE, "init": policy_section("init"), "grpo": GRPO,
     "eval": RL_EVAL},
    sections.output_dir_rule, _reward, _rl_dataset,
    _rollout_fits_policy("init", "grpo"))
OPD_RECIPE = s.section(
    {**_RL_BASE, "student": policy_section("student"), "teacher": TEACHER,
     "opd": OPD,
     "eval": s.section({"num_prompts": s.integer(1, required=True),
                        "batch_size": s.integer(1, required=True)},
                       required=True)},
    sections.output_dir_rule, _reward, _rl_dataset,
    _rollout_fits_policy("student", "opd"))


def _check_model_kind(recipe) -> None:
  """`model.kind` is one that some kind's sft schema takes (it picks it)."""
  model = recipe.get("model")
  if not isinstance(model, dict):
    raise s.refuse("model", model, "must be a section {kind: ..., ...}")
  known = [choice for name in kinds.names()
           for choice in kinds.get(name).sft_schema().keys["model"].keys[
               "kind"].choices]
  kind = model.get("kind")
  if kind not in known:
    raise errors.UsageError(
        f"model.kind={s.show(kind)} is not valid: model.kind must be one of"
        f" {known}" + errors.nearest(str(kind), known))


def check_recipe(recipe, command: str) -> None:
  """Validates a resolved recipe (plain Python) of `command` in one pass.

  `sft` uses the schema of the recipe's model kind (`runs.kinds`), `rl`
  and `opd` theirs (whatever the policy's kind).

  Raises:
    UsageError: the first key that breaks its rule, in one line.
  """
  if command == "sft":
    _check_model_kind(recipe)
    schema = kinds.of_recipe(omegaconf.OmegaConf.create(
        {"model": recipe.get("model")})).sft_schema()
  else:
    schema = {"rl": RL, "opd": OPD_RECIPE}[command]
  s.validate(recipe, schema)


__all__ = ["GRPO", "OPD", "OPD_RECIPE", "RL", "ROLLOUT", "TEACHER",
           "check_recipe", "policy_recipe", "policy_section"]
