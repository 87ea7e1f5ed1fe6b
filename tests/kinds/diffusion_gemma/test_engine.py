"""DiffusionGemmaRollout: traces, the sampler's log-probs, the exact scorer."""

import dataclasses
import functools

from flax import nnx
import jax
import numpy as np
import pytest
from tunix.rl.rollout import base_rollout

from tunix_blockdiff import tasks
from tunix_blockdiff.runs import common
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models import tiny
from tunix_blockdiff.kinds.diffusion_gemma import scoring as scoring
from tunix_blockdiff.kinds.diffusion_gemma import sampler as dg_rollout
from tunix_blockdiff.kinds.diffusion_gemma import engine as engine_lib
from tunix_blockdiff.kinds.diffusion_gemma import output as output_lib

TOKENIZER = tasks.CharTokenizer(alphabet="0123456789rev >")
SAMPLER = dg.SamplerConfig(max_denoising_steps=5, entropy_bound=0.6,
                           t_min=0.5, t_max=1.0, confidence_threshold=0.5)
ROLLOUT = base_rollout.RolloutConfig(max_tokens_to_generate=10,
                                     max_prompt_length=8)
PROMPTS = ["rev 12>", "rev 345>", "rev 9>", "rev 70>"] * 2


def tiny_model(seed=0):
  return tiny.tiny_diffusion_gemma(
      TOKENIZER.vocab_size, seed=seed, embedding_scale=3.0, num_experts=2,
      top_k_experts=1, moe_intermediate_size=8)


@functools.lru_cache(maxsize=None)
def _rollout():
  engine = engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                            sampler_config=SAMPLER, seed=4)
  return engine, engine.generate(PROMPTS, ROLLOUT)


def _prompt_mask(output):
  return dg_rollout.valid_mask(output.left_padded_prompt_tokens.shape[1],
                               output.prompt_lengths)


def test_generate_records_the_trace_and_uses_the_tokenizers_eos():
  engine, out = _rollout()
  assert engine.sampler_config.eos_token_id == TOKENIZER.eos_id()
  assert engine.sampler_config.pad_token_id == TOKENIZER.pad_id()
  b, k, n, c = len(PROMPTS), 3, SAMPLER.max_denoising_steps, 4
  trace = out.trace
  assert trace.tokens.shape == (b, k * c)
  for name in ("canvas", "next_canvas", "denoiser", "accepted"):
    assert getattr(trace, name).shape == (b, k, n, c), name
  for name in ("temperature", "live", "sc_on", "logprob"):
    assert getattr(trace, name).shape == (b, k, n), name
  assert trace.active.shape == (b, k)
  np.testing.assert_array_equal(trace.sc_on[:, :, 0], False)
  np.testing.assert_array_equal(trace.sc_on[:, :, 1:], True)
  np.testing.assert_allclose(trace.temperature[0, 0, 0], SAMPLER.t_max)
  # A step's produced canvas is the next step's input while the row lives.
  live = trace.live[:, :, 1:]
  np.testing.assert_array_equal(
      np.where(live[..., None], trace.next_canvas[:, :, :-1], 0),
      np.where(live[..., None], trace.canvas[:, :, 1:], 0))
  # Accepted slots hold the denoiser's draw.
  acc = trace.accepted
  np.testing.assert_array_equal(np.where(acc, trace.next_canvas, 0),
                                np.where(acc, trace.denoiser, 0))
  assert np.all(acc.sum(-1)[trace.live] >= 1)
  for row, tokens, text in zip(trace.tokens, out.tokens, out.text):
    np.testing.assert_array_equal(row[:len(tokens)], tokens)
    assert TOKENIZER.eos_id() not in tokens.tolist()
    assert text == TOKENIZER.decode(tokens.tolist())
  assert out.logprobs is None
  assert np.all(np.isfinite(out.sequence_logprobs))
  assert np.all(out.sequence_logprobs < 0)


