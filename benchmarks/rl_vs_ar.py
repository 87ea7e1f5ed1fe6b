"""Block-diffusion GRPO vs Tunix's autoregressive GRPO, side by side.

Same task, reward, prompts, rollouts per prompt and steps for every method
(`recipes/rl_tiny.yaml`: reversing 3-6 digit strings, reward 1 iff the
completion is the answer, 150 steps x 16 prompts x 8 rollouts):

* `bd_exact`, `bd_committed_only`: the `tunix-blockdiff rl` job (block
  diffusion, `BlockDiffusionGRPOLearner`, loss `bd_grpo`) from one SFT warm
  start, with the sampler's exact trajectory likelihood or the product of the
  committed tokens' probabilities (`grpo.likelihood`).
* `ar`: Tunix's own `GRPOLearner` with `RLCluster` and the vanilla `Sampler`
  rollout on an autoregressive Tunix Qwen3 of the same size, warm-started by
  causal SFT (Tunix's `PeftTrainer`, next-token loss, on the block-diffusion
  warm start's training pairs) with early stopping at the first evaluation
  whose held-out greedy exact match reaches the block-diffusion warm start's.
  Same optimizer, learning rate, clipping, temperature, epsilon and loss
  aggregation as the block-diffusion runs.

Reported per method (held-out prompts, before and after GRPO): sampled
reward, greedy exact match, training rollout tokens (to EOS, EOS included),
sequential model calls of the training rollouts (per rollout micro-batch:
block diffusion one prefill plus its denoising steps; autoregressive one
prefill plus one decode step per further token of its longest row), and
wall time. Writes `summary.json` and `rl_vs_ar.png` to `--out`.

    python benchmarks/rl_vs_ar.py                     # the README table
    python benchmarks/rl_vs_ar.py grpo.steps=60       # any rl_tiny override
    tunix-blockdiff bench rl_vs_ar [flags] [overrides]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Sequence

from flax import nnx
import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.sft import metrics_logger as metrics_lib
from tunix.sft import peft_trainer

from tunix_blockdiff import tiny_models
from tunix_blockdiff.jobs import common
from tunix_blockdiff.jobs import opd as opd_job
from tunix_blockdiff.jobs import rl as rl_job
from tunix_blockdiff.jobs import rl_common
from tunix_blockdiff.jobs import rl_data

METHODS = ("bd_exact", "bd_committed_only", "ar")
LIKELIHOOD = {"bd_exact": "exact", "bd_committed_only": "committed_only"}
Mode = rl_cluster_lib.Mode
Role = rl_cluster_lib.Role


# -----------------------------------------------------------------------------
# Block diffusion: the rl job.
# -----------------------------------------------------------------------------


def bd_grpo(cfg, sft_dir: pathlib.Path, method: str, out: pathlib.Path):
  """Summary of the `rl` job from the SFT checkpoint with `method`'s likelihood."""
  overrides = [f"init.checkpoint={sft_dir}", f"output_dir={out / method}"]
  if "likelihood" in cfg.grpo:
    overrides.append(f"grpo.likelihood={LIKELIHOOD[method]}")
  elif method != "bd_committed_only":
    raise ValueError(
        f"{method} needs grpo.likelihood (exact trajectory likelihood), which"
        " this checkout's rl recipe does not have"
    )
  run_cfg = omegaconf_merge(cfg, overrides)
  summary = rl_job.run(run_cfg)
  return {
      "reward_start": summary["reward_start"],
      "reward_end": summary["reward_end"],
      "greedy_exact_match_start": summary["greedy_exact_match_start"],
      "greedy_exact_match_end": summary["greedy_exact_match_end"],
      "rollout_tokens": summary["rollout_tokens"],
      "rollout_model_calls": summary["rollout_model_calls"],
      "rollout_row_calls": summary["rollout_row_calls"],
      "rl_seconds": summary["rl_seconds"],
      "groups_with_signal": summary["train_groups_with_signal"],
      "train_step_rewards": summary["train_step_rewards"],
  }


