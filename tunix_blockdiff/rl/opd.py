"""On-policy distillation (OPD) into a block-diffusion student.

The student generates with the block-diffusion rollout; a teacher scores the
student's own tokens in the teacher's context; the student is trained to
lower a per-token divergence to the teacher (`rl.divergence`): reverse KL
(default), forward KL or generalized JSD, exactly over the vocabulary
(`estimator='full'`) or from the sampled token (`'sampled_token'`), at a
temperature.

* Student distribution at a token: the trajectory-exact one, i.e. the
  logits of the canvas of the step that committed it (`rl.scoring`).
* Teacher context: an autoregressive Tunix model (`teacher_kind='ar'`) sees
  the prompt and the student's completion before the token (causal
  next-token logits); a block-diffusion teacher (`'block_diffusion'`) scores
  the same trajectory canvases as the student.
* Scored tokens: the student's completion up to and including its first
  EOS (the text it produced).

`diffusion_opd_loss_fn` (name and first three arguments as in the Tunix
proposal, PR #1747) is the core loss; `bd_opd_loss_fn` wraps it in Tunix's
policy-loss API and is registered as `bd_opd`; `BlockDiffusionOPDLearner`
runs it inside Tunix's RL loop (`RLCluster` + rollout engine + actor
trainer).

The loss, `bd_opd_loss_fn` and `BlockDiffusionOPDConfig` live in
`rl.opd_loss`, the teacher scoring in `rl.opd_teacher`; both are
re-exported here (`registration` registers `bd_opd` as
`tunix_blockdiff.rl.opd.bd_opd_loss_fn`); this module holds the learner.

Shapes: B batch, P prompt, N completion, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Sequence
import weakref

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import rl_learner
from tunix.rl import utils as rl_utils

from tunix_blockdiff import arrays
from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff import models
from tunix_blockdiff.rl import cluster as cluster_lib
from tunix_blockdiff.rl import divergence as divergence_lib
from tunix_blockdiff.rl import grpo
from tunix_blockdiff.rl import learners
from tunix_blockdiff.rl import opd_loss
from tunix_blockdiff.rl import opd_teacher
from tunix_blockdiff.rl import scoring


# Re-exported from `rl.opd_loss` (the same objects: `registration` registers
# `bd_opd` as this module's `bd_opd_loss_fn`).
BlockDiffusionOPDConfig = opd_loss.BlockDiffusionOPDConfig
DiffusionDistillationBatch = opd_loss.DiffusionDistillationBatch
bd_opd_loss_fn = opd_loss.bd_opd_loss_fn
check_vocab_match = opd_loss.check_vocab_match
diffusion_opd_loss_fn = opd_loss.diffusion_opd_loss_fn

model_vocab_size = models.model_vocab_size

# Re-exported from `rl.opd_teacher` (the teacher's side).
TEACHER_KINDS = opd_teacher.TEACHER_KINDS
ar_teacher_logits = opd_teacher.ar_teacher_logits
teacher_logits = opd_teacher.teacher_logits
through_first_eos = opd_teacher.through_first_eos


# -----------------------------------------------------------------------------
# Tunix integration.
# -----------------------------------------------------------------------------



def _no_reward(prompts, completions, **unused_kwargs) -> list[float]:
  del completions, unused_kwargs
  return [0.0] * len(prompts)


class BlockDiffusionOPDLearner(learners.TraceLearnerMixin, rl_learner.RLLearner):
  """On-policy distillation inside Tunix's RL loop.

  Each step: the student (the cluster's actor, via `BlockDiffusionRollout`)
  generates; the teacher scores the student's tokens; the actor trainer
  minimises `bd_opd`. Reward functions are optional and only logged (e.g.
  exact match).
  """

  def __init__(
      self,
      rl_cluster: cluster_lib.BlockDiffusionRLCluster,
      algo_config: BlockDiffusionOPDConfig,
      teacher: nnx.Module,
      *,
      teacher_kind: str = "ar",
      reward_fns=None,
      metric_fns: Sequence[Any] | None = None,
      data_shuffle_seed: int | None = None,
  ):
    """Builds the learner.

    Args:
      rl_cluster: `BlockDiffusionRLCluster` whose actor is the student.
      algo_config: `BlockDiffusionOPDConfig`.
      teacher: The teacher model (kept frozen).
      teacher_kind: `ar` (causal LM) or `block_diffusion`.
      reward_fns: Optional reward functions, logged only.
      metric_fns: Optional metric functions (Tunix signature).
      data_shuffle_seed: Data shuffle seed.
    """
    from tunix_blockdiff import registration  # pylint: disable=g-import-not-at-top

    registration.register()
    self._check_cluster(rl_cluster)
    if not isinstance(algo_config, BlockDiffusionOPDConfig):
      raise TypeError(
          "algo_config must be a BlockDiffusionOPDConfig, got"
          f" {type(algo_config).__name__}"
      )
    if teacher_kind not in TEACHER_KINDS:
      raise ValueError(
          f"teacher_kind must be one of {TEACHER_KINDS}, got {teacher_kind!r}"
      )
    check_vocab_match(
        model_vocab_size(teacher), model_vocab_size(rl_cluster.rollout.model())
    )
    self._fill_denoise_config(algo_config, rl_cluster)
    super().__init__(
        rl_cluster=rl_cluster,
        algo_config=algo_config,
        reward_fns=reward_fns or [_no_reward],
        metric_fns=metric_fns,
        data_shuffle_seed=data_shuffle_seed,
    )
    self.teacher = teacher
    self.teacher_kind = teacher_kind
    policy_loss_fn = function_registry.get_policy_loss_fn(
        algo_config.policy_loss_fn
    )

    def loss_fn(model, train_example):
      return policy_loss_fn(
          model,
          train_example,
          algo_config=self.algo_config,
          pad_id=self.rl_cluster.rollout.pad_id(),
          eos_id=self.rl_cluster.rollout.eos_id(),
      )

    self.rl_cluster.actor_trainer.with_loss_fn(loss_fn, has_aux=True)
    self.rl_cluster.actor_trainer.with_gen_model_input_fn(
        lambda x: {"train_example": x}
    )
    self.rl_cluster.actor_trainer.with_rl_metrics_to_log({
        "divergence": np.mean,
        "teacher_logp": np.mean,
        "student_logp": np.mean,
    })

  def _generate_and_compute_advantage(
      self,
      training_input,
      mode: rl_cluster_lib.Mode = rl_cluster_lib.Mode.TRAIN,
  ) -> grpo.BlockDiffusionTrainExample:
    """Student rollout + teacher scores -> `BlockDiffusionTrainExample`."""
    output, prompt_ids, prompt_mask, commit_step = self._rollout(
        training_input, mode
    )
    config = self.algo_config.denoise_config
    trace_tokens = np.asarray(output.trace_tokens, np.int32)
    scored = through_first_eos(commit_step, trace_tokens, config.eos_token_id)
    student_batch = scoring.prepare_trajectory_batch(
        prompt_ids,
        prompt_mask,
        trace_tokens,
        commit_step,
        mask_token_id=config.mask_token_id,
        loss_weights=scored.astype(np.float32),
    )
    logits = teacher_logits(
        self.teacher, self.teacher_kind, student_batch, config
    )
    teacher_logps = None
    if self.algo_config.estimator == "sampled_token":
      log_probs = divergence_lib.log_probs(
          logits, self.algo_config.temperature, config.mask_token_id
      )
      teacher_logps = jnp.take_along_axis(
          log_probs,
          jnp.asarray(np.where(scored, trace_tokens, 0))[..., None],
          axis=-1,
      )[..., 0]
      logits = None
    rewards = self._compute_rewards(
        prompts=training_input["prompts"],
        completions=output.text,
        mode=mode,
        **{k: v for k, v in training_input.items() if k != "prompts"},
    )
    self._log_rollout_metrics(output, rewards, mode)
    for metric_fn in self.metric_fns:
      self.rl_cluster.buffer_metrics(
          metric_fn(
              prompts=training_input["prompts"],
              completions=output.text,
              rewards=rewards,
              advantages=np.zeros_like(rewards),
              **{k: v for k, v in training_input.items() if k != "prompts"},
          ),
          mode=mode,
      )
    return grpo.BlockDiffusionTrainExample(
        prompt_ids=arrays.asarray(prompt_ids),
        prompt_mask=arrays.asarray(prompt_mask),
        completion_ids=arrays.asarray(trace_tokens),
        completion_mask=arrays.asarray(scored.astype(np.int32)),
        advantages=arrays.asarray(np.zeros((len(trace_tokens),), np.float32)),
        ref_per_token_logps=None,
        old_per_token_logps=None,
        commit_step=arrays.asarray(commit_step),
        teacher_logits=logits,
        teacher_per_token_logps=teacher_logps,
    )

  def _compute_trajectory_ids(self, example, steps: int) -> list[str]:
    batch_size = len(example["prompts"])
    return [f"{steps * batch_size + i}_0" for i in range(batch_size)]

  def _num_iterations(self) -> int:
    return self.algo_config.num_iterations

  def _num_generations(self) -> int:
    return 1


def evaluate_divergence(
    student,
    teacher,
    teacher_kind: str,
    student_batch,
    config: config_lib.DenoiseConfig,
    *,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    attention=None,
) -> float:
  """Token-mean exact divergence (full vocabulary) of a student rollout batch.

  Args:
    student: The block-diffusion student.
    teacher: The teacher.
    teacher_kind: `ar` or `block_diffusion`.
    student_batch: `scoring.prepare_trajectory_batch` of the student's
      rollouts; `loss_weights` select the scored tokens.
    config: The student rollout's `DenoiseConfig`.
    divergence: `reverse_kl`, `forward_kl` or `jsd`.
    beta: `jsd` teacher weight.
    temperature: > 0.
    attention: The student call's `AttentionConfig` (None: dense).

  Returns:
    The weighted mean divergence over scored tokens (float).
  """
  logits = teacher_logits(teacher, teacher_kind, student_batch, config)
  graphdef, state = nnx.split(student)
  per_model = _DIVERGENCES.setdefault(student, {})
  key = (config, divergence, float(beta), float(temperature), attention)
  entry = per_model.get(key)
  if entry is None or entry[0] != graphdef:
    logits_fn = scoring.trajectory_logits_fn_for(config, attention)

    def run(state, model_inputs, target_ids, loss_weights, logits):
      out = diffusion_opd_loss_fn(
          nnx.merge(graphdef, state),
          DiffusionDistillationBatch(
              student_batch=type(student_batch)(
                  model_inputs=model_inputs,
                  target_ids=target_ids,
                  loss_weights=loss_weights,
              ),
              teacher_logits=logits,
          ),
          logits_fn,
          divergence=divergence,
          estimator="full",
          beta=beta,
          temperature=temperature,
          exclude_token_id=config.mask_token_id,
      )
      metric = out.aux_metrics["divergence"]
      return metric.unreduced_sum, metric.denominator

    entry = (graphdef, jax.jit(run))
    per_model[key] = entry
  names = sorted(student_batch.model_inputs)
  mesh = rl_utils.get_pytree_mesh_info(state)
  # Rows padded here with zero weight (not by `call_sharded`'s copies of the
  # last row), so the summed divergence counts every scored token once.
  rows = [
      *(student_batch.model_inputs[k] for k in names),
      student_batch.target_ids,
      np.asarray(student_batch.loss_weights, np.float32),
      logits,
  ]
  rows = distributed.pad_rows(rows, distributed.row_multiple(mesh))
  rows[-2][len(student_batch.target_ids) :] = 0.0

  def call(*values):
    inputs = dict(zip(names, values[: len(names)]))
    return entry[1](state, inputs, *values[len(names) :])

  # One jitted program over rows sharded like the teacher's: eager
  # per-op dispatch over a multi-process mesh can wait forever on gloo.
  total, count = distributed.call_sharded(call, mesh, *rows)
  return float(total) / float(count) if float(count) > 0 else 0.0


# Per student model: {(config, divergence, beta, temperature, attention): (graphdef,
# jitted per-batch divergence sums)}.
_DIVERGENCES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

__all__ = [
    "BlockDiffusionOPDConfig",
    "BlockDiffusionOPDLearner",
    "DiffusionDistillationBatch",
    "TEACHER_KINDS",
    "ar_teacher_logits",
    "bd_opd_loss_fn",
    "check_vocab_match",
    "diffusion_opd_loss_fn",
    "evaluate_divergence",
    "model_vocab_size",
    "teacher_logits",
    "through_first_eos",
]
