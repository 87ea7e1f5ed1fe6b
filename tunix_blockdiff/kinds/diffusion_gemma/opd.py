"""`tunix-blockdiff opd` on a DiffusionGemma student: sequence-level OPD.

`jobs/opd.py` hands a recipe here when `student.checkpoint` is a
DiffusionGemma policy (`kinds.diffusion_gemma.rl.policy_recipe`: a
DiffusionGemma sft run, an rl/opd run on one, or an HF DiffusionGemma
directory). The teacher is autoregressive, frozen while the student trains:

- `teacher.kind: ar` (default): the opd job's in-job Tunix Qwen3, trained
  with the next-token loss on the student's task and with the student's
  own tokenizer, so the two share every id by construction;
- `teacher.kind: hf`: `teacher.path`, a Hugging Face checkpoint of any
  family the package loads. Its tokenizer must agree with the student's
  (vocabulary size, tokenizer length, pad/EOS/BOS ids), checked before
  anything runs (`runs.hf_teacher.check_tokenizers_agree`).

**Objective.** A DiffusionGemma trajectory resamples the whole canvas at
every step and can revise any token, so the student has no per-token
distribution over its final tokens to hold against the teacher's (what
`bd_opd` compares). The job instead minimises the teacher's cross-entropy
per token on the student's own completions,

    L(theta) = E_{tau ~ pi_theta} [ -(1/|y|) log p_T(y(tau) | x) ],

where y(tau) is the completion a trajectory tau ends with (through its
first EOS, EOS included). Per token this is the reverse KL of the
student's completions to the teacher plus their entropy, so it is
mode-seeking; `opd.reference_kl` (the KL to the initial student, as GRPO's
beta) holds the student near where it started. The gradient is the exact
one of the sampler's trajectory distribution: each rollout's reward is its
teacher log-likelihood per token, group-normalised over
`opd.num_generations` rollouts of a prompt, in `dg_grpo`'s clipped
sequence-level surrogate (`kinds/diffusion_gemma/grpo.py`).

Recipe keys: `opd.steps`, `prompts_per_step`, `micro_batch_prompts`,
`num_generations` (>= 2 here), `reference_kl`, `learning_rate`,
`grad_clip`, `checkpoint_every_n_steps`, `max_checkpoints`, and the
`teacher`, `eval`, `rollout.max_tokens_to_generate`,
`rollout.max_prompt_length` and `dataset` sections as for block-diffusion
students. Keys that do not apply: `opd.divergence`, `opd.estimator`,
`opd.beta`, `opd.temperature`, `opd.likelihood`, `rollout.threshold` and
`rollout.temperature` (the student's sampler section applies). One
process only.

Writes `summary.json`: `divergence_start` / `divergence_end` (the teacher's
cross-entropy per token of the student's sampled held-out completions,
`divergence_kind: teacher_cross_entropy`, with standard errors
`divergence_se_start` / `_end`), `student_exact_match_start` /
`_end` (sampled: the sampler has no greedy mode), `teacher_exact_match`,
`train_teacher_logprob` (per step), and the trained student in `policy/`.
"""

from __future__ import annotations

from typing import Any, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff import arrays
from tunix_blockdiff import errors
from tunix_blockdiff.runs import ar_teacher
from tunix_blockdiff.runs import common
from tunix_blockdiff.kinds.diffusion_gemma import sft as dg_job
from tunix_blockdiff.kinds.diffusion_gemma import rl as dg_rl
from tunix_blockdiff.runs import hf_teacher
from tunix_blockdiff.runs import rl_checkpoints
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.runs import rl_reward
from tunix_blockdiff.rl import opd as opd_lib
from tunix_blockdiff.rollout import prompts as prompts_lib

Mode = rl_cluster_lib.Mode


