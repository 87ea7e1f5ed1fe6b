"""Block-diffusion generation with a Tunix model: `generate` (DESIGN.md 5.4).

`generate(model, prompt_tokens, prompt_lengths, config, max_new_tokens=N)`
runs either the exact block-KV-cached loop (`cached_loop`: each step calls
the model on one block-wide window per row against a cache of the row's clean
earlier blocks) or the cacheless `denoise` over full-sequence block-causal
logits; both give the same tokens and commit steps. The pieces live in
`result` (what it returns), `kv_cache` (caches per model family) and
`cached_loop` (the cached program); their public names are re-exported here.
"""

from __future__ import annotations

from concurrent import futures
import dataclasses
import numbers
import threading

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from tunix_blockdiff import arrays
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.models import logits as modeling
from tunix_blockdiff.models import programs
from tunix_blockdiff.rollout import cache_kernel
from tunix_blockdiff.rollout import cached_loop
from tunix_blockdiff.rollout import cached_state
from tunix_blockdiff.rollout import denoise as denoise_lib
from tunix_blockdiff.rollout import kv_cache
from tunix_blockdiff.rollout import result as result_lib
from tunix_blockdiff.rollout import sampling

GenerationResult = result_lib.GenerationResult
sequence_layout = result_lib.sequence_layout
init_cache = kv_cache.init_cache


def _cacheless_program(model, prompt_tokens, lengths, rng, config, num_new,
                       threshold):
  """`denoise` over full-sequence block-causal logits, as a GenerationResult."""
  lengths = lengths.astype(jnp.int32)
  placeholder = jnp.zeros((prompt_tokens.shape[0], num_new), jnp.int32)
  tokens, positions, validity, completion = sequence_layout(
      prompt_tokens, lengths, placeholder
  )
  logits_fn = modeling.make_logits_fn(
      model,
      block_size=config.block_size,
      alignment=config.alignment,
      validity=validity,
  )
  result, trace = denoise_lib.denoise_with_trace(
      logits_fn, tokens, positions, completion, validity, config, rng,
      threshold=threshold,
  )
  width = prompt_tokens.shape[1]
  return GenerationResult(
      tokens=result.tokens[:, width:],
      commit_step=result.commit_step[:, width:],
      logprobs=result.logprobs[:, width:],
      num_steps=result.num_steps,
      prompt_tokens=prompt_tokens,
      prompt_lengths=lengths,
      trace_tokens=trace.tokens[:, width:],
      trace_commit_step=trace.commit_step[:, width:],
      trace_logprobs=trace.logprobs[:, width:],
  )


# ----------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------

# The loop's programs, shared by every model with an equal GraphDef
# (`models.programs`).
_PROGRAMS: programs.ProgramCache = programs.ProgramCache(32)
# The one threshold of every program's config (`program_config`).
_PROGRAM_THRESHOLD = 1.0


def program_config(
    config: config_lib.DenoiseConfig) -> config_lib.DenoiseConfig:
  """`config` as a program sees it: the threshold is an operand instead.

  Every threshold of one config shares one program (an evaluation's
  threshold sweep compiles the loop once, not once per threshold): the
  program is built for this config, whose threshold is a fixed placeholder,
  and is passed `threshold_operand(config)` on every call.
  """
  return dataclasses.replace(config, threshold=_PROGRAM_THRESHOLD)


def threshold_operand(config: config_lib.DenoiseConfig) -> jax.Array:
  """float32 [] `config.threshold`, the programs' last operand."""
  return arrays.asarray(np.float32(config.threshold))


def _program(graphdef, key):
  """The jitted loop of (`graphdef`, `key`), traced on first use.

  `key[0]` is a `DenoiseConfig`, kept as `program_config` of it.
  """
  key = (program_config(key[0]), *key[1:])
  return _PROGRAMS.get(graphdef, key, lambda: _build(graphdef, key))


