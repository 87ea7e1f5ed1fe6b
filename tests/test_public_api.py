"""The public names of DESIGN.md section 4 that the foundation covers exist,
with the documented signatures and meanings."""

import dataclasses
import inspect
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import tunix_blockdiff as tbd

_EMPTY = inspect.Parameter.empty
_KW = inspect.Parameter.KEYWORD_ONLY


def _params(fn):
  return inspect.signature(fn).parameters


def _field_defaults(cls):
  return [
      (f.name, f.default if f.default is not dataclasses.MISSING else _EMPTY)
      for f in dataclasses.fields(cls)
  ]


def test_block_diffusion_config_fields_and_defaults():
  assert _field_defaults(tbd.BlockDiffusionConfig) == [
      ("block_size", _EMPTY),
      ("mask_token_id", _EMPTY),
      ("alignment", "same_position"),
      ("canvas", "all_masked"),
      ("stream", "single"),
      ("min_noise", 1e-3),
      ("loss_weighting", "uniform"),
      ("certainty_weight", 0.0),
      ("certainty_temperature", 1.0),
  ]


def test_denoise_config_fields_and_defaults():
  assert _field_defaults(tbd.DenoiseConfig) == [
      ("block_size", _EMPTY),
      ("mask_token_id", _EMPTY),
      ("threshold", 0.9),
      ("alignment", "same_position"),
      ("steps_per_block", None),
      ("temperature", 0.0),
      ("top_k", None),
      ("top_p", None),
      ("eos_token_id", None),
      ("pad_token_id", 0),
      # Added after DESIGN.md's fields (Fast-dLLM v2's rule), so positional
      # construction is unchanged.
      ("sub_block_size", None),
  ]


def test_block_causal_mask_signature_and_meaning():
  params = _params(tbd.block_causal_mask)
  assert list(params)[:3] == ["q_positions", "kv_positions", "block_size"]
  for name in ("q_segment_ids", "kv_segment_ids", "kv_valid"):
    assert params[name].kind == _KW and params[name].default is None
  pos = np.arange(10)
  mask = tbd.block_causal_mask(pos, pos, 4)
  assert mask.shape == (1, 10, 10) and mask.dtype == jnp.bool_
  assert mask[0, 1, 3] and not mask[0, 3, 4] and mask[0, 4, 3]


def test_context_parallel_signatures_and_meaning():
  assert list(_params(tbd.load_balance_order)) == ["seq_len", "cp_size"]
  for fn in (
      tbd.reorder_for_context_parallel,
      tbd.restore_from_context_parallel,
  ):
    params = _params(fn)
    assert list(params) == ["x", "cp_size", "axis"]
    assert params["axis"].default == 1
  order = tbd.load_balance_order(8, 2)
  np.testing.assert_array_equal(order, [0, 1, 6, 7, 2, 3, 4, 5])
  x = np.arange(8)[None]
  np.testing.assert_array_equal(
      tbd.reorder_for_context_parallel(x, 2)[0], order
  )
  np.testing.assert_array_equal(
      tbd.restore_from_context_parallel(
          tbd.reorder_for_context_parallel(x, 2), 2
      ),
      x,
  )


def test_corrupt_signature_and_meaning():
  params = _params(tbd.corrupt)
  assert list(params)[:4] == ["tokens", "validity", "completion", "config"]
  assert params["seed"].kind == _KW and params["seed"].default is _EMPTY
  config = tbd.BlockDiffusionConfig(
      block_size=2, mask_token_id=9, min_noise=1.0
  )
  tokens = np.array([[1, 2, 3, 4]])
  completion = np.array([[False, False, True, True]])
  result = tbd.corrupt(
      tokens, np.ones((1, 4), bool), completion, config, seed=0
  )
  assert isinstance(result, tbd.CorruptionResult)
  np.testing.assert_array_equal(result.inputs, [[1, 2, 9, 9]])
  np.testing.assert_array_equal(result.loss_mask, completion)


def test_align_logits_signature_and_meaning():
  params = _params(tbd.align_logits)
  assert list(params)[:4] == ["logits", "alignment", "positions", "validity"]
  assert params["positions"].default is None
  assert params["validity"].default is None
  logits = jnp.arange(4.0).reshape(1, 4, 1)
  np.testing.assert_array_equal(
      tbd.align_logits(logits, "shifted")[0, :, 0], [0, 0, 1, 2]
  )
  np.testing.assert_array_equal(
      tbd.align_logits(logits, "same_position"), logits
  )


def test_diffusion_loss_signature_and_meaning():
  params = _params(tbd.diffusion_loss)
  assert list(params) == [
      "logits",
      "targets",
      "loss_weights",
      "certainty_weight",
      "certainty_temperature",
  ]
  assert params["certainty_weight"].kind == _KW
  assert params["certainty_weight"].default == 0.0
  assert params["certainty_temperature"].default == 1.0
  logits = jnp.zeros((1, 2, 4))
  out = tbd.diffusion_loss(logits, jnp.array([[1, 2]]), jnp.array([[1.0, 0.0]]))
  assert isinstance(out, tbd.LossOutput)
  assert isinstance(out.primary_loss, tbd.WeightedMetric)
  np.testing.assert_allclose(out.primary_loss.compute(), np.log(4.0), rtol=1e-6)
  assert float(out.primary_loss.denominator) == 1.0