class TeacherLogProb:
  """Reward: an AR teacher's mean log-probability per completion token.

  Called as a Tunix reward function: `(prompts, completions, **columns) ->
  list[float]`. Each prompt is encoded as the rollouts encode it (BOS,
  left-padded to `max_prompt_length`), each completion as its ids plus EOS
  (cut to `max_new_tokens + 1`); the teacher scores the completion in its
  own causal context (`rl.opd.ar_teacher_logits`). One compiled program.
  """

  def __init__(self, teacher: nnx.Module, tokenizer, *,
               max_prompt_length: int, max_new_tokens: int):
    self._tokenizer = tokenizer
    self._width = int(max_prompt_length)
    self._length = int(max_new_tokens) + 1
    graphdef, self._state = nnx.split(teacher)

    @jax.jit
    def score(state, prompt_tokens, prompt_mask, completion, completion_mask):
      model = nnx.merge(graphdef, state)
      logits = opd_lib.ar_teacher_logits(
          model, prompt_tokens, prompt_mask, completion, completion_mask)
      logp = jax.nn.log_softmax(logits, axis=-1)
      token_logp = jnp.take_along_axis(logp, completion[..., None], -1)[..., 0]
      weight = completion_mask.astype(jnp.float32)
      return (token_logp * weight).sum(-1) / jnp.maximum(weight.sum(-1), 1.0)

    self._score = score

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               **unused_columns) -> list[float]:
    encoded = prompts_lib.tokenize_prompts(
        self._tokenizer, list(prompts), self._width)
    slots = np.arange(self._width)[None]
    prompt_mask = slots >= self._width - encoded.lengths[:, None]
    eos = int(self._tokenizer.eos_id())
    completion = np.full((len(completions), self._length),
                         int(self._tokenizer.pad_id()), np.int32)
    mask = np.zeros(completion.shape, bool)
    for row, text in enumerate(completions):
      ids = [*self._tokenizer.encode(text), eos][:self._length]
      completion[row, :len(ids)] = ids
      mask[row, :len(ids)] = True
    return np.asarray(self._score(
        self._state, arrays.asarray(encoded.tokens),
        arrays.asarray(prompt_mask), arrays.asarray(completion),
        arrays.asarray(mask))).astype(float).tolist()


def _check(cfg) -> None:
  if cfg.get("distributed") is not None:
    raise errors.UsageError(
        "opd on a DiffusionGemma student runs in one process: set"
        " distributed to null")
  if int(cfg.opd.get("num_generations", 1)) < 2:
    raise errors.UsageError(
        "opd on a DiffusionGemma student needs opd.num_generations >= 2"
        " (rollouts per prompt: the group baseline of its sequence-level"
        f" objective), got {cfg.opd.get('num_generations', 1)}")
  checkpoint = cfg.student.get("checkpoint")
  if dg_job.is_hf_dir(str(checkpoint)) and cfg.get("dataset") is None:
    raise errors.UsageError(
        "opd on an HF DiffusionGemma directory needs dataset (prompt rows):"
        " the directory has no task to draw prompts from")