def _build(graphdef, key):
  """The jitted loop of (`graphdef`, `key`) (not yet traced)."""
  (config, num_new, use_cache, cache_phases, lockstep, ragged_cache,
   fused_head, one_program) = key

  def run(state, prompt_tokens, lengths, rng, threshold):
    merged = nnx.merge(graphdef, state)
    if use_cache:
      return cached_loop.cached_program(merged, prompt_tokens, lengths, rng,
                                        config, num_new, cache_phases,
                                        lockstep, ragged_cache, fused_head,
                                        threshold)
    return _cacheless_program(merged, prompt_tokens, lengths, rng, config,
                              num_new, threshold)

  if not use_cache or cache_phases == 1 or one_program:
    return jax.jit(run)
  return _staged(graphdef, key)


def _staged(graphdef, key):
  """The cached loop as one program per stage, driven from the host.

  One program holding every phase's copy of the loop body (the whole model)
  did not finish compiling in 10 minutes on a TPU v5e at 8 phases. Here the
  first call of a prompt shape lowers every stage and compiles them from a
  thread pool (XLA's compiler releases the GIL; `benchmarks/
  stage_compile.py`: 0.58x the time in turn on a v5e host, 4 phases). The
  loop state goes from one stage to the next donated, so its cache is
  updated in place.
  """
  (config, num_new, _, cache_phases, lockstep, ragged_cache, fused_head,
   _) = key
  init, phases, finish = stage_programs(graphdef, config, num_new,
                                        cache_phases, lockstep, ragged_cache,
                                        fused_head)
  compiled = set()  # the prompt shapes whose stages are compiled
  lock = threading.Lock()

  def run(state, prompt_tokens, lengths, rng, threshold):
    inputs = (state, prompt_tokens, lengths, rng, threshold)
    count = cached_state.num_phases(prompt_tokens.shape[1], num_new,
                                   config.block_size, cache_phases)
    programs_in_use = [init, *phases[:count], finish]
    shape = (prompt_tokens.shape, prompt_tokens.dtype, lengths.dtype)
    traced = any(isinstance(x, jax.core.Tracer)
                 for x in jax.tree.leaves(inputs))
    with lock:
      if not traced and shape not in compiled:
        _compile_in_threads(programs_in_use, inputs)
        compiled.add(shape)
    loop = init(*inputs)
    for phase in phases[:count]:
      loop = phase(loop, *inputs)
    return finish(loop, *inputs)

  return run


def stage_programs(graphdef, config, num_new: int, cache_phases: int,
                   lockstep: bool = False, ragged_cache: bool = False,
                   fused_head: bool = False):
  """(init, phases, finish): the cached loop's stages, each jitted.

  `phases[p]` runs phase p (`cache_phases` of them; a prompt width may
  use fewer, `cached_state.num_phases`) and is donated the loop state.
  Each takes `(loop state, model state, prompt_tokens, lengths, rng,
  threshold)` (`threshold_operand`); `init` the last five only.
  """

  def stages(state, prompt_tokens, lengths, rng, threshold):
    return cached_loop.cached_stages(
        nnx.merge(graphdef, state), prompt_tokens, lengths, rng, config,
        num_new, cache_phases, lockstep, ragged_cache, fused_head, threshold)

  init = jax.jit(lambda *inputs: stages(*inputs).init())
  phases = [
      jax.jit(lambda loop, *inputs, p=p: stages(*inputs).run_phase(loop, p),
              donate_argnums=0) for p in range(cache_phases)
  ]
  finish = jax.jit(lambda loop, *inputs: stages(*inputs).finish(loop))
  return init, phases, finish


def lower_stages(programs, inputs) -> list:
  """`[init, *phases, finish]` lowered for `inputs` (init's last five).

  The loop state they pass on is typed by `init`'s output shapes.
  """
  loop = jax.eval_shape(programs[0], *inputs)
  return [programs[0].lower(*inputs)] + [
      program.lower(loop, *inputs) for program in programs[1:]]


def _compile_in_threads(programs, inputs):
  """Lowers `[init, *phases, finish]` here, then compiles them in threads.

  A jitted function's later calls with these input shapes reuse what its
  `lower(...).compile()` compiled.
  """
  lowered = lower_stages(programs, inputs)
  with futures.ThreadPoolExecutor(len(lowered)) as pool:
    list(pool.map(lambda program: program.compile(), lowered))