def omegaconf_merge(cfg, overrides: Sequence[str]):
  import omegaconf  # pylint: disable=g-import-not-at-top

  merged = omegaconf.OmegaConf.merge(
      cfg, omegaconf.OmegaConf.from_dotlist(list(overrides))
  )
  omegaconf.OmegaConf.set_struct(merged, True)
  return merged


# -----------------------------------------------------------------------------
# Autoregressive: causal SFT to the same exact match, then Tunix's GRPO.
# -----------------------------------------------------------------------------


class CountingRLCluster(rl_cluster_lib.RLCluster):
  """Tunix's `RLCluster`, recording rollout row lengths while `recording`."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.recording = False
    self.rollout_records: list[tuple[list[int], int]] = []

  def generate(self, prompts, *args, **kwargs):
    output = super().generate(prompts, *args, **kwargs)
    if self.recording:
      lengths = [len(t) for t in output.tokens]
      self.rollout_records.append(
          (lengths, kwargs.get("micro_batch_size") or len(lengths))
      )
    return output


def ar_rollout_cost(records, max_new_tokens: int) -> dict[str, int]:
  """Rollouts, tokens and model calls of recorded AR rollouts.

  Tunix's sampler prefills (sampling the first token) and then decodes one
  token per call until every row of the micro-batch has emitted EOS or the
  budget is spent: `max(min(length + 1, budget))` calls per micro-batch.
  """
  lengths = [n for row_lengths, _ in records for n in row_lengths]
  calls = row_calls = 0
  for row_lengths, micro in records:
    for start in range(0, len(row_lengths), micro):
      chunk = row_lengths[start : start + micro]
      chunk_calls = max(min(n + 1, max_new_tokens) for n in chunk)
      calls += chunk_calls
      row_calls += chunk_calls * len(chunk)
  return {
      "rollouts": len(lengths),
      "rollout_tokens": rl_common.generated_tokens(lengths, max_new_tokens),
      "rollout_model_calls": calls,
      "rollout_row_calls": row_calls,
  }


def ar_model(sft_cfg, seed: int):
  """A Tunix Qwen3 with the block-diffusion policy's shape."""
  m = sft_cfg.model
  return tiny_models.tiny_qwen3(
      int(m.vocab_size),
      seed=seed,
      num_layers=int(m.num_layers),
      embed_dim=int(m.embed_dim),
      hidden_dim=int(m.hidden_dim),
      num_heads=int(m.num_heads),
      head_dim=int(m.head_dim),
      num_kv_heads=int(m.num_kv_heads),
  )


def sft_pairs(sft_cfg, held_out_rows):
  """The block-diffusion SFT job's training pairs (held-out prompts removed)."""
  task = rl_data.task_prompts(sft_cfg, 0, seed=0).task
  held = {row["prompt"] for row in held_out_rows}
  pairs = task.sample(int(sft_cfg.task.num_train), seed=int(sft_cfg.task.seed))
  return [pair for pair in pairs if pair[0] not in held]


def ar_warm_start(model, tokenizer, sft_cfg, rows, reward_fn, target, opts):
  """Causal SFT of `model` until held-out greedy EM >= `target`.

  Evaluates every `opts.ar_eval_every` steps (and at step 0) and stops at the
  first evaluation reaching `target`, or after `opts.ar_max_steps`.

  Returns:
    (greedy EM history [(step, em)], steps trained).
  """
  cache = int(opts.max_prompt_length) + int(opts.max_new_tokens) + 8
  sampler = sampler_lib.Sampler(
      model,
      tokenizer,
      sampler_lib.CacheConfig(
          cache_size=cache,
          num_layers=model.config.num_layers,
          num_kv_heads=model.config.num_kv_heads,
          head_dim=model.config.head_dim,
      ),
  )
  batch = next(rl_data.prompt_batches(rows, len(rows)))
  prompts = list(batch.pop("prompts"))

  def greedy_em() -> float:
    sampler.transformer_state = nnx.variables(model)
    output = sampler(
        prompts,
        max_generation_steps=int(opts.max_new_tokens),
        max_prompt_length=int(opts.max_prompt_length),
        temperature=0.0,
    )
    return float(
        np.mean(
            reward_fn(
                prompts=prompts, completions=output.text, mode="eval", **batch
            )
        )
    )

  history = [(0, greedy_em())]
  trainer = peft_trainer.PeftTrainer(
      model,
      optax.chain(
          optax.clip_by_global_norm(1.0),
          optax.adamw(
              optax.linear_schedule(0.0, opts.ar_learning_rate, 20), b2=0.99
          ),
      ),
      peft_trainer.TrainingConfig(
          eval_every_n_steps=10**9,
          max_steps=int(opts.ar_max_steps),
          pbar_description="AR causal SFT",
      ),
  )
  batches = opd_job.causal_lm_batches(
      sft_pairs(sft_cfg, rows),
      tokenizer,
      seq_len=int(sft_cfg.data.seq_len),
      batch_size=int(sft_cfg.data.batch_size),
      seed=int(sft_cfg.seed) + 11,
  )

  def until_target():
    step = 0
    while history[-1][1] < target and step < int(opts.ar_max_steps):
      for _ in range(int(opts.ar_eval_every)):
        yield next(batches)
        step += 1
      history.append((step, greedy_em()))

  if history[-1][1] < target:
    trainer.train(until_target())
  return history, history[-1][0]


