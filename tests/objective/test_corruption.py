"""Tests for seeded per-block corruption and two-stream inputs (DESIGN 5.2)."""

from hypothesis import given
from hypothesis import strategies as st
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff.objective import corruption

MASK = 99


def _config(block_size=4, **kwargs):
  return config_lib.BlockDiffusionConfig(
      block_size=block_size, mask_token_id=MASK, **kwargs
  )


def _shifted(block_size=4, **kwargs):
  return _config(
      block_size, alignment="shifted", canvas="seed_and_mask", **kwargs
  )


def _batch():
  """MaxText's batch: padded rows, a partial final block in row 0."""
  tokens = np.array(
      [
          [11, 12, 13, 14, 15, 16, 17, 18, 19, 0],
          [21, 22, 23, 24, 25, 26, 0, 0, 0, 0],
      ],
      np.int32,
  )
  validity = tokens != 0
  return tokens, validity, validity.copy()


def _blocks(positions, segment_ids, block_size):
  """(segment, logical block) of every slot, as a hashable pair per slot."""
  return [
      list(zip(seg.tolist(), (pos // block_size).tolist()))
      for pos, seg in zip(positions, segment_ids)
  ]


def _assert_invariants(
    result, tokens, validity, completion, config, positions, segment_ids
):
  eligible = validity & completion
  corrupted, loss = result.corruption_mask, result.loss_mask
  assert corrupted.dtype == bool and loss.dtype == bool
  assert result.loss_weights.dtype == np.float32
  assert not (loss & ~eligible).any(), "loss outside valid & completion"
  assert not (corrupted & ~loss).any(), "corrupted slot not supervised"
  np.testing.assert_array_equal(
      result.inputs, np.where(corrupted, MASK, tokens)
  )
  np.testing.assert_array_equal(result.loss_weights > 0, loss)
  is_seed = positions % config.block_size == 0
  if config.canvas == "seed_and_mask":
    assert not (corrupted & is_seed).any(), "a seed was corrupted"
  candidate = eligible & (
      ~is_seed if config.canvas == "seed_and_mask" else True
  )
  blocks = _blocks(positions, segment_ids, config.block_size)
  for row in range(tokens.shape[0]):
    per_block = {}
    for slot, key in enumerate(blocks[row]):
      if candidate[row, slot]:
        per_block.setdefault(key, []).append(slot)
    for key, slots in per_block.items():
      rates = set(result.noise_rate[row, slots].tolist())
      assert len(rates) == 1, f"block {key} of row {row} has rates {rates}"
    has_target = {
        key: corrupted[row, slots].any() for key, slots in per_block.items()
    }
    if config.stream != "clean_prefix":
      assert all(has_target.values()), f"row {row}: a block has no target"
    else:
      # Per document: clean blocks before one cut, a target in every block
      # from the cut on.
      for doc in {seg for seg, _ in has_target}:
        flags = [has_target[k] for k in sorted(has_target) if k[0] == doc]
        cut = flags.index(True)
        assert all(flags[cut:]), f"row {row} doc {doc}: {flags}"


def test_min_noise_one_masks_every_eligible_slot():
  tokens, validity, completion = _batch()
  result = corruption.corrupt(
      tokens, validity, completion, _config(min_noise=1.0), seed=0
  )
  np.testing.assert_array_equal(result.corruption_mask, validity)
  np.testing.assert_array_equal(result.loss_mask, validity)
  np.testing.assert_array_equal(result.inputs, np.where(validity, MASK, 0))
  np.testing.assert_array_equal(
      result.loss_weights, validity.astype(np.float32)
  )
  np.testing.assert_allclose(result.noise_rate, validity.astype(np.float32))


@pytest.mark.parametrize("seed", range(8))
def test_every_nonempty_partial_or_full_block_has_a_target(seed):
  tokens, validity, completion = _batch()
  result = corruption.corrupt(
      tokens, validity, completion, _config(), seed=seed
  )
  for row in range(2):
    for start in range(0, 10, 4):
      if validity[row, start : start + 4].any():
        assert result.loss_mask[row, start : start + 4].any(), (row, start)
  # Row 0's last block is the single valid slot 8: it is always the target.
  assert result.corruption_mask[0, 8] and result.loss_mask[0, 8]


def test_noise_rate_is_constant_per_logical_block_of_packed_documents():
  # Two documents packed at physical 0..4 and 5..13; blocks by logical pos.
  positions = np.concatenate([np.arange(5), np.arange(9)])[None]
  segments = np.array([[0] * 5 + [1] * 9])
  tokens = np.arange(1, 15)[None]
  valid = np.ones((1, 14), bool)
  result = corruption.corrupt(
      tokens,
      valid,
      valid,
      _config(),
      seed=5,
      positions=positions,
      segment_ids=segments,
  )
  rate = result.noise_rate[0]
  # Doc 0: blocks {0..3}, {4}; doc 1: {0..3}, {4..7}, {8}.
  groups = [range(0, 4), range(4, 5), range(5, 9), range(9, 13), range(13, 14)]
  for group in groups:
    assert len(set(rate[list(group)].tolist())) == 1, group
  distinct = {float(rate[g[0]]) for g in groups}
  assert len(distinct) == len(groups), "each block draws its own rate"
  assert all(1e-3 <= r <= 1.0 for r in distinct)


def test_noise_rate_is_drawn_per_block_not_per_slot_or_per_row():
  # Statistics over many rows separate the three designs: with one rate per
  # block, per-block mask counts vary far more than Binomial(8, 1/2)
  # (variance ~6.7 vs 2) and two blocks of one row are uncorrelated (a
  # per-row rate would correlate them at ~0.8).
  rows, block_size = 400, 8
  tokens = np.ones((rows, 2 * block_size), np.int32)
  valid = np.ones_like(tokens, bool)
  result = corruption.corrupt(
      tokens, valid, valid, _config(block_size), seed=11
  )
  counts = result.corruption_mask.reshape(rows, 2, block_size).sum(-1)
  assert counts.var() > 4.5
  corr = np.corrcoef(counts[:, 0], counts[:, 1])[0, 1]
  assert abs(corr) < 0.25


def test_permuted_row_with_permuted_positions_gives_permuted_result():
  rng = np.random.default_rng(0)
  length = 16
  tokens = rng.integers(1, 50, (3, length))
  valid = np.ones((3, length), bool)
  valid[2, 12:] = False
  completion = valid.copy()
  completion[:, :3] = False
  positions = np.tile(np.arange(length), (3, 1))
  config = _config(block_size=8, min_noise=0.2)
  base = corruption.corrupt(
      tokens, valid, completion, config, seed=4, positions=positions
  )
  for perm in (
      np.arange(length)[::-1],
      np.array([0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]),
      rng.permutation(length),
  ):
    take = lambda x: x[:, perm]
    permuted = corruption.corrupt(
        take(tokens),
        take(valid),
        take(completion),
        config,
        seed=4,
        positions=take(positions),
    )
    for field in corruption.CorruptionResult._fields:
      np.testing.assert_array_equal(
          getattr(permuted, field), take(getattr(base, field)), err_msg=field
      )


def test_padding_does_not_change_an_examples_corruption():
  tokens = np.arange(1, 11)[None]
  valid = np.ones((1, 10), bool)
  config = _config(min_noise=0.3)
  short = corruption.corrupt(tokens, valid, valid, config, seed=2)
  padded_tokens = np.concatenate([tokens, np.zeros((1, 6), tokens.dtype)], 1)
  padded_valid = np.concatenate([valid, np.zeros((1, 6), bool)], 1)
  padded = corruption.corrupt(
      padded_tokens, padded_valid, padded_valid, config, seed=2
  )
  np.testing.assert_array_equal(
      padded.corruption_mask[:, :10], short.corruption_mask
  )
  np.testing.assert_array_equal(padded.noise_rate[:, :10], short.noise_rate)
  assert not padded.loss_mask[:, 10:].any()


@pytest.mark.parametrize("shifted", [False, True])
def test_prompt_slots_are_never_corrupted_or_supervised(shifted):
  tokens = np.arange(1, 13)[None].repeat(4, 0)
  valid = np.ones_like(tokens, bool)
  completion = np.zeros_like(valid)
  for row, start in enumerate([0, 3, 5, 9]):
    completion[row, start:] = True
  config = _shifted(min_noise=1.0) if shifted else _config(min_noise=1.0)
  result = corruption.corrupt(tokens, valid, completion, config, seed=0)
  assert not result.corruption_mask[~completion].any()
  assert not result.loss_mask[~completion].any()
  assert (result.loss_weights[~completion] == 0).all()
  np.testing.assert_array_equal(result.inputs[~completion], tokens[~completion])
  # Completions that start mid-block (rows 1..3) still supervise all of it,
  # except seeds of a first block under seed_and_mask.
  expected = completion & ~(np.arange(12)[None] == 0) if shifted else completion
  np.testing.assert_array_equal(result.loss_mask, expected)


def test_seed_and_mask_keeps_seeds_clean_and_supervises_later_seeds():
  tokens, validity, completion = _batch()
  result = corruption.corrupt(
      tokens, validity, completion, _shifted(min_noise=1.0), seed=0
  )
  assert not result.corruption_mask[:, ::4].any()
  np.testing.assert_array_equal(result.inputs[:, ::4], tokens[:, ::4])
  expected_loss = validity.copy()
  expected_loss[:, 0] = False  # a document's first seed has no predecessor.
  np.testing.assert_array_equal(result.loss_mask, expected_loss)
  expected_corrupted = expected_loss.copy()
  expected_corrupted[:, ::4] = False
  np.testing.assert_array_equal(result.corruption_mask, expected_corrupted)


def test_seed_and_mask_packed_documents_first_seed_unsupervised():
  positions = np.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
  segments = np.array([[0] * 6 + [1] * 6])
  tokens = np.arange(1, 13)[None]
  valid = np.ones((1, 12), bool)
  result = corruption.corrupt(
      tokens,
      valid,
      valid,
      _shifted(block_size=2, min_noise=1.0),
      seed=0,
      positions=positions,
      segment_ids=segments,
  )
  seeds = positions[0] % 2 == 0
  assert not result.corruption_mask[0, seeds].any()
  np.testing.assert_array_equal(result.corruption_mask[0], ~seeds)
  # Seeds at logical 2 and 4 of both documents are targets; logical 0 not.
  np.testing.assert_array_equal(result.loss_mask[0], positions[0] != 0)


def test_fixed_seed_is_deterministic_and_identity_changes_draws():
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, 50, (2, 32))
  valid = np.ones_like(tokens, bool)
  config = _config(min_noise=0.1)
  first = corruption.corrupt(tokens, valid, valid, config, seed=123)
  again = corruption.corrupt(tokens, valid, valid, config, seed=123)
  for field in corruption.CorruptionResult._fields:
    np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
  for kwargs in (
      {"seed": 124},
      {"seed": 123, "epoch": 1},
      {"seed": 123, "example_ids": [7, 8]},
  ):
    other = corruption.corrupt(tokens, valid, valid, config, **kwargs)
    assert not np.array_equal(other.noise_rate, first.noise_rate), kwargs


def test_example_identity_not_batch_row_fixes_randomness():
  rng = np.random.default_rng(2)
  tokens = rng.integers(1, 50, (3, 16))
  valid = np.ones_like(tokens, bool)
  config = _config(min_noise=0.1)
  batch = corruption.corrupt(
      tokens, valid, valid, config, seed=9, epoch=2, example_ids=[10, 11, 12]
  )
  alone = corruption.corrupt(
      tokens[2:],
      valid[2:],
      valid[2:],
      config,
      seed=9,
      epoch=2,
      example_ids=[12],
  )
  np.testing.assert_array_equal(
      alone.corruption_mask[0], batch.corruption_mask[2]
  )
  np.testing.assert_array_equal(alone.noise_rate[0], batch.noise_rate[2])


def test_all_invalid_row_gets_no_corruption_and_no_loss():
  tokens = np.array([[0, 0, 0, 0, 0], [5, 6, 7, 8, 9]], np.int32)
  valid = np.array([[0] * 5, [1] * 5], bool)
  for config in (_config(), _shifted(), _config(stream="clean_prefix")):
    result = corruption.corrupt(tokens, valid, valid, config, seed=0)
    assert not result.corruption_mask[0].any()
    assert not result.loss_mask[0].any()
    assert (result.loss_weights[0] == 0).all()
    assert (result.noise_rate[0] == 0).all()
    np.testing.assert_array_equal(result.inputs[0], tokens[0])
    assert result.loss_mask[1].any()


def test_single_slot_blocks_only_for_all_masked():
  # block_size=1: each block is one slot and must get a target, so every
  # eligible slot is masked whatever the noise rate.
  result = corruption.corrupt(
      np.array([[11, 12, 13]]),
      np.ones((1, 3), bool),
      np.array([[False, True, True]]),
      _config(block_size=1),
      seed=3,
  )
  np.testing.assert_array_equal(result.inputs, [[11, MASK, MASK]])
  with pytest.raises(ValueError, match=r"block_size must be >= 2"):
    _shifted(block_size=1)


def test_seed_and_mask_single_slot_final_block_is_a_clean_target():
  # Length 9, block 4: the final block is just the seed at logical 8.
  tokens = np.arange(1, 10)[None]
  valid = np.ones((1, 9), bool)
  result = corruption.corrupt(tokens, valid, valid, _shifted(), seed=0)
  assert not result.corruption_mask[0, 8]
  assert result.loss_mask[0, 8]
  assert result.inputs[0, 8] == 9


def test_elbo_weights_are_inverse_noise_rate_on_corrupted_targets():
  rng = np.random.default_rng(3)
  tokens = rng.integers(1, 50, (4, 24))
  valid = np.ones_like(tokens, bool)
  for config in (
      _config(loss_weighting="elbo", min_noise=0.05),
      _shifted(loss_weighting="elbo", min_noise=0.05),
  ):
    result = corruption.corrupt(tokens, valid, valid, config, seed=1)
    corrupted = result.corruption_mask
    np.testing.assert_allclose(
        result.loss_weights[corrupted],
        1.0 / result.noise_rate[corrupted],
        rtol=1e-6,
    )
    assert (result.loss_weights[corrupted] >= 1.0).all()
    assert (result.loss_weights[~result.loss_mask] == 0).all()
    # Clean seed targets are not noised, so they keep weight 1.
    seed_targets = result.loss_mask & ~corrupted
    np.testing.assert_array_equal(result.loss_weights[seed_targets], 1.0)
  uniform = corruption.corrupt(tokens, valid, valid, _config(), seed=1)
  np.testing.assert_array_equal(
      uniform.loss_weights, uniform.loss_mask.astype(np.float32)
  )


def test_clean_prefix_keeps_blocks_before_the_cut_clean_and_unsupervised():
  tokens = np.arange(1, 25)[None].repeat(16, 0)
  valid = np.ones_like(tokens, bool)
  config = _config(stream="clean_prefix", min_noise=1.0)
  result = corruption.corrupt(tokens, valid, valid, config, seed=0)
  cuts = set()
  for row in range(16):
    loss_blocks = result.loss_mask[row].reshape(6, 4).any(-1)
    cut = int(np.argmax(loss_blocks))
    cuts.add(cut)
    # Before the cut: clean and unsupervised; from it on: all masked.
    assert not result.corruption_mask[row, : 4 * cut].any()
    assert not result.loss_mask[row, : 4 * cut].any()
    assert result.corruption_mask[row, 4 * cut :].all()
  assert len(cuts) > 2, f"the cut block should vary, got {cuts}"


def test_clean_prefix_cut_per_document_under_seed_and_mask():
  positions = np.concatenate([np.arange(12), np.arange(12)])[None].repeat(8, 0)
  segments = np.array([[0] * 12 + [1] * 12]).repeat(8, 0)
  tokens = np.arange(1, 25)[None].repeat(8, 0)
  valid = np.ones_like(tokens, bool)
  config = _shifted(stream="clean_prefix", min_noise=1.0)
  result = corruption.corrupt(
      tokens,
      valid,
      valid,
      config,
      seed=0,
      positions=positions,
      segment_ids=segments,
  )
  for row in range(8):
    for doc in range(2):
      doc_loss = result.loss_mask[row, 12 * doc : 12 * (doc + 1)]
      cut = int(np.argmax(doc_loss.reshape(3, 4).any(-1)))
      assert not doc_loss[: 4 * cut].any()
      # From the cut on: every non-seed slot corrupted, seeds (but not a
      # first-block seed) supervised clean.
      doc_corrupt = result.corruption_mask[row, 12 * doc : 12 * (doc + 1)]
      after = np.arange(12) >= 4 * cut
      seeds = np.arange(12) % 4 == 0
      np.testing.assert_array_equal(doc_corrupt, after & ~seeds)
      np.testing.assert_array_equal(doc_loss, after & ~(np.arange(12) == 0))


def test_bad_inputs_raise_naming_the_argument():
  tokens, validity, completion = _batch()
  config = _config()
  with pytest.raises(TypeError, match=r"config must be a BlockDiffusionConfig"):
    corruption.corrupt(tokens, validity, completion, {"block_size": 4}, seed=0)
  with pytest.raises(TypeError, match=r"tokens must have an integer dtype"):
    corruption.corrupt(
        tokens.astype(float), validity, completion, config, seed=0
    )
  with pytest.raises(ValueError, match=r"validity must have the shape"):
    corruption.corrupt(tokens, validity[:, :-1], completion, config, seed=0)
  with pytest.raises(ValueError, match=r"tokens must have shape"):
    corruption.corrupt(tokens[0], validity[0], completion[0], config, seed=0)
  with pytest.raises(ValueError, match=r"nonempty"):
    corruption.corrupt(
        np.zeros((1, 0), np.int32),
        np.zeros((1, 0), bool),
        np.zeros((1, 0), bool),
        config,
        seed=0,
    )
  with pytest.raises(ValueError, match=r"example_ids must have shape"):
    corruption.corrupt(
        tokens, validity, completion, config, seed=0, example_ids=[1]
    )
  with pytest.raises(ValueError, match=r"seed must be >= 0"):
    corruption.corrupt(tokens, validity, completion, config, seed=-1)
  with pytest.raises(ValueError, match=r"positions must be >= 0"):
    corruption.corrupt(
        tokens,
        validity,
        completion,
        config,
        seed=0,
        positions=np.full(tokens.shape, -1),
    )


def test_build_two_stream_inputs_shapes_and_halves():
  tokens, validity, completion = _batch()
  positions = np.tile(np.arange(10), (2, 1))
  segments = np.zeros((2, 10), np.int32)
  result = corruption.corrupt(
      tokens, validity, completion, _config(stream="two_stream"), seed=0
  )
  two = corruption.build_two_stream_inputs(
      tokens, result, validity, positions=positions, segment_ids=segments
  )
  for field in corruption.TwoStreamInputs._fields:
    assert getattr(two, field).shape == (2, 20), field
  np.testing.assert_array_equal(two.tokens[:, :10], tokens)
  np.testing.assert_array_equal(two.tokens[:, 10:], result.inputs)
  np.testing.assert_array_equal(two.positions[:, 10:], positions)
  np.testing.assert_array_equal(two.positions[:, :10], positions)
  np.testing.assert_array_equal(two.validity[:, 10:], validity)
  np.testing.assert_array_equal(two.is_noised[:, :10], False)
  np.testing.assert_array_equal(two.is_noised[:, 10:], True)
  np.testing.assert_array_equal(two.targets[:, 10:], tokens)
  np.testing.assert_array_equal(two.loss_weights[:, :10], 0.0)
  np.testing.assert_array_equal(two.loss_weights[:, 10:], result.loss_weights)
  with pytest.raises(
      ValueError, match=r"corruption arrays must have the shape"
  ):
    corruption.build_two_stream_inputs(tokens[:, :8], result, validity[:, :8])


@st.composite
def _corruption_cases(draw):
  batch = draw(st.integers(1, 3))
  length = draw(st.integers(1, 14))
  shifted = draw(st.booleans())
  block_size = draw(st.integers(2 if shifted else 1, 6))
  kwargs = dict(
      min_noise=draw(st.sampled_from([1e-3, 0.3, 1.0])),
      loss_weighting=draw(st.sampled_from(["uniform", "elbo"])),
      stream=draw(st.sampled_from(["single", "two_stream", "clean_prefix"])),
  )
  config = (
      _shifted(block_size, **kwargs)
      if shifted
      else _config(block_size, **kwargs)
  )
  positions = np.zeros((batch, length), np.int64)
  segments = np.zeros((batch, length), np.int64)
  for row in range(batch):
    start, doc = 0, 0
    while start < length:
      size = draw(st.integers(1, length - start))
      positions[row, start : start + size] = np.arange(size)
      segments[row, start : start + size] = doc
      start, doc = start + size, doc + 1
  bools = lambda: np.array(
      draw(
          st.lists(
              st.lists(st.booleans(), min_size=length, max_size=length),
              min_size=batch,
              max_size=batch,
          )
      )
  )
  validity, completion = bools(), bools()
  tokens = np.array(
      draw(
          st.lists(
              st.lists(st.integers(0, 50), min_size=length, max_size=length),
              min_size=batch,
              max_size=batch,
          )
      )
  )
  perm = np.array(draw(st.permutations(list(range(length)))))
  seed = draw(st.integers(0, 2**16))
  return tokens, validity, completion, config, positions, segments, perm, seed


@given(_corruption_cases())
def test_property_corruption_invariants_and_permutation(case):
  tokens, validity, completion, config, positions, segments, perm, seed = case
  result = corruption.corrupt(
      tokens,
      validity,
      completion,
      config,
      seed=seed,
      positions=positions,
      segment_ids=segments,
  )
  _assert_invariants(
      result, tokens, validity, completion, config, positions, segments
  )
  take = lambda x: x[:, perm]
  permuted = corruption.corrupt(
      take(tokens),
      take(validity),
      take(completion),
      config,
      seed=seed,
      positions=take(positions),
      segment_ids=take(segments),
  )
  for field in corruption.CorruptionResult._fields:
    np.testing.assert_array_equal(
        getattr(permuted, field), take(getattr(result, field)), err_msg=field
    )