def _check_generate_inputs(
    prompt_tokens, prompt_lengths, config, max_new_tokens, rng,
    cache_phases=1, lockstep=False, use_cache=True, ragged_cache=False,
    fused_head=False, one_program=False,
):
  if not isinstance(config, config_lib.DenoiseConfig):
    raise TypeError(
        f"config must be a DenoiseConfig, got {type(config).__name__}"
    )
  sampling.optional_positive_int("cache_phases", cache_phases)
  sampling.check_cached_modes(use_cache, lockstep=lockstep,
                              ragged_cache=ragged_cache,
                              fused_head=fused_head, one_program=one_program)
  if fused_head and (config.temperature > 0
                     or config.alignment != "same_position"):
    raise ValueError(
        "fused_head=True needs greedy proposals (temperature 0) and the"
        f" same_position alignment, got temperature {config.temperature} and"
        f" alignment {config.alignment!r}")
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, numbers.Integral
  ):
    raise TypeError(
        f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}"
    )
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompt_tokens = arrays.asarray(prompt_tokens)
  prompt_lengths = arrays.asarray(prompt_lengths)
  if prompt_tokens.ndim != 2:
    raise ValueError(
        "prompt_tokens must have shape [batch, prompt_width], got"
        f" {prompt_tokens.shape}"
    )
  if ragged_cache:
    cache_kernel.check_batch(prompt_tokens.shape[0])
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise TypeError(
        f"prompt_tokens must have an integer dtype, got {prompt_tokens.dtype}"
    )
  if prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(
        f"prompt_lengths must have shape [batch] = {prompt_tokens.shape[:1]},"
        f" got {prompt_lengths.shape}"
    )
  if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise TypeError(
        f"prompt_lengths must have an integer dtype, got {prompt_lengths.dtype}"
    )
  if config.temperature > 0 and rng is None:
    raise ValueError("rng (a PRNG key) is required when config.temperature > 0")
  # Checked on the host when the host holds them all (not under tracing,
  # nor for a global array spanning processes).
  if not isinstance(prompt_lengths, jax.core.Tracer) and (
      prompt_lengths.is_fully_addressable
  ):
    lengths = np.asarray(prompt_lengths)
    minimum = 1 if config.alignment == "shifted" else 0
    if np.any(lengths < minimum) or np.any(lengths > prompt_tokens.shape[1]):
      raise ValueError(
          f"prompt_lengths must lie in [{minimum}, prompt_width ="
          f" {prompt_tokens.shape[1]}]"
          + (" (alignment='shifted' needs a prompt)" if minimum else "")
          + f", got {lengths.tolist()}"
      )
  return prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32)


