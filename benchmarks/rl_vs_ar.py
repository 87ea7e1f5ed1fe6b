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
  warm start's training pairs), evaluated every `--ar-eval-every` steps and
  stopped once its held-out greedy exact match reaches the block-diffusion
  warm start's, keeping the evaluated parameters closest to it. Same
  optimizer, learning rate, clipping, temperature, epsilon and loss
  aggregation as the block-diffusion runs.

Reported per method (held-out prompts, before and after GRPO): sampled
reward, greedy exact match, training rollout tokens (to EOS, EOS included),
sequential model calls of the training rollouts (per rollout micro-batch:
block diffusion one prefill plus its denoising steps; autoregressive one
prefill plus one decode step per further token of its longest row), and
wall time. Writes `summary.json` and `rl_vs_ar.png` to `--out`.

    python benchmarks/rl_vs_ar.py                     # the README table
    python benchmarks/rl_vs_ar.py --reuse-bd          # rerun only the AR side
    python benchmarks/rl_vs_ar.py grpo.steps=60       # any rl_tiny override
    tunix-blockdiff bench rl_vs_ar [flags] [overrides]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Sequence

import numpy as np

from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import rl as rl_job
from tunix_blockdiff.jobs import rl_policy
from tunix_blockdiff.runs import rl_data
from tunix_blockdiff.runs import rl_reward

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _ar_grpo  # pylint: disable=g-import-not-at-top,g-bad-import-order

METHODS = ("bd_exact", "bd_committed_only", "ar")
LIKELIHOOD = {"bd_exact": "exact", "bd_committed_only": "committed_only"}


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
# Report.
# -----------------------------------------------------------------------------


def gain_standard_error(start: float, end: float, num_prompts: int) -> float:
  """Standard error of an exact-match gain `end - start` over held-out prompts.

  Both are proportions of `num_prompts` prompts; the two evaluations are
  treated as independent binomials, `sqrt((s(1-s) + e(1-e)) / n)` (the
  per-prompt pairing is not kept in the summaries; pairing would only make
  it smaller when the evaluations are positively correlated).
  """
  if num_prompts < 1:
    raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
  variance = start * (1.0 - start) + end * (1.0 - end)
  return float(np.sqrt(max(variance, 0.0) / num_prompts))


def add_gains(results: dict[str, dict[str, Any]], num_prompts: int) -> None:
  """Adds `exact_match_gain` and its `exact_match_gain_se` to every method."""
  for r in results.values():
    r["exact_match_gain"] = (
        r["greedy_exact_match_end"] - r["greedy_exact_match_start"]
    )
    r["exact_match_gain_se"] = gain_standard_error(
        r["greedy_exact_match_start"], r["greedy_exact_match_end"], num_prompts
    )


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per block-diffusion method: is the target met?

  The target: a positive exact-match gain beyond one standard error
  (`gain > se`: GRPO helped, which rules out both methods losing) that is
  at least the AR method's gain. Needs `add_gains` first.
  """
  out = {}
  if "ar" not in results:
    return out
  ar = results["ar"]
  for name in (n for n in results if n in LIKELIHOOD):
    r = results[name]
    gain, se = r["exact_match_gain"], r["exact_match_gain_se"]
    out[name] = {
        "gain": gain,
        "gain_se": se,
        "ar_gain": ar["exact_match_gain"],
        "ar_gain_se": ar["exact_match_gain_se"],
        "token_ratio_to_ar": (
            r["rollout_tokens"] / max(ar["rollout_tokens"], 1)
        ),
        "gain_beyond_one_se": gain > se,
        "target_met": bool(gain > se and gain >= ar["exact_match_gain"]),
    }
  return out


def table(results: dict[str, dict[str, Any]]) -> str:
  """A markdown table: one row per method."""
  lines = [
      (
          "| method | sampled reward before -> after | greedy EM before ->"
          " after | EM gain (± 1 s.e.) | rollout tokens | model calls |"
          " tokens per"
          " row-call |"
          " groups with signal | GRPO s |"
      ),
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    gain = r["greedy_exact_match_end"] - r["greedy_exact_match_start"]
    se = r.get("exact_match_gain_se")
    gain_text = f"{gain:+.3f}" + ("" if se is None else f" ± {se:.3f}")
    lines.append(
        f"| {name} | {r['reward_start']:.3f} -> {r['reward_end']:.3f} |"
        f" {r['greedy_exact_match_start']:.3f} ->"
        f" {r['greedy_exact_match_end']:.3f} | {gain_text} |"
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
  parser.add_argument(
      "--reuse-bd",
      action="store_true",
      help=(
          "take bd_* rows from an earlier run's OUT/<method>/bench_row.json"
          " (same --out and overrides) instead of rerunning them"
      ),
  )
  parser.add_argument("--ar-max-steps", type=int, default=3000)
  parser.add_argument("--ar-eval-every", type=int, default=5)
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
      else rl_policy.sft_warm_start(cfg.init, out)
  )
  timings = {"bd_warm_start_seconds": clock()}
  results: dict[str, dict[str, Any]] = {}
  for method in [m for m in opts.methods if m in LIKELIHOOD]:
    method_clock = common.Stopwatch()
    saved = out / method / "bench_row.json"
    if opts.reuse_bd and saved.is_file():
      results[method] = json.loads(saved.read_text())
      print(f"{method}: reusing {saved} (--reuse-bd)")
      continue
    results[method] = bd_grpo(cfg, sft_dir, method, out)
    results[method]["seconds"] = method_clock()
    saved.write_text(json.dumps(results[method]))
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
    reward_fn = rl_reward.recipe_reward(cfg, prompts)
    model = _ar_grpo.ar_model(sft_cfg, seed=int(cfg.seed) + 7)
    opts.max_prompt_length = int(cfg.rollout.max_prompt_length)
    opts.max_new_tokens = int(cfg.rollout.max_tokens_to_generate)
    history, (kept_step, kept_em) = _ar_grpo.ar_warm_start(
        model, tokenizer, sft_cfg, prompts.held_out, reward_fn, target, opts
    )
    ar_info = {
        "target_exact_match": target,
        "kept_exact_match": kept_em,
        "kept_step": kept_step,
        "sft_steps": history[-1][0],
        "exact_match_history": history,
        "sft_seconds": method_clock(),
    }
    results["ar"] = _ar_grpo.ar_grpo(
        cfg, model, tokenizer, prompts, reward_fn, out
    )
    results["ar"]["seconds"] = method_clock()
  add_gains(results, int(cfg.eval.num_prompts))
  target_verdict = verdict(results)
  text = table(results)
  print(text)
  summary = {
      "methods": results,
      "ar_warm_start": ar_info,
      "target": target_verdict,
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
  print(json.dumps(target_verdict, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