def ar_grpo(cfg, model, tokenizer, prompts: rl_data.PromptSet, reward_fn, out):
  """Tunix's GRPO (vanilla Sampler rollout) on the AR model; a summary row."""
  grpo_cfg = cfg.grpo
  steps, per_step = int(grpo_cfg.steps), int(grpo_cfg.prompts_per_step)
  max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
  mesh = rl_common.single_device_mesh()
  train_rewards: list[float] = []

  def tracked_reward(prompts, completions, **kwargs):
    rewards = reward_fn(prompts=prompts, completions=completions, **kwargs)
    if kwargs.get("mode", "train") == "train":
      train_rewards.extend(np.asarray(rewards, np.float64).tolist())
    return rewards

  cluster = CountingRLCluster(
      actor=model,
      reference=None,
      tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              Role.ACTOR: mesh,
              Role.REFERENCE: mesh,
              Role.ROLLOUT: mesh,
          },
          rollout_engine="vanilla",
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=rl_common.make_rl_optimizer(grpo_cfg),
              eval_every_n_steps=10**9,
              max_steps=steps * int(grpo_cfg.num_iterations),
              mini_batch_size=per_step,
              train_micro_batch_size=int(grpo_cfg.micro_batch_prompts),
              metrics_logging_options=metrics_lib.MetricsLoggerOptions(
                  log_dir=str(out / "ar" / "tensorboard"),
                  flush_every_n_steps=20,
              ),
              pbar_description="autoregressive GRPO",
          ),
          rollout_config=rl_common.rollout_configs(
              cfg,
              max_new_tokens,
              kv_cache_size=int(cfg.rollout.max_prompt_length)
              + max_new_tokens
              + 8,
          ),
      ),
  )
  learner = grpo_learner.GRPOLearner(
      cluster,
      grpo_learner.GRPOConfig(
          num_generations=int(grpo_cfg.num_generations),
          num_iterations=int(grpo_cfg.num_iterations),
          beta=float(grpo_cfg.beta),
          epsilon=float(grpo_cfg.epsilon),
          loss_agg_mode=str(grpo_cfg.loss_agg_mode),
      ),
      reward_fns=[tracked_reward],
  )

  def evaluate():
    with mesh:
      return [
          rl_common.evaluate_rewards(
              cluster,
              prompts.held_out,
              reward_fn,
              samples=samples,
              mode=mode,
              batch_size=int(cfg.eval.batch_size),
          )
          for samples, mode in (
              (int(cfg.eval.samples_per_prompt), Mode.TRAIN),
              (1, Mode.EVAL),
          )
      ]

  start = evaluate()
  clock = common.Stopwatch()
  cluster.recording = True  # Training rollouts only.
  with mesh:
    learner.train(list(rl_data.prompt_batches(prompts.train, per_step)))
  cluster.recording = False
  seconds = clock()
  end = evaluate()
  size = per_step * int(grpo_cfg.num_generations)
  cost = ar_rollout_cost(cluster.rollout_records, max_new_tokens)
  return {
      "reward_start": start[0],
      "reward_end": end[0],
      "greedy_exact_match_start": start[1],
      "greedy_exact_match_end": end[1],
      "rollout_tokens": cost["rollout_tokens"],
      "rollout_model_calls": cost["rollout_model_calls"],
      "rollout_row_calls": cost["rollout_row_calls"],
      "rl_seconds": seconds,
      "groups_with_signal": rl_common.groups_with_signal(
          train_rewards, int(grpo_cfg.num_generations)
      ),
      "train_step_rewards": [
          float(np.mean(train_rewards[i : i + size]))
          for i in range(0, len(train_rewards), size)
      ],
  }