def run(cfg) -> dict[str, Any]:
  """The opd job on a DiffusionGemma student; returns its summary."""
  clock = common.Stopwatch()
  hf_teacher.check_teacher_section(cfg.teacher)
  _check(cfg)
  kind = hf_teacher.teacher_kind(cfg.teacher)
  student, policy_cfg, defaults, sft_step = dg_rl.load_policy(cfg.student)
  tokenizer = common.build_tokenizer(policy_cfg.tokenizer, policy_cfg.model)
  vocab_size = int(student.config.vocab_size)
  if kind == "hf":  # The tokenizers agree before anything runs.
    hf_teacher.check_tokenizers_agree(
        cfg.teacher.path, tokenizer, vocab_size=vocab_size,
        mask_token_id=None)
  out = common.prepare_output_dir(cfg)
  opd_cfg = cfg.opd
  every, keep = rl_checkpoints.checkpoint_every(opd_cfg, "opd")
  resume = rl_checkpoints.load_resume(out) if every else None
  mesh = rl_common.rl_mesh(cfg.get("mesh"))
  student = common.shard_model(student, mesh)
  sampler = dg_job.sampler_config(policy_cfg.get("sampler"), defaults,
                                  tokenizer)
  steps = int(opd_cfg.steps)
  prompts_per_step = int(opd_cfg.prompts_per_step)
  generations = int(opd_cfg.num_generations)
  num_teacher = int(cfg.teacher.num_train) if kind == "ar" else 0
  prompts = rl_data.recipe_prompts(
      cfg, policy_cfg, tokenizer,
      num_train=num_teacher + steps * prompts_per_step,
      num_held_out=int(cfg.eval.num_prompts), seed=int(cfg.seed) + 2000)
  cfg.rollout.max_prompt_length, prompt_truncation = rl_data.size_prompts(
      cfg, tokenizer, prompts, job="opd")
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  splash_tile = dg_rl.scoring_splash_tile(cfg, policy_cfg, mesh, student)
  reward_fn = rl_reward.recipe_reward(cfg, prompts)

  teacher_clock = common.Stopwatch()
  if kind == "hf":
    teacher, teacher_losses = hf_teacher.load_teacher(cfg.teacher, mesh), None
  else:
    teacher, teacher_losses = ar_teacher.train_ar_teacher(
        cfg.teacher, tokenizer, vocab_size,
        rl_data.prompt_pairs(prompts.train[:num_teacher]),
        seq_len=int(policy_cfg.data.seq_len), seed=int(cfg.seed) + 7,
        mesh=mesh,
        checkpoint_dir=(
            str(out / rl_checkpoints.CHECKPOINT_SUBDIR / "teacher")
            if every else None))
    if resume:
      teacher_losses = np.asarray(resume[0]["teacher_losses"], np.float64)
  teacher_seconds = teacher_clock()
  teacher_em = ar_teacher.teacher_exact_match(
      teacher, tokenizer, reward_fn, prompts.held_out,
      max_new_tokens=max_new_tokens,
      max_prompt_length=int(cfg.rollout.max_prompt_length))
  teacher_logprob = TeacherLogProb(
      teacher, tokenizer, max_prompt_length=int(cfg.rollout.max_prompt_length),
      max_new_tokens=max_new_tokens)
  train_logprobs: list[float] = (
      list(resume[1]["train_rewards"]) if resume else [])

  cluster, learner = dg_rl.grpo_learner(
      cfg, opd_cfg, out, mesh, student, tokenizer, sampler,
      rl_common.tracked_reward(teacher_logprob, train_logprobs),
      generations=generations, iterations=1,
      beta=float(opd_cfg.reference_kl), epsilon=0.2, max_steps=steps,
      description="DiffusionGemma OPD", checkpoints=(every, keep),
      splash_tile=splash_tile)
  trainer = cluster.actor_trainer
  rl_checkpoints.track_state(trainer, out, every, lambda: {
      "rollout_calls": cluster.rollout.calls,
      "train_rewards": list(train_logprobs),
  })
  common.show_progress(trainer, max(1, steps // 10), steps, out)

  def evaluate() -> dict[str, float]:
    completions: list[dict[str, str]] = []
    with mesh:
      exact = rl_common.evaluate_rewards(
          cluster, prompts.held_out, reward_fn,
          samples=int(cfg.eval.get("samples_per_prompt", 1)), mode=Mode.EVAL,
          batch_size=int(cfg.eval.batch_size), completions=completions)
    scores = []
    batch = int(cfg.eval.batch_size)
    for i in range(0, len(completions), batch):
      chunk = completions[i:i + batch]
      scores.extend(teacher_logprob([c["prompt"] for c in chunk],
                                    [c["completion"] for c in chunk]))
    return {"exact_match": exact,
            "divergence": -float(np.mean(scores)),
            "divergence_se": float(np.std(scores) / np.sqrt(len(scores))),
            "completions": completions[:8]}

  start = rl_checkpoints.start_evaluation(
      out, resume, every, cluster.rollout, evaluate,
      teacher_losses=([] if teacher_losses is None
                      else np.asarray(teacher_losses).tolist()))
  opd_clock = common.Stopwatch()
  with mesh:
    learner.train(list(rl_data.prompt_batches(
        prompts.train[num_teacher:], prompts_per_step)))
  opd_seconds = opd_clock()
  with mesh:
    rl_checkpoints.save_policy(out, trainer.model, policy_cfg,
                               trainer.train_steps)
  end = evaluate()
  per_step = prompts_per_step * generations
  step_logprobs = rl_common.per_step_means(train_logprobs, per_step)
  summary = {
      "policy_family": "diffusion_gemma",
      "scoring_attention": "splash" if splash_tile else "dense",
      "scoring_attention_tile": splash_tile,
      "prompt_truncation": prompt_truncation,
      "divergence_kind": "teacher_cross_entropy",
      "divergence_start": start["divergence"],
      "divergence_end": end["divergence"],
      # Standard errors over the held-out completions.
      "divergence_se_start": start.get("divergence_se"),
      "divergence_se_end": end["divergence_se"],
      "student_exact_match_start": start["exact_match"],
      "student_exact_match_end": end["exact_match"],
      "samples_end": end["completions"],
      "teacher_kind": kind,
      "teacher_exact_match": teacher_em,
      "teacher_final_loss": (None if teacher_losses is None
                             or not len(teacher_losses)
                             else float(np.asarray(teacher_losses)[-1])),
      "train_teacher_logprob": step_logprobs,
      "steps": steps,
      "optimizer_steps": trainer.train_steps,
      "rollouts": steps * per_step,
      "held_out_prompts": len(prompts.held_out),
      "prompts_source": prompts.source,
      "sampler": dict(sampler.__dict__),
      "teacher_seconds": teacher_seconds,
      "opd_seconds": opd_seconds,
      "seconds": clock(),
      "student": {"checkpoint": str(cfg.student.checkpoint),
                  "checkpoint_step": sft_step},
      "recipe": common.to_dict(cfg),
  }
  common.write_summary(out, summary)
  return summary


__all__ = ["TeacherLogProb", "run"]
