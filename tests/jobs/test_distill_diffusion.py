"""`distill-data` on a block-diffusion checkpoint: its own trajectories as rows.

Every test uses one tiny run directory as `sft` leaves it (recipe.yaml and a
checkpoint of a random tiny Qwen3 with the embedded character tokenizer),
and the directory `export` writes from it.
"""

import json

import jax
import numpy as np
import pytest
from tunix.sft import checkpoint_manager as checkpoint_lib

from tunix_blockdiff import cli
from tunix_blockdiff import config as config_lib
from tunix_blockdiff.data import rows as rows_lib
from tunix_blockdiff.runs import common
from tunix_blockdiff.jobs import distill_data
from tunix_blockdiff.jobs import distill_diffusion
from tunix_blockdiff.rollout import cached

TINY = [
    "task.num_train=8",
    "task.num_eval=4",
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.hidden_dim=64",
    "model.head_dim=8",
    "diffusion.block_size=4",
]
PROMPTS = ["rev 123>", "rev 9>", "rev 4567>", "rev 80>"]
MAX_NEW = 10
BATCH = 3  # 4 prompts: the second batch repeats its one prompt thrice.


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(run dir, exported dir, recipe, model, prompts file)."""
  root = tmp_path_factory.mktemp("distill_diffusion")
  out = root / "run"
  cfg = common.load_recipe([f"output_dir={out}", *TINY])
  common.prepare_output_dir(cfg)
  model = common.build_model(cfg.model, seed=3)
  manager = checkpoint_lib.CheckpointManager(str(out / "checkpoints"))
  assert manager.save(7, model, force=True)
  manager.close()
  assert cli.main(["export", str(out), str(root / "exported")]) == 0
  prompts = root / "prompts.jsonl"
  prompts.write_text(
      "".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS)
  )
  return out, root / "exported", cfg, model, prompts


def _read_jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _direct(model, cfg, **schedule):
  """The denoiser called directly, batched as the command batches."""
  tokenizer = common.build_tokenizer(cfg.tokenizer)
  diffusion = common.diffusion_config_from(cfg.diffusion)
  config = config_lib.DenoiseConfig(
      block_size=diffusion.block_size,
      mask_token_id=diffusion.mask_token_id,
      alignment=diffusion.alignment,
      eos_token_id=tokenizer.eos_id(),
      pad_token_id=tokenizer.pad_id(),
      **schedule,
  )
  encoded = [common.encode_pair(tokenizer, p, "")[0] for p in PROMPTS]
  width = max(len(e) for e in encoded)
  rows = []
  for i, batch in enumerate([encoded[:3], encoded[3:] * 3]):
    tokens = np.full((BATCH, width), tokenizer.pad_id(), np.int32)
    for b, ids in enumerate(batch):
      tokens[b, width - len(ids):] = ids
    result = cached.generate(
        model, tokens, np.asarray([len(e) for e in batch], np.int32), config,
        max_new_tokens=MAX_NEW, rng=jax.random.fold_in(jax.random.key(0), i),
    )
    rows += [list(r) for r in np.asarray(result.tokens)[: len(batch) - 2 * i]]
  out = []
  for prompt, ids in zip(PROMPTS, rows, strict=True):
    ids, _ = distill_data.cut_at_eos(ids, tokenizer.eos_id())
    if ids:
      out.append({"prompt": prompt, "completion": tokenizer.decode(ids)})
  return out, tokenizer


@pytest.mark.parametrize(
    "schedule", [{}, {"threshold": 0.01}, {"steps_per_block": 2}]
)
def test_rows_are_the_checkpoints_own_decodes_on_the_run_and_its_export(
    run, tmp_path, capsys, schedule
):
  out, exported_dir, cfg, model, prompts = run
  flags = ["--max-new-tokens", str(MAX_NEW), "--batch-size", str(BATCH)]
  for key, value in schedule.items():
    flags += ["--" + key.replace("_", "-"), str(value)]
  expected, tokenizer = _direct(
      model, cfg, **{"threshold": distill_data.DEFAULT_THRESHOLD, **schedule}
  )
  assert len(expected) >= 2  # the random model does not stop at once.
  # The export reads back the same model: checked under one schedule.
  sources = (out, exported_dir) if not schedule else (out,)
  for i, source in enumerate(sources):
    target = tmp_path / f"rows{i}.jsonl"
    assert cli.main(
        ["distill-data", str(source), str(prompts), str(target), *flags]
    ) == 0
    assert f"to {target}" in capsys.readouterr().out
    assert _read_jsonl(target) == expected
  for i, row in enumerate(expected):
    # What an SFT recipe's `dataset.train=FILE` reads back.
    encoded = rows_lib.encode_row(
        row, where=f"x:{i}", index=i, tokenizer=tokenizer
    )
    assert encoded.completion[-1] == tokenizer.eos_id()


def test_sampling_is_seeded_and_differs_from_greedy(
    run, tmp_path
):
  out, _, _, _, prompts = run

  def rows(name, *flags):
    options = distill_data.parse_args([
        str(out), str(prompts), str(tmp_path / name),
        "--max-new-tokens", str(MAX_NEW), "--batch-size", str(BATCH), *flags,
    ])
    distill_data.run(options)
    return _read_jsonl(tmp_path / name)

  sampled = rows("a.jsonl", "--temperature", "1.5", "--seed", "3")
  assert sampled == rows("b.jsonl", "--temperature", "1.5", "--seed", "3")
  assert sampled != rows("c.jsonl")  # greedy


def test_the_checkpoint_kind_is_found_and_foreign_flags_are_refused(
    run, tmp_path, capsys
):
  out, exported_dir, _, _, prompts = run
  assert distill_diffusion.find(str(out)) == out.resolve()
  assert distill_diffusion.find(str(exported_dir)) == exported_dir.resolve()
  assert distill_diffusion.find(str(tmp_path)) is None
  assert distill_diffusion.find(str(tmp_path / "nope")) is None
  target = str(tmp_path / "out.jsonl")
  for source, flags, needle in [
      (out, ["--top-p", "0.5", "--temperature", "1"], "--top-p does not apply"),
      (out, ["--dtype", "bfloat16"], "--dtype does not apply"),
      (exported_dir, ["--eos-token", "x"], "--eos-token does not apply"),
      (tmp_path, ["--threshold", "0.5"], "it is an AR checkpoint"),
      (tmp_path, ["--steps-per-block", "2"], "--steps-per-block does not"),
      (out, ["--threshold", "0"], "--threshold must satisfy 0 < threshold"),
      (out, ["--threshold", "1.5"], "--threshold must satisfy"),
      (out, ["--steps-per-block", "0"], "--steps-per-block must be >= 1"),
  ]:
    argv = ["distill-data", str(source), str(prompts), target, *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
  dg = tmp_path / "dg_run"
  dg.mkdir()
  (dg / "recipe.yaml").write_text("model:\n  kind: tiny_diffusion_gemma\n")
  assert cli.main(["distill-data", str(dg), str(prompts), target]) == 2
  assert "is a DiffusionGemma run" in capsys.readouterr().err
  assert not (tmp_path / "out.jsonl").exists()
