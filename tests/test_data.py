"""Tests for the SFT data pipeline (tunix_blockdiff.data)."""

import dataclasses

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from tunix_blockdiff import config as config_lib
from tunix_blockdiff import data
from tunix_blockdiff.attention import context_parallel
from tunix_blockdiff.attention import splash

VOCAB = 50
MASK = 3
BLOCK = 4


def _raw(lengths, seed=0):
  """(prompt, completion) pairs of random ids in [4, VOCAB) (no mask id)."""
  rng = np.random.default_rng(seed)
  return [
      (rng.integers(4, VOCAB, p).tolist(), rng.integers(4, VOCAB, c).tolist())
      for p, c in lengths
  ]


def _examples(lengths, seq_len=32, seed=0):
  return data.as_examples(
      _raw(lengths, seed), seq_len=seq_len, vocab_size=VOCAB, mask_token_id=MASK
  )


def _dcfg(**kw):
  return config_lib.BlockDiffusionConfig(
      block_size=kw.pop("block_size", BLOCK), mask_token_id=MASK, **kw
  )


def _docs_of(batch, row):
  """{segment id: dict of that document's slots} in logical order."""
  docs = {}
  for seg in np.unique(batch["segment_ids"][row]):
    if seg == 0:
      continue
    idx = np.flatnonzero(batch["segment_ids"][row] == seg)
    idx = idx[np.argsort(batch["positions"][row, idx])]
    docs[int(seg)] = {k: v[row, idx] for k, v in batch.items()} | {"slots": idx}
  return docs


# Validation.


@pytest.mark.parametrize(
    "raw, match",
    [
        ([([1, 2], [])], "completion is empty"),
        ([([4] * 30, [5] * 3)], "longer than seq_len=32"),
        ([([4, 60], [5])], "prompt token id 60 is outside the vocabulary"),
        ([([4], [5, -1, 70])], "completion token id -1 is outside the"),
        ([([4], [MASK])], "completion contains the mask token"),
        ([([MASK], [4])], "prompt contains the mask token"),
        ([([], [4, VOCAB])], f"completion token id {VOCAB} is outside"),
        ([([4], [[5, 6]])], "1-D"),
        ([{"prompt": [4]}], "keys 'prompt' and 'completion'"),
        ([7], "expected \\(prompt_ids, completion_ids\\)"),
    ],
)
def test_as_examples_rejects_bad_examples(raw, match):
  with pytest.raises(ValueError, match=match):
    data.as_examples(raw, seq_len=32, vocab_size=VOCAB, mask_token_id=MASK)


def test_as_examples_names_the_bad_example_and_accepts_mappings():
  good = {"prompt": [4, 5], "completion": np.array([6, 7])}
  examples = data.as_examples([good], seq_len=4, vocab_size=VOCAB)
  assert examples[0].example_id == 0
  np.testing.assert_array_equal(examples[0].completion, [6, 7])
  with pytest.raises(ValueError, match="example 1 has 5 tokens"):
    data.as_examples([good, ([4, 4, 4], [5, 5])], seq_len=4, vocab_size=VOCAB)
  with pytest.raises(TypeError, match="integer token ids"):
    data.as_examples([([4.5], [5])], seq_len=4, vocab_size=VOCAB)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(packing="greedy"), ValueError, "packing must be one of"),
        (dict(cp_size=3), ValueError, "cp_size must be 1 or even"),
        (dict(cp_size=4, seq_len=20), ValueError, "divisible by 2 \\* cp_size"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1"),
        (dict(pad_token_id=VOCAB), ValueError, "pad_token_id must be <"),
        (dict(seq_len=8.0), TypeError, "seq_len must be an int"),
    ],
)
def test_data_config_validation(kwargs, error, match):
  base = dict(seq_len=32, batch_size=2, vocab_size=VOCAB)
  with pytest.raises(error, match=match):
    data.DataConfig(**(base | kwargs))


def test_block_aligned_packing_needs_seq_len_multiple_of_block():
  with pytest.raises(ValueError, match="multiple of block_size=4"):
    data.SFTBatches(
        _examples([(2, 3)]),
        _dcfg(),
        data.DataConfig(
            seq_len=30, batch_size=1, vocab_size=VOCAB, packing="block_aligned"
        ),
    )


