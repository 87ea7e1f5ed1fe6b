"""The pieces of `benchmarks/rl_vs_ar.py` (and its `_ar_grpo.py`), a few
steps each, so they cannot rot.

The block-diffusion side is the `rl` job (tests/jobs/test_rl.py checks the
summary keys the benchmark reads); here: the autoregressive warm start with
early stopping, Tunix's GRPO on it with rollout accounting, the report.
"""

import importlib.util
import pathlib
import types

import numpy as np
import pytest

from tunix.rl import rl_cluster as rl_cluster_lib

from tunix_blockdiff import tasks
from tunix_blockdiff.runs import common
from tunix_blockdiff.runs import rl_common
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.runs import rl_reward

PATH = (
    pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "rl_vs_ar.py"
)
Mode = rl_cluster_lib.Mode
TINY_MODEL = [
    "model.num_layers=1",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.num_heads=2",
    "model.head_dim=8",
    "model.num_kv_heads=1",
]


@pytest.fixture(name="bench", scope="module")
def _bench():
  spec = importlib.util.spec_from_file_location("rl_vs_ar", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_ar_rollout_cost_counts_prefill_decode_and_eos(bench):
  # Budget 4. Micro-batch 1: rows of 1 and 4 tokens (EOS after the first):
  # tokens 2 + 4, calls max(2, 4) = 4. Micro-batch 2: rows of 0 and 2:
  # tokens 1 + 3, calls 3.
  cost = bench._ar_grpo.ar_rollout_cost([([1, 4, 0, 2], 2)], max_new_tokens=4)
  assert cost == {
      "rollouts": 4,
      "rollout_tokens": 10,
      "rollout_model_calls": 7,
      "rollout_row_calls": 14,
  }


def test_parse_args_needs_a_block_diffusion_method(bench):
  opts = bench.parse_args(["--methods", "ar,bd_exact", "grpo.steps=3"])
  assert opts.methods == ["bd_exact", "ar"]
  assert opts.overrides == ["grpo.steps=3"]
  with pytest.raises(SystemExit):
    bench.parse_args(["--methods", "ar"])
  with pytest.raises(SystemExit):
    bench.parse_args(["--methods", "bd_exact,gpt"])


def test_ar_warm_start_grpo_and_report(bench, tmp_path):
  sft_cfg = common.load_recipe([
      "tiny.yaml",
      "task.kwargs.min_digits=2",
      "task.kwargs.max_digits=3",
      "task.num_train=64",
      "task.num_eval=4",
      "data.seq_len=14",
      "data.batch_size=8",
      *TINY_MODEL,
  ])
  cfg = common.load_recipe([
      "rl_tiny.yaml",
      "grpo.steps=1",
      "grpo.prompts_per_step=2",
      "grpo.num_generations=2",
      "grpo.micro_batch_prompts=1",
      "eval.num_prompts=4",
      "eval.samples_per_prompt=1",
      "eval.batch_size=4",
      "rollout.max_tokens_to_generate=4",
      "rollout.max_prompt_length=10",
  ])
  tokenizer = tasks.CharTokenizer()
  prompts = rl_data.task_prompts(sft_cfg, 2, seed=5)
  reward_fn = rl_reward.exact_match_reward(prompts.task)
  model = bench._ar_grpo.ar_model(sft_cfg, seed=0)
  assert model.config.num_layers == 1 and model.config.embed_dim == 16
  opts = types.SimpleNamespace(
      ar_max_steps=4,
      ar_eval_every=2,
      ar_learning_rate=1e-3,
      max_prompt_length=10,
      max_new_tokens=4,
  )
  history, kept = bench._ar_grpo.ar_warm_start(
      model, tokenizer, sft_cfg, prompts.held_out, reward_fn, 1.01, opts
  )
  # An unreachable target: evaluations at steps 0, 2 and 4, then stop and
  # keep the evaluated parameters closest to the target.
  assert [s for s, _ in history] == [0, 2, 4]
  assert kept in history and kept[1] == max(em for _, em in history)
  # TRAIN rollouts sample (Tunix's Sampler is greedy unless top_p is set).
  cluster = bench._ar_grpo.ar_cluster(cfg, model, tokenizer, tmp_path / "c")
  with rl_common.rl_mesh(None):
    texts = cluster.generate(["rev 12>"] * 8, mode=Mode.TRAIN).text
  assert len(set(texts)) > 1
  row = bench._ar_grpo.ar_grpo(
      cfg, model, tokenizer, prompts, reward_fn, tmp_path
  )
  assert row["rollout_tokens"] <= 4 * 4 and row["rollout_model_calls"] >= 2
  assert len(row["train_step_rewards"]) == 1
  assert 0.0 <= row["greedy_exact_match_end"] <= 1.0
  row["exact_match_gain"] = 0.0
  text = bench.table({"ar": row})
  assert text.count("\n") == 2 and "| ar |" in text
  png = bench.plot(tmp_path / "f.png", {"ar": row}, "t")
  assert png.stat().st_size > 0
  assert np.isfinite(row["rl_seconds"])


def _row(start, end, tokens=100):
  return {
      "greedy_exact_match_start": start,
      "greedy_exact_match_end": end,
      "rollout_tokens": tokens,
  }


def test_target_needs_a_positive_gain_beyond_one_standard_error(bench):
  se = bench.gain_standard_error(0.5, 0.6, 100)
  np.testing.assert_allclose(se, np.sqrt((0.25 + 0.24) / 100))
  with pytest.raises(ValueError, match="num_prompts"):
    bench.gain_standard_error(0.5, 0.5, 0)
  cases = {
      # Both lose, block diffusion less: not a success any more.
      "both_lose": (_row(0.5, 0.45), _row(0.5, 0.30), False),
      # A gain within one standard error (128 prompts: se ~ 0.06).
      "within_noise": (_row(0.5, 0.53), _row(0.5, 0.50), False),
      # A clear gain, at least AR's.
      "clear_gain": (_row(0.3, 0.6), _row(0.3, 0.4), True),
      # A clear gain below AR's.
      "below_ar": (_row(0.3, 0.5), _row(0.3, 0.7), False),
  }
  for name, (bd, ar, met) in cases.items():
    results = {"bd_exact": dict(bd), "ar": dict(ar)}
    bench.add_gains(results, 128)
    verdict = bench.verdict(results)["bd_exact"]
    assert verdict["target_met"] is met, name
    assert verdict["gain_se"] == results["bd_exact"]["exact_match_gain_se"]
    assert verdict["ar_gain_se"] > 0
  results = {"bd_exact": _row(0.3, 0.6), "ar": _row(0.3, 0.4)}
  for r in results.values():
    r.update(reward_start=0.0, reward_end=0.0, rollout_model_calls=1,
             rollout_row_calls=1, groups_with_signal=0.0, rl_seconds=1.0)
  bench.add_gains(results, 128)
  assert "+0.300 ± 0.059" in bench.table(results)