def test_foundation_names_are_the_module_objects():
  from tunix_blockdiff import compat
  from tunix_blockdiff.models import logits as modeling
  from tunix_blockdiff.attention import context_parallel
  from tunix_blockdiff.attention import masks
  from tunix_blockdiff.objective import alignment
  from tunix_blockdiff.objective import corruption
  from tunix_blockdiff.objective import loss

  assert tbd.block_causal_mask is masks.block_causal_mask
  assert tbd.two_stream_mask is masks.two_stream_mask
  assert tbd.load_balance_order is context_parallel.load_balance_order
  assert (
      tbd.reorder_batch_for_context_parallel
      is context_parallel.reorder_batch_for_context_parallel
  )
  assert tbd.corrupt is corruption.corrupt
  assert tbd.build_two_stream_inputs is corruption.build_two_stream_inputs
  assert tbd.align_logits is alignment.align_logits
  assert tbd.diffusion_loss is loss.diffusion_loss
  assert tbd.LossOutput is compat.LossOutput
  assert tbd.DiffusionTokenBatch is compat.DiffusionTokenBatch
  assert tbd.block_diffusion_logits is modeling.block_diffusion_logits
  assert tbd.two_stream_logits is modeling.two_stream_logits
  assert tbd.make_logits_fn is modeling.make_logits_fn


def test_all_lists_section_four_names():
  section_four = {
      "BlockDiffusionConfig",
      "DenoiseConfig",
      "block_causal_mask",
      "load_balance_order",
      "reorder_for_context_parallel",
      "restore_from_context_parallel",
      "corrupt",
      "align_logits",
      "diffusion_loss",
      "BlockDiffusionTrainer",
      "denoise",
      "DenoiseResult",
      "generate",
      "BlockDiffusionRollout",
      "register",
  }
  assert section_four <= set(tbd.__all__)
  # Every public name is lazy, resolves, and is listed by dir().
  assert set(tbd.__all__) == set(tbd._LAZY)
  for name in tbd.__all__:
    assert hasattr(tbd, name), name
    assert name in dir(tbd)


def test_importing_the_package_and_the_launcher_loads_no_jax():
  # A fresh interpreter: `import tunix_blockdiff`, `tunix-blockdiff --help`
  # and the launcher (a parent that only starts processes) stay instant.
  script = (
      "import sys, contextlib, io\n"
      "import tunix_blockdiff\n"
      "from tunix_blockdiff import cli\n"
      "from tunix_blockdiff.jobs import launch\n"
      "with contextlib.redirect_stdout(io.StringIO()):\n"
      "  assert cli.main(['--help']) == 0\n"
      "launch.parse_args(['--processes', '2', '--', 'sft'])\n"
      "print(sorted(m for m in ('jax', 'tunix', 'flax') if m in sys.modules))\n"
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]"


def test_trajectory_logprob_signature():
  from tunix_blockdiff.rl import likelihood

  assert tbd.trajectory_logprob is likelihood.trajectory_logprob
  params = _params(tbd.trajectory_logprob)
  assert list(params)[:3] == [
      "model_or_logits_fn",
      "generation_result",
      "config",
  ]
  assert params["likelihood"].kind == _KW
  assert params["likelihood"].default == "exact"


def test_unknown_attribute_raises_attribute_error():
  with pytest.raises(AttributeError, match=r"no attribute 'not_a_name'"):
    tbd.not_a_name  # pylint: disable=pointless-statement


def test_upstream_names_follow_tunix_signatures():
  from tunix_blockdiff import compat
  from tunix_blockdiff import upstream

  assert tbd.configure_diffusion_sft is upstream.configure_diffusion_sft
  assert tbd.diffusion_loss_fn is upstream.diffusion_loss_fn
  assert tbd.BlockDiffusionBatchAdapter is upstream.BlockDiffusionBatchAdapter
  assert tbd.BlockDiffusionLogitsFn is upstream.BlockDiffusionLogitsFn
  assert tbd.compute_diffusion_logits is compat.compute_diffusion_logits
  assert tbd.DiffusionBatchAdapter is compat.DiffusionBatchAdapter
  assert tbd.DiffusionLogitsFn is compat.DiffusionLogitsFn
  # Tunix #1891's argument order; our extra option is keyword-only.
  params = _params(tbd.diffusion_loss_fn)
  assert list(params)[:3] == ["model", "batch", "logits_fn"]
  params = _params(tbd.configure_diffusion_sft)
  assert list(params)[:3] == ["trainer", "batch_adapter", "logits_fn"]
  assert params["denominator"].kind == _KW
  assert list(_params(tbd.compute_diffusion_logits)) == [
      "model",
      "batch",
      "logits_fn",
  ]