# Batch invariants.

_LENGTHS = st.lists(
    st.tuples(st.integers(0, 7), st.integers(1, 9)), min_size=1, max_size=12
)


@hypothesis.given(
    lengths=_LENGTHS,
    packing=st.sampled_from(data.PACKINGS),
    stream=st.sampled_from(("single", "two_stream", "clean_prefix")),
    shifted=st.booleans(),
    seed=st.integers(0, 3),
)
def test_batch_invariants(lengths, packing, stream, shifted, seed):
  dcfg = _dcfg(
      stream=stream,
      alignment="shifted" if shifted else "same_position",
      canvas="seed_and_mask" if shifted else "all_masked",
  )
  examples = _examples(lengths, seed=seed)
  cfg = data.DataConfig(
      seq_len=32,
      batch_size=2,
      vocab_size=VOCAB,
      seed=seed,
      packing=packing,
      num_epochs=1,
  )
  batches = list(data.SFTBatches(examples, dcfg, cfg))
  seen = []
  for batch in batches:
    assert set(batch) == set(data.BATCH_FIELDS)
    for name in data.BATCH_FIELDS:
      assert batch[name].shape == (2, 32), name
    valid = batch["validity"]
    np.testing.assert_array_equal(batch["targets"], batch["tokens"])
    # Masks are nested as documented.
    assert not np.any(batch["completion"] & ~valid)
    assert not np.any(batch["loss_mask"] & ~(valid & batch["completion"]))
    assert not np.any(batch["corruption_mask"] & ~batch["loss_mask"])
    np.testing.assert_array_equal(
        batch["inputs"],
        np.where(batch["corruption_mask"], MASK, batch["tokens"]),
    )
    np.testing.assert_array_equal(batch["loss_weights"] > 0, batch["loss_mask"])
    assert np.all(batch["segment_ids"][~valid] == 0)
    assert np.all(batch["tokens"][~valid] == 0)
    for row in range(2):
      for doc in _docs_of(batch, row).values():
        n = doc["slots"].size
        np.testing.assert_array_equal(doc["positions"], np.arange(n))
        # Contiguous, prompt first, then completion.
        np.testing.assert_array_equal(
            doc["slots"], doc["slots"][0] + np.arange(n)
        )
        if packing == "block_aligned":
          assert doc["slots"][0] % BLOCK == 0
        c = int(doc["completion"].sum())
        assert doc["completion"][n - c :].all()
        assert doc["completion"].any()
        # Every block holding a (non-seed) completion slot beyond any clean
        # prefix cut has a target; the prompt is never a target.
        assert not doc["loss_mask"][: n - c].any()
        if stream != "clean_prefix" and not shifted:
          blocks = np.unique(np.arange(n - c, n) // BLOCK)
          for blk in blocks:
            assert doc["loss_mask"][np.arange(n) // BLOCK == blk].any()
        seen.append(tuple(doc["tokens"]))
    if packing != "unaligned":
      # The trainer's static Splash mask (`training_mask_mode`) relies on it.
      assert bool(splash.static_mask_matches(
          batch["positions"], BLOCK, segment_ids=batch["segment_ids"],
          validity=valid))
  if packing == "none":
    # One epoch, unpacked: every example once (a final partial batch dropped).
    assert len(seen) == (len(examples) // 2) * 2


def test_corruption_of_a_document_does_not_depend_on_packing():
  examples = _examples([(3, 5), (2, 7), (4, 2), (1, 9), (5, 5), (0, 6)], seed=1)
  dcfg = _dcfg(stream="clean_prefix")
  per_packing = {}
  for packing in data.PACKINGS:
    cfg = data.DataConfig(
        seq_len=32,
        batch_size=2,
        vocab_size=VOCAB,
        packing=packing,
        shuffle=False,
        num_epochs=1,
    )
    docs = {}
    for batch in data.SFTBatches(examples, dcfg, cfg):
      for row in range(2):
        for doc in _docs_of(batch, row).values():
          docs[tuple(doc["tokens"])] = (doc["inputs"], doc["loss_weights"])
    per_packing[packing] = docs
  reference = per_packing["none"]
  assert reference
  for packing in ("block_aligned", "unaligned"):
    for key, (inputs, weights) in per_packing[packing].items():
      np.testing.assert_array_equal(inputs, reference[key][0])
      np.testing.assert_array_equal(weights, reference[key][1])


def test_packing_first_fit_packs_several_documents_per_row():
  examples = _examples([(2, 3)] * 8)
  cfg = data.DataConfig(
      seq_len=16,
      batch_size=2,
      vocab_size=VOCAB,
      packing="unaligned",
      shuffle=False,
      num_epochs=1,
  )
  batch = next(iter(data.SFTBatches(examples, _dcfg(), cfg)))
  # Five-token documents: three fit in 16 slots unaligned...
  np.testing.assert_array_equal(
      batch["segment_ids"][0, :15], np.repeat([1, 2, 3], 5)
  )
  assert batch["validity"].sum() == 30
  aligned = dataclasses.replace(cfg, packing="block_aligned")
  batch = next(iter(data.SFTBatches(examples, _dcfg(), aligned)))
  # ...and two when each must start at a multiple of 4 (slots 0 and 8).
  np.testing.assert_array_equal(
      np.flatnonzero(np.diff(batch["segment_ids"][0]) != 0) + 1, [5, 8, 13]
  )


# Determinism, epochs, seeds.


def _all(ds):
  return [b for b in ds]


def test_deterministic_given_seed_and_reiterable():
  examples = _examples([(3, 4)] * 10 + [(2, 6)] * 6)
  cfg = data.DataConfig(
      seq_len=16, batch_size=4, vocab_size=VOCAB, seed=5, num_epochs=2
  )
  ds = data.SFTBatches(examples, _dcfg(), cfg)
  first, again = _all(ds), _all(data.SFTBatches(examples, _dcfg(), cfg))
  assert len(first) == 8
  for a, b, c in zip(first, again, _all(ds)):
    for name in data.BATCH_FIELDS:
      np.testing.assert_array_equal(a[name], b[name])
      np.testing.assert_array_equal(a[name], c[name])
  other = _all(
      data.SFTBatches(examples, _dcfg(), dataclasses.replace(cfg, seed=6))
  )
  assert any(
      not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other)
  )


def test_epochs_reshuffle_and_recorrupt_every_example_once_per_epoch():
  examples = _examples([(2, 6)] * 12, seed=3)
  cfg = data.DataConfig(
      seq_len=8, batch_size=4, vocab_size=VOCAB, seed=0, num_epochs=2
  )
  batches = _all(data.SFTBatches(examples, _dcfg(), cfg))
  assert len(batches) == 6
  epochs = [
      np.concatenate([b["tokens"] for b in batches[3 * e : 3 * e + 3]])
      for e in (0, 1)
  ]
  key = lambda rows: sorted(map(tuple, rows))
  all_docs = [tuple(np.concatenate([e.prompt, e.completion])) for e in examples]
  assert key(epochs[0]) == key(epochs[1]) == sorted(all_docs)
  assert not np.array_equal(epochs[0], epochs[1])  # new order
  # The same example gets new noise in the next epoch.
  inputs = [
      np.concatenate([b["inputs"] for b in batches[3 * e : 3 * e + 3]])
      for e in (0, 1)
  ]
  by_doc = [dict(zip(map(tuple, epochs[e]), inputs[e])) for e in (0, 1)]
  assert any(not np.array_equal(by_doc[0][k], by_doc[1][k]) for k in by_doc[0])


def test_encode_document_is_a_function_of_seed_epoch_and_id():
  ex = _examples([(3, 9)])[0]
  dcfg = _dcfg()
  a = data.encode_document(ex, dcfg, seed=1, epoch=2)
  b = data.encode_document(ex, dcfg, seed=1, epoch=2)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  moved = ex._replace(example_id=7)
  draws = [
      data.encode_document(e, dcfg, seed=s, epoch=p)["corruption_mask"]
      for e, s, p in [(moved, 1, 2), (ex, 2, 2), (ex, 1, 3)]
  ]
  assert any(not np.array_equal(a["corruption_mask"], d) for d in draws)


# Context parallelism, two-stream view, eval batches, prompts.


def test_context_parallel_reordering_permutes_every_field():
  examples = _examples([(3, 5)] * 4)
  base = data.DataConfig(
      seq_len=16, batch_size=2, vocab_size=VOCAB, shuffle=False, num_epochs=1
  )
  plain = _all(data.SFTBatches(examples, _dcfg(), base))
  cp = _all(
      data.SFTBatches(examples, _dcfg(), dataclasses.replace(base, cp_size=2))
  )
  order = context_parallel.load_balance_order(16, 2)
  assert not np.array_equal(order, np.arange(16))
  for a, b in zip(plain, cp):
    for name in data.BATCH_FIELDS:
      np.testing.assert_array_equal(b[name], a[name][:, order])
      np.testing.assert_array_equal(
          context_parallel.restore_from_context_parallel(b[name], 2), a[name]
      )


def test_two_stream_batch_halves():
  batch = next(
      iter(
          data.SFTBatches(
              _examples([(3, 5)] * 2),
              _dcfg(),
              data.DataConfig(
                  seq_len=12, batch_size=2, vocab_size=VOCAB, num_epochs=1
              ),
          )
      )
  )
  two = data.two_stream_batch(batch)
  for value in two.values():
    assert value.shape == (2, 24)
  np.testing.assert_array_equal(two["tokens"][:, :12], batch["tokens"])
  np.testing.assert_array_equal(two["tokens"][:, 12:], batch["inputs"])
  np.testing.assert_array_equal(two["positions"][:, 12:], batch["positions"])
  assert not two["loss_weights"][:, :12].any()
  np.testing.assert_array_equal(
      two["loss_weights"][:, 12:], batch["loss_weights"]
  )
  assert two["is_noised"][:, 12:].all() and not two["is_noised"][:, :12].any()


def test_eval_batches_cover_every_example_once_with_empty_filler_rows():
  examples = _examples([(2, 3), (3, 4), (1, 5), (4, 2), (2, 2)])
  cfg = data.DataConfig(seq_len=8, batch_size=2, vocab_size=VOCAB, seed=9)
  batches = data.eval_batches(examples, _dcfg(), cfg)
  assert len(batches) == 3
  rows = np.concatenate([b["tokens"] for b in batches])
  valid = np.concatenate([b["validity"] for b in batches])
  for i, ex in enumerate(examples):
    n = ex.prompt.size + ex.completion.size
    np.testing.assert_array_equal(
        rows[i, :n], np.concatenate([ex.prompt, ex.completion])
    )
  assert not valid[5].any()  # the filler row
  assert not batches[-1]["loss_weights"][1].any()
  again = data.eval_batches(examples, _dcfg(), cfg)
  np.testing.assert_array_equal(again[0]["inputs"], batches[0]["inputs"])
  assert (
      data.num_target_tokens(batches)
      == sum(int((b["loss_weights"] > 0).sum()) for b in batches)
      > 0
  )


def test_left_padded_prompts():
  examples = _examples([(2, 1), (0, 1), (3, 1)])
  prompts, lengths = data.left_padded_prompts(examples, pad_token_id=0)
  np.testing.assert_array_equal(lengths, [2, 0, 3])
  assert prompts.shape == (3, 3)
  np.testing.assert_array_equal(prompts[0, 1:], examples[0].prompt)
  assert prompts[0, 0] == 0 and (prompts[1] == 0).all()


def test_assemble_rows_rejects_overflow_and_multiple_docs_unpacked():
  doc = data.encode_document(_examples([(3, 3)])[0], _dcfg(), seed=0, epoch=0)
  with pytest.raises(ValueError, match="more than seq_len=8"):
    data.assemble_rows(
        [[doc, doc]], seq_len=8, block_size=4, packing="unaligned"
    )
  with pytest.raises(ValueError, match="one document per row"):
    data.assemble_rows([[doc, doc]], seq_len=16, block_size=4, packing="none")