def test_rows_that_finished_do_not_score_their_later_canvases():
  _, out = _rollout()
  trace = out.trace
  # Some rows stop at an EOS in an early canvas (seeded); their later
  # canvases are pad and inactive.
  stopped = ~trace.active[:, -1]
  assert stopped.any() and not stopped.all()
  c = trace.canvas.shape[-1]
  for row in np.flatnonzero(stopped):
    first_off = int(np.argmin(trace.active[row]))
    assert np.all(trace.tokens[row, first_off * c:] == TOKENIZER.pad_id())
    assert TOKENIZER.eos_id() in trace.tokens[row, :first_off * c].tolist()


def test_the_scorer_under_the_rollouts_parameters_reproduces_its_logprobs():
  engine, out = _rollout()
  scored = np.asarray(engine.score(engine.model(),
                                   out.left_padded_prompt_tokens,
                                   _prompt_mask(out), out.trace))
  np.testing.assert_allclose(scored, out.sequence_logprobs, rtol=2e-5,
                             atol=2e-3)
  # Canvas by canvas too (the differentiable, unjitted path).
  per_canvas = scoring.sequence_logprobs(
      engine.model(), out.left_padded_prompt_tokens, _prompt_mask(out),
      out.trace, engine.sampler_config, per_canvas=True)
  c = out.trace.canvas.shape[-1]
  sampler = np.where(out.trace.active,
                     c * -np.log(TOKENIZER.vocab_size)
                     + out.trace.logprob.sum(-1), 0.0)
  np.testing.assert_allclose(per_canvas, sampler, rtol=2e-5, atol=2e-3)
  # get_per_token_logps is the same, sequence-level.
  via_api = engine.get_per_token_logps(
      out.left_padded_prompt_tokens, out.trace.tokens, trace=out.trace,
      prompt_mask=_prompt_mask(out))
  np.testing.assert_allclose(via_api, scored, rtol=1e-6)


def test_the_scorer_replays_the_self_conditioning_chain_and_the_parameters():
  engine, out = _rollout()
  mask = _prompt_mask(out)
  exact = np.asarray(engine.score(engine.model(),
                                  out.left_padded_prompt_tokens, mask,
                                  out.trace))
  no_sc = out.trace.replace(sc_on=np.zeros_like(out.trace.sc_on))
  other = np.asarray(engine.score(engine.model(),
                                  out.left_padded_prompt_tokens, mask, no_sc))
  assert np.abs(other - exact).max() > 1e-3
  moved = np.asarray(engine.score(tiny_model(seed=1),
                                  out.left_padded_prompt_tokens, mask,
                                  out.trace))
  assert np.all(np.isfinite(moved))
  assert np.abs(moved - exact).max() > 1e-2


def test_calls_draw_fresh_noise_and_update_params_applies():
  model = tiny_model()
  engine = engine_lib.DiffusionGemmaRollout(model, TOKENIZER,
                                            sampler_config=SAMPLER)
  first = engine.generate(PROMPTS[:2], ROLLOUT)
  second = engine.generate(PROMPTS[:2], ROLLOUT)
  assert engine.calls == 2
  assert not np.array_equal(first.trace.canvas, second.trace.canvas)
  engine.calls = 0
  with engine.record_outputs() as records:
    again = engine.generate(PROMPTS[:2], ROLLOUT)
  assert records == [again]
  np.testing.assert_array_equal(again.trace.canvas, first.trace.canvas)
  engine.update_params(nnx.state(tiny_model(seed=1), nnx.Param))
  engine.calls = 0
  moved = engine.generate(PROMPTS[:2], ROLLOUT)
  assert not np.allclose(moved.sequence_logprobs, first.sequence_logprobs)