# -----------------------------------------------------------------------------
# Report.
# -----------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]]) -> str:
  """A markdown table: one row per method."""
  lines = [
      (
          "| method | sampled reward before -> after | greedy EM before ->"
          " after | EM gain | rollout tokens | model calls | tokens per"
          " row-call |"
          " groups with signal | GRPO s |"
      ),
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    gain = r["greedy_exact_match_end"] - r["greedy_exact_match_start"]
    lines.append(
        f"| {name} | {r['reward_start']:.3f} -> {r['reward_end']:.3f} |"
        f" {r['greedy_exact_match_start']:.3f} ->"
        f" {r['greedy_exact_match_end']:.3f} | {gain:+.3f} |"
        f" {r['rollout_tokens']:,} | {r['rollout_model_calls']:,} |"
        f" {r['rollout_tokens'] / max(r['rollout_row_calls'], 1):.2f} |"
        f" {r['groups_with_signal']:.2f} | {r['rl_seconds']:.0f} |"
    )
  return "\n".join(lines)


def plot(path: pathlib.Path, results: dict[str, dict[str, Any]], title: str):
  """Training reward vs rollout tokens (left); greedy EM before/after."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_curve, ax_em) = plt.subplots(1, 2, figsize=(11, 4))
  for name, r in results.items():
    rewards = np.asarray(r["train_step_rewards"], float)
    if not rewards.size:
      continue
    tokens = np.linspace(0, r["rollout_tokens"], rewards.size + 1)[1:]
    window = max(1, rewards.size // 10)
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    ax_curve.plot(tokens[window - 1 :], smooth, lw=2, label=name)
  ax_curve.set_xlabel("training rollout tokens")
  ax_curve.set_ylabel("train reward (moving average)")
  ax_curve.set_ylim(-0.02, 1.02)
  ax_curve.grid(alpha=0.3)
  ax_curve.legend(fontsize=8)
  x = np.arange(len(results))
  starts = [r["greedy_exact_match_start"] for r in results.values()]
  ends = [r["greedy_exact_match_end"] for r in results.values()]
  ax_em.bar(x - 0.2, starts, 0.4, color="tab:gray", label="before GRPO")
  ax_em.bar(x + 0.2, ends, 0.4, color="tab:blue", label="after GRPO")
  ax_em.set_xticks(x, list(results))
  ax_em.set_ylim(0, 1)
  ax_em.set_ylabel("held-out greedy exact match")
  ax_em.legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="runs/bench_rl_vs_ar")
  parser.add_argument("--recipe", default="rl_tiny.yaml", help="rl recipe")
  parser.add_argument(
      "--methods",
      default=",".join(METHODS),
      help=f"comma-separated subset of {METHODS} (one bd_* is required)",
  )
  parser.add_argument("--ar-max-steps", type=int, default=3000)
  parser.add_argument("--ar-eval-every", type=int, default=10)
  parser.add_argument("--ar-learning-rate", type=float, default=1e-3)
  parser.add_argument(
      "overrides", nargs="*", help="rl_tiny.yaml overrides, key=value"
  )
  opts = parser.parse_args(argv)
  methods = [m for m in opts.methods.split(",") if m]
  unknown = sorted(set(methods) - set(METHODS))
  if unknown or not any(m in LIKELIHOOD for m in methods):
    parser.error(
        f"--methods must be a subset of {METHODS} with a bd_* method (its"
        f" warm start sets the AR target), got {opts.methods!r}"
    )
  opts.methods = [m for m in METHODS if m in methods]
  return opts


def main(argv=None) -> int:
  import omegaconf  # pylint: disable=g-import-not-at-top

  opts = parse_args(sys.argv[1:] if argv is None else argv)
  cfg = common.load_recipe(
      [opts.recipe, *opts.overrides, f"output_dir={opts.out}"]
  )
  out = common.prepare_output_dir(cfg)
  clock = common.Stopwatch()
  sft_dir, sft_summary = (
      (pathlib.Path(cfg.init.checkpoint), {})
      if cfg.init.checkpoint
      else rl_common.sft_warm_start(cfg.init, out)
  )
  timings = {"bd_warm_start_seconds": clock()}
  results: dict[str, dict[str, Any]] = {}
  for method in [m for m in opts.methods if m in LIKELIHOOD]:
    method_clock = common.Stopwatch()
    results[method] = bd_grpo(cfg, sft_dir, method, out)
    results[method]["seconds"] = method_clock()
  target = next(iter(results.values()))["greedy_exact_match_start"]
  ar_info = {}
  if "ar" in opts.methods:
    method_clock = common.Stopwatch()
    sft_cfg = omegaconf.OmegaConf.load(sft_dir / common.RECIPE_FILE)
    tokenizer = common.build_tokenizer(sft_cfg.tokenizer, sft_cfg.model)
    prompts = rl_data.recipe_prompts(  # As the rl job draws them.
        cfg,
        sft_cfg,
        tokenizer,
        num_train=int(cfg.grpo.steps) * int(cfg.grpo.prompts_per_step),
        num_held_out=int(cfg.eval.num_prompts),
        seed=int(cfg.seed) + 1000,
    )
    reward_fn = rl_data.recipe_reward(cfg, prompts)
    model = ar_model(sft_cfg, seed=int(cfg.seed) + 7)
    opts.max_prompt_length = int(cfg.rollout.max_prompt_length)
    opts.max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
    history, steps = ar_warm_start(
        model, tokenizer, sft_cfg, prompts.held_out, reward_fn, target, opts
    )
    ar_info = {
        "target_exact_match": target,
        "reached_exact_match": history[-1][1],
        "sft_steps": steps,
        "exact_match_history": history,
        "sft_seconds": method_clock(),
    }
    results["ar"] = ar_grpo(cfg, model, tokenizer, prompts, reward_fn, out)
    results["ar"]["seconds"] = method_clock()
  for r in results.values():
    r["exact_match_gain"] = (
        r["greedy_exact_match_end"] - r["greedy_exact_match_start"]
    )
  verdict = {}
  if "ar" in results:
    for name in (n for n in results if n in LIKELIHOOD):
      verdict[name] = {
          "gain": results[name]["exact_match_gain"],
          "ar_gain": results["ar"]["exact_match_gain"],
          "token_ratio_to_ar": (
              results[name]["rollout_tokens"]
              / max(results["ar"]["rollout_tokens"], 1)
          ),
          "target_met": (
              results[name]["exact_match_gain"]
              >= results["ar"]["exact_match_gain"]
          ),
      }
  text = table(results)
  print(text)
  summary = {
      "methods": results,
      "ar_warm_start": ar_info,
      "target": verdict,
      "table": text,
      "seconds": clock(),
      **timings,
      "bd_sft": {
          "dir": str(sft_dir),
          "eval_exact_match": (sft_summary or {}).get("eval_exact_match"),
      },
      "recipe": common.to_dict(cfg),
  }
  plot(
      out / "rl_vs_ar.png",
      results,
      title=(
          f"GRPO, {cfg.grpo.steps} steps x {cfg.grpo.prompts_per_step} prompts"
          f" x {cfg.grpo.num_generations} rollouts: block diffusion vs"
          " autoregressive (Tunix)"
      ),
  )
  common.write_summary(out, summary)
  print(f"wrote {out / common.SUMMARY_FILE} and {out / 'rl_vs_ar.png'}")
  print(json.dumps(verdict, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
