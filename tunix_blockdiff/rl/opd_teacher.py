"""On-policy distillation: the teacher's logits on a student's trajectories.

An autoregressive Tunix teacher (`teacher_kind='ar'`) sees the prompt and the
student's completion before each token (causal next-token logits); a
block-diffusion teacher (`'block_diffusion'`) scores the same trajectory
canvases as the student (`rl.scoring`). Scored tokens: the student's
completion up to and including its first EOS (`through_first_eos`).
`rl.opd` re-exports every name here.

Shapes: B batch, P prompt, N completion, V vocabulary.
"""

from __future__ import annotations

from typing import Any
import weakref

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import utils as rl_utils

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import distributed
from tunix_blockdiff.attention import masks
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.rl import scoring

TEACHER_KINDS = ("ar", "block_diffusion")


def ar_teacher_logits(
    teacher,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    completion_tokens: jax.Array,
    completion_mask: jax.Array,
) -> jax.Array:
  """An autoregressive teacher's next-token logits at each completion slot.

  Args:
    teacher: Tunix causal LM.
    prompt_tokens: int [B, P] left-padded prompts.
    prompt_mask: bool [B, P].
    completion_tokens: int [B, N] the student's tokens.
    completion_mask: bool/int [B, N] slots the teacher sees (a prefix: the
      completion up to its first EOS); later slots are invisible.

  Returns:
    float32 [B, N, V]: slot j holds the teacher's logits for token j given
    the prompt and completion tokens 0..j-1.
  """
  prompt_mask = jnp.asarray(prompt_mask, jnp.bool_)
  seen = jnp.asarray(completion_mask) > 0
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1).astype(
      jnp.int32
  )
  validity = jnp.concatenate([prompt_mask, seen], axis=1)
  positions = jnp.maximum(jnp.cumsum(validity.astype(jnp.int32), axis=1) - 1, 0)
  # Causal = block-causal with blocks of one slot.
  mask = masks.block_causal_mask(positions, positions, 1, kv_valid=validity)
  logits = modeling.call_model(teacher, tokens, positions, mask)
  width = prompt_tokens.shape[1]
  num_new = completion_tokens.shape[1]
  return logits[:, width - 1 : width - 1 + num_new].astype(jnp.float32)


_TEACHERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def teacher_logits(
    teacher,
    teacher_kind: str,
    student_batch,
    config: config_lib.DenoiseConfig,
) -> jax.Array:
  """Teacher logits float32 [B, N, V] for a student trajectory batch (jitted).

  Args:
    teacher: Tunix model (causal LM for `ar`, block-diffusion for
      `block_diffusion`).
    teacher_kind: `ar` or `block_diffusion`.
    student_batch: From `scoring.prepare_trajectory_batch`; its
      `loss_weights` mark the completion the AR teacher sees.
    config: The student rollout's `DenoiseConfig` (canvases of a
      block-diffusion teacher).
  """
  if teacher_kind not in TEACHER_KINDS:
    raise ValueError(
        f"teacher_kind must be one of {TEACHER_KINDS}, got {teacher_kind!r}"
    )
  graphdef, state = nnx.split(teacher)
  per_model = _TEACHERS.setdefault(teacher, {})
  key = (teacher_kind, config)
  entry = per_model.get(key)
  if entry is None or entry[0] != graphdef:
    logits_fn = scoring.trajectory_logits_fn_for(config)

    def run(state, model_inputs, loss_weights):
      model = nnx.merge(graphdef, state)
      if teacher_kind == "ar":
        return ar_teacher_logits(
            model,
            model_inputs["prompt_tokens"],
            model_inputs["prompt_mask"],
            model_inputs["completion_tokens"],
            loss_weights,
        )
      return logits_fn(model, model_inputs)

    entry = (graphdef, jax.jit(run))
    per_model[key] = entry
  names = sorted(student_batch.model_inputs)

  def call(*arrays):
    return entry[1](state, dict(zip(names, arrays)), arrays[-1])

  # A teacher sharded over a mesh (the job's global mesh) scores rows
  # sharded over its fsdp axis; every process gets all the logits.
  return distributed.call_sharded(
      call,
      rl_utils.get_pytree_mesh_info(state),
      *(student_batch.model_inputs[k] for k in names),
      student_batch.loss_weights,
  )


def through_first_eos(commit_step, tokens, eos_id: int) -> np.ndarray:
  """bool [B, N]: committed slots up to and including each row's first EOS."""
  commit_step = np.asarray(commit_step)
  tokens = np.asarray(tokens)
  committed = commit_step >= 0
  is_eos = committed & (tokens == eos_id)
  width = tokens.shape[1]
  first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), width)
  return committed & (np.arange(width)[None, :] <= first[:, None])