def test_concat_outputs_joins_rows_and_refuses_mixed_prompt_widths():
  _, out = _rollout()
  joined = engine_lib.concat_outputs([out, out])
  assert joined.trace.canvas.shape[0] == 2 * len(PROMPTS)
  assert joined.text == out.text * 2
  np.testing.assert_array_equal(joined.sequence_logprobs,
                                np.tile(out.sequence_logprobs, 2))
  wider = dataclasses.replace(
      out, left_padded_prompt_tokens=np.pad(out.left_padded_prompt_tokens,
                                            ((0, 0), (1, 0))))
  with pytest.raises(ValueError, match="prompt widths"):
    engine_lib.concat_outputs([out, wider])
  with pytest.raises(ValueError, match="outputs must not be empty"):
    engine_lib.concat_outputs([])


def test_bad_arguments_are_refused_by_name():
  engine, out = _rollout()
  with pytest.raises(TypeError, match="rollout_actor"):
    engine_lib.DiffusionGemmaRollout(object(), TOKENIZER)
  with pytest.raises(TypeError, match="sampler_config"):
    engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                     sampler_config={"entropy_bound": 1})
  with pytest.raises(ValueError, match="max_tokens_to_generate"):
    engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                     max_tokens_to_generate=0)
  with pytest.raises(ValueError, match="trace is required"):
    engine.get_per_token_logps(out.left_padded_prompt_tokens,
                               out.trace.tokens)
  with pytest.raises(ValueError, match="prompts must not be empty"):
    engine.generate([], ROLLOUT)
  with pytest.raises(TypeError, match="trace"):
    engine.score(engine.model(), out.left_padded_prompt_tokens,
                 _prompt_mask(out), {"canvas": out.trace.canvas})
  short = jax.tree.map(lambda x: x[:2], out.trace)
  with pytest.raises(ValueError, match="trace.canvas"):
    engine.score(engine.model(), out.left_padded_prompt_tokens,
                 _prompt_mask(out), short)
  with pytest.raises(ValueError, match="record_trace"):
    output_lib.trace_from_result(
        dataclasses.replace(dg_rollout.GenerateResult(
            tokens=np.zeros((1, 4)), changed_at=np.zeros((1, 4)),
            canvas_steps=np.ones((1, 1)), forward_passes=np.ones(1),
            tokens_per_forward=np.ones(1))), 4)


def test_rows_sharded_over_a_mesh_give_the_one_device_rollout_and_scores():
  # 5 prompts over fsdp=2 (padded to 6 rows; the 2 experts sharded too):
  # the same rollouts, sampler log-probs and scores as on one device.
  mesh = jax.make_mesh((2, 1, 1), ("fsdp", "sp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  prompts = PROMPTS[:5]
  one = engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                         sampler_config=SAMPLER, seed=4)
  with mesh:
    model = common.shard_model(tiny_model(), mesh)
    sharded = engine_lib.DiffusionGemmaRollout(
        model, TOKENIZER, mesh=mesh, sampler_config=SAMPLER, seed=4)
    out = sharded.generate(prompts, ROLLOUT)
    mask = _prompt_mask(out)
    scores = np.asarray(sharded.score(model, out.left_padded_prompt_tokens,
                                      mask, out.trace))
  ref = one.generate(prompts, ROLLOUT)
  assert out.text == ref.text
  np.testing.assert_array_equal(out.trace.tokens, ref.trace.tokens)
  live = ref.trace.live
  np.testing.assert_array_equal(out.trace.live, live)
  np.testing.assert_array_equal(out.trace.accepted[live],
                                ref.trace.accepted[live])
  np.testing.assert_allclose(out.sequence_logprobs, ref.sequence_logprobs,
                             rtol=1e-5)
  np.testing.assert_allclose(scores, ref.sequence_logprobs, rtol=2e-5)
  assert scores.shape == (5,)


def test_greedy_configs_are_refused_for_rollouts_and_scores():
  greedy = dataclasses.replace(SAMPLER, greedy=True)
  with pytest.raises(ValueError, match="greedy trajectories have no"):
    engine_lib.DiffusionGemmaRollout(tiny_model(), TOKENIZER,
                                     sampler_config=greedy)
  with pytest.raises(ValueError, match="greedy trajectories have no"):
    scoring.SequenceScorer(tiny_model(), greedy)