def generate(
    model,
    prompt_tokens,
    prompt_lengths,
    config: config_lib.DenoiseConfig,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    use_cache: bool = True,
    cache_phases: int = 1,
    lockstep: bool = False,
    ragged_cache: bool = False,
    fused_head: bool = False,
    one_program: bool = False,
) -> GenerationResult:
  """Block-diffusion generation with a Tunix model (DESIGN.md 5.4).

  The whole loop is one jitted program (one per stage with
  `cache_phases` > 1, unless `one_program`), compiled once per
  (architecture, config, shapes, modes) and reused: the model's current
  parameters and the config's threshold are passed in on every call, so
  updated weights and another threshold (an evaluation's sweep) need no
  recompilation, and another model with an equal `nnx.GraphDef` (a new
  instance, a reloaded checkpoint) reuses the program (the 32 most recent
  are kept).

  With `use_cache=True` each step runs the model on one block-wide window per
  row against the row's clean earlier blocks in the KV cache (see the module
  docstring); with `use_cache=False` it runs `denoise` over full-sequence
  block-causal logits (`make_logits_fn`). Both give the same tokens and commit
  steps up to floating-point near-ties.

  Args:
    model: A Tunix causal LM called as `model(tokens, positions, cache,
      attention_mask)` (Qwen3, Qwen2, Llama3, Gemma3). The cached driver
      needs dense attention (`use_flash_attention=False`) and, for a model
      with a sliding window (Gemma3), `ceil((P + N) / W) * W + W <= window`
      (`kv_cache.check_model_for_cache`); the cacheless path has no limit.
    prompt_tokens: int [B, P] prompts, LEFT-padded: row b's prompt is its last
      `prompt_lengths[b]` slots.
    prompt_lengths: int [B] in [0, P] ([1, P] with `shifted` alignment).
    config: `DenoiseConfig`.
    max_new_tokens: N >= 1 completion slots per row.
    rng: PRNG key; required when `config.temperature > 0`.
    use_cache: Cached driver (True) or cacheless `denoise` (False).
    cache_phases: >= 1 (None: 1). The cached driver's loop in that many phases, each
      reading only the prefix of the KV cache that its steps can use (its
      attention otherwise reads every slot at every step); the same tokens
      and commit steps up to floating-point near-ties (as between the
      cached and cacheless paths). Each stage (prefill, phases, result) is
      its own program, all compiled from a thread pool on the first call of
      a prompt shape (or one program: `one_program`). Whether it pays
      depends on the accelerator: `benchmarks/generation.py --cache-phases`
      times it.
    lockstep: The cached driver holds a row that has finished its block
      while any row is still inside its own, so the rows start their next
      blocks together: a step that writes a finished block runs the model
      on 2W slots for the whole batch, and rows out of phase (partial
      blocks, threshold schedules) otherwise make almost every step one.
      Greedy tokens, commit steps (each row's own steps) and log-probs are
      the default loop's up to floating-point near-ties; sampling draws
      differ (noise is keyed by the program's step, which held steps
      advance), and `num_steps` counts the held steps too.
      `benchmarks/generation.py --lockstep` times it.
    ragged_cache: The cached driver reads its cache with a Pallas kernel
      (`rollout.cache_kernel`; interpret mode off a TPU, so slow there) that
      fetches only the chunks of slots each block of 8 rows uses, with a
      float32 online softmax, instead of every slot at every step. The same
      outputs as the default up to the softmax's rounding (near-ties
      aside). The batch must be at most 8 rows or a multiple of 8. Slower
      than the default on a TPU v5e (`benchmarks/cache_kernel.py`: 14.6
      against 8.3 ms for every layer's read at batch 128), so off by
      default.
      `benchmarks/generation.py --ragged-cache 0,1` times it.
    fused_head: The cached driver's greedy proposals come from a Pallas
      kernel (`rollout.head_kernel`; interpret mode off a TPU) that runs the
      output head a vocabulary tile at a time with an online argmax and
      softmax, so the [B, W, V] logits are never written and read back.
      The same proposals up to the rounding of the head's product, log-probs
      to float32 rounding. Needs temperature 0, the same_position alignment
      and a head without LoRA weights (`head.head_weight`).
      `benchmarks/generation.py --fused-head 0,1` times it.
    one_program: With `cache_phases` > 1, every stage in one program (each
      phase's copy of the loop in it) instead of one program per stage:
      the same outputs; faster to run, slower to compile. On a TPU v5e
      (Qwen3-0.6B, bf16, batch 32, block 16 / 4 steps, 4 phases, lockstep,
      fused head) one program ran 7.53 ms a call against 8.35 for the
      stages (one run at 791d74e) but took 219 s to compile against 131 s
      for the stages in threads, and 8 phases did not compile within 10
      minutes. No effect with one phase.
      `benchmarks/generation.py --one-program 0,1` times it.

  Returns:
    `GenerationResult` (completion tokens, commit steps and log-probs [B, N],
    `num_steps`, the echoed prompts and the pre-padding trace).
  """
  prompt_tokens, prompt_lengths = _check_generate_inputs(
      prompt_tokens, prompt_lengths, config, max_new_tokens, rng,
      cache_phases, lockstep, use_cache, ragged_cache, fused_head,
      one_program,
  )
  if use_cache:
    kv_cache.check_model_for_cache(
        model, config, prompt_tokens.shape[1], int(max_new_tokens)
    )
  if rng is None:
    rng = jax.random.key(0)  # unused by greedy proposals
  graphdef, state = nnx.split(model)
  phases = int(cache_phases or 1) if use_cache else 1
  # One phase is one program either way: both share it.
  key = (config, int(max_new_tokens), bool(use_cache), phases, lockstep,
         ragged_cache, fused_head, one_program and phases > 1)
  program = _program(graphdef, key)
  return program(state, prompt_tokens, prompt_lengths, rng,
                 threshold_operand(config))
