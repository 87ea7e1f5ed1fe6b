"""`benchmarks/diffusion_gemma_step.py` on the tiny size, so it cannot rot.

The TPU figures come from `--size 26b_a4b_2layers --dtype bfloat16`.
"""

import json
import pathlib
import sys

from flax import nnx
import jax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]
                       / "benchmarks"))

import diffusion_gemma_sampler  # noqa: E402  pylint: disable=g-import-not-at-top
import diffusion_gemma_step  # noqa: E402  pylint: disable=g-import-not-at-top

from tunix_blockdiff.kinds.diffusion_gemma import entropy_bound  # noqa: E402
from tunix_blockdiff.models import diffusion_gemma as dg  # noqa: E402


def test_the_tiny_step_reports_time_memory_and_lora_share(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert diffusion_gemma_step.main([
      "--batch", "2", "--seq-len", "24", "--repeats", "1", "--no-sampler",
      "--json", str(out)]) == 0
  assert "LoRA SFT step, dense attention:" in capsys.readouterr().out
  (row,) = json.loads(out.read_text())
  assert row["attention"] == "dense" and np.isfinite(row["first_loss"])
  assert row["step_s"] > 0 and row["tokens_per_s"] > 0
  assert 0 < row["lora_params"] < row["params"]


def test_the_real_width_size_is_the_26b_a4b_layer():
  config = diffusion_gemma_sampler.config_of("26b_a4b_2layers", "bfloat16")
  assert (config.hidden_size, config.num_experts, config.top_k_experts,
          config.moe_intermediate_size, config.vocab_size) == (
              2816, 128, 8, 704, 262144)
  assert config.layer_types == ("sliding_attention", "full_attention")
  shapes = nnx.eval_shape(lambda: dg.DiffusionGemma(config,
                                                    rngs=nnx.Rngs(0)))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
  # Embedding 262144 x 2816 plus two layers of 128 experts: about 2.3B.
  assert 2.0e9 < params < 2.6e9


def test_bad_flags_are_refused():
  with pytest.raises(SystemExit):
    diffusion_gemma_step.main(["--size", "huge"])
  with pytest.raises(SystemExit):
    diffusion_gemma_step.main(["--batch", "0"])
  with pytest.raises(SystemExit):
    diffusion_gemma_step.main(["--attention", "dense,flash"])
  with pytest.raises(SystemExit):  # 512 does not divide 64
    diffusion_gemma_step.main(["--attention", "splash", "--seq-len", "64"])


def test_the_draw_alone_is_timed_against_the_earlier_draws():
  row = diffusion_gemma_sampler.measure_draw(2, 4, 300, repeats=1)
  assert set(row["ms"]) == {"sample_with_entropy", "stored exponent",
                            "stored log-softmax"}
  assert row["speedup"] > 0 and row["speedup_exponent"] > 0
  # The references draw what the sampler draws (same uniforms; a draw
  # differs only where rounding moves a CDF boundary). V 300 is not a
  # multiple of the 128-entry blocks: the padded tail never draws.
  key = jax.random.key(0)
  logits = 3.0 * jax.random.normal(jax.random.key(1), (2, 4, 300))
  got = entropy_bound.sample_with_entropy(key, logits)
  assert int(np.max(np.asarray(got[0]))) < 300
  want = diffusion_gemma_sampler.stored_log_softmax_draw(key, logits)
  np.testing.assert_array_equal(got[2], want[2])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
  assert np.mean(np.asarray(got[0]) == np.asarray(want[0])) >= 0.75
  # The stored exponent's blocks are the same numbers: the same draws.
  same = diffusion_gemma_sampler.stored_exponent_draw(key, logits)
  np.testing.assert_array_equal(got[0], same[0])
  np.testing.assert_allclose(got[1], same[1], rtol=1e-5)  # sum order
