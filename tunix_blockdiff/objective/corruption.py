"""Training canvases: seeded per-block corruption (DESIGN.md section 5.2).

Everything here is NumPy and runs in the data pipeline. Randomness is a pure
function of (seed, epoch, example id), so a resumed or rerun job reproduces
the same corruption bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tunix_blockdiff import config as config_lib


class CorruptionResult(NamedTuple):
  """One corrupted batch. All arrays are [B, L].

  Attributes:
    inputs: int, the canvas: clean tokens with corrupted slots set to the mask
      token.
    corruption_mask: bool, slots replaced by the mask token.
    loss_mask: bool, slots whose clean token is a training target (the
      corrupted slots plus, under `seed_and_mask`, the seeds of later blocks).
    loss_weights: float32, per-target weight (1, or 1/t under `elbo`); 0 where
      `loss_mask` is False.
    noise_rate: float32, the noise rate t of each slot's block (0 for slots
      outside any eligible block).
  """

  inputs: np.ndarray
  corruption_mask: np.ndarray
  loss_mask: np.ndarray
  loss_weights: np.ndarray
  noise_rate: np.ndarray


def _as_2d(name: str, value, shape=None, dtype=None) -> np.ndarray:
  value = np.asarray(value)
  if dtype is not None:
    value = value.astype(dtype)
  if value.ndim != 2:
    raise ValueError(f"{name} must have shape [batch, length], got {value.shape}")
  if shape is not None and value.shape != shape:
    raise ValueError(f"{name} must have the shape of tokens {shape}, got {value.shape}")
  return value


def row_rng(seed: int, epoch: int, example_id: int) -> np.random.Generator:
  """The generator for one example: a pure function of its identity."""
  for name, value in (("seed", seed), ("epoch", epoch), ("example_id", example_id)):
    if int(value) < 0:
      raise ValueError(f"{name} must be >= 0, got {value}")
  return np.random.default_rng([int(seed), int(epoch), int(example_id)])


def _corrupt_row(
    rng: np.random.Generator,
    eligible: np.ndarray,
    valid: np.ndarray,
    positions: np.ndarray,
    block_key: np.ndarray,
    segment: np.ndarray,
    is_seed: np.ndarray,
    is_first_block: np.ndarray,
    config: config_lib.BlockDiffusionConfig,
):
  """Returns (corrupted, loss, rate) bool/bool/float rows for one example."""
  length = eligible.shape[0]
  # Only valid slots consume randomness, taken in logical order (segment,
  # block, position). Sorting by the block alone would leave slots of one
  # block in physical order, so a permuted row (context parallelism) would get
  # different draws; drawing for padding would make the draws depend on how
  # much padding the batch happens to have.
  logical_order = np.lexsort((positions, block_key))
  logical_order = logical_order[valid[logical_order]]
  num_valid = logical_order.shape[0]
  # Blocks are identified by (segment, logical block); rates are drawn in
  # sorted key order so the draw does not depend on physical order.
  keys, block_of_valid = np.unique(
      block_key[logical_order], return_inverse=True
  )
  rates = rng.uniform(config.min_noise, 1.0, size=keys.shape[0])
  block_of_slot = np.full(length, -1, np.int64)
  block_of_slot[logical_order] = block_of_valid.reshape(-1)
  draws = np.ones(length)
  draws[logical_order] = rng.random(num_valid)
  fallback_draws = np.zeros(length)
  fallback_draws[logical_order] = rng.random(num_valid)

  candidate = eligible & ~is_seed
  if config.stream == "clean_prefix":
    # One cut block per document: earlier blocks stay clean and unsupervised.
    cut_ok = np.zeros(length, bool)
    for seg in np.unique(segment[candidate]):
      doc_blocks = np.unique(block_of_slot[candidate & (segment == seg)])
      cut = doc_blocks[rng.integers(doc_blocks.shape[0])]
      cut_ok |= (segment == seg) & (block_of_slot >= cut)
    candidate &= cut_ok
  else:
    cut_ok = np.ones(length, bool)

  slot_rate = np.where(valid, rates[block_of_slot], 0.0)
  selected = candidate & (draws < slot_rate)
  # Every block with a candidate slot gets at least one target.
  for block in np.unique(block_of_slot[candidate & ~selected]):
    in_block = candidate & (block_of_slot == block)
    if not np.any(selected & in_block):
      scores = np.where(in_block, fallback_draws, -1.0)
      selected[np.argmax(scores)] = True

  loss = selected.copy()
  if config.canvas == "seed_and_mask":
    # Seeds stay clean and are supervised from the end of the previous block,
    # except the seed of a document's first block, which has no predecessor.
    loss |= eligible & is_seed & ~is_first_block & cut_ok
  rate = np.where(candidate | (eligible & is_seed), slot_rate, 0.0)
  return selected, loss, rate.astype(np.float32)


def corrupt(
    tokens,
    validity,
    completion,
    config: config_lib.BlockDiffusionConfig,
    *,
    seed: int,
    epoch: int = 0,
    example_ids=None,
    positions=None,
    segment_ids=None,
) -> CorruptionResult:
  """Corrupts a batch block by block (DESIGN.md 5.2).

  Per row and logical block, one noise rate `t ~ U[min_noise, 1]` is drawn
  and each eligible slot (valid & completion, and not the block's seed under
  `seed_and_mask`) is masked with probability t; a block with an eligible slot
  always gets at least one target. The prompt is protected by `completion`.

  Args:
    tokens: int [B, L] clean tokens.
    validity: bool [B, L] real (non-padding) slots.
    completion: bool [B, L] slots the model must generate.
    config: The objective's `BlockDiffusionConfig`.
    seed: Run seed (>= 0).
    epoch: Epoch index (>= 0).
    example_ids: Optional int [B] stable example identities (default
      `arange(B)`); with (seed, epoch) they fix each row's randomness.
    positions: Optional int [B, L] logical positions (default `arange(L)`).
    segment_ids: Optional int [B, L] document ids of packed rows.

  Returns:
    A `CorruptionResult`.
  """
  if not isinstance(config, config_lib.BlockDiffusionConfig):
    raise TypeError(
        "config must be a BlockDiffusionConfig, got"
        f" {type(config).__name__}"
    )
  tokens = _as_2d("tokens", tokens)
  if not np.issubdtype(tokens.dtype, np.integer):
    raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
  shape = tokens.shape
  if shape[1] == 0:
    raise ValueError("tokens must have a nonempty length axis")
  validity = _as_2d("validity", validity, shape, bool)
  completion = _as_2d("completion", completion, shape, bool)
  if positions is None:
    positions = np.broadcast_to(np.arange(shape[1]), shape)
  positions = _as_2d("positions", positions, shape)
  if np.any(positions[validity] < 0):
    raise ValueError("positions must be >= 0 at valid slots")
  if segment_ids is None:
    segment_ids = np.zeros(shape, np.int64)
  segment_ids = _as_2d("segment_ids", segment_ids, shape).astype(np.int64)
  if example_ids is None:
    example_ids = np.arange(shape[0])
  example_ids = np.asarray(example_ids)
  if example_ids.shape != (shape[0],):
    raise ValueError(
        f"example_ids must have shape [batch] = ({shape[0]},), got"
        f" {example_ids.shape}"
    )

  block_size = config.block_size
  block = positions.astype(np.int64) // block_size
  block_key = segment_ids * (int(block.max(initial=0)) + 1) + block
  eligible = validity & completion
  is_seed = np.zeros(shape, bool)
  if config.canvas == "seed_and_mask":
    is_seed = positions % block_size == 0
  is_first_block = block == 0

  corrupted = np.zeros(shape, bool)
  loss = np.zeros(shape, bool)
  rate = np.zeros(shape, np.float32)
  for row in range(shape[0]):
    if not eligible[row].any():
      continue
    rng = row_rng(seed, epoch, int(example_ids[row]))
    corrupted[row], loss[row], rate[row] = _corrupt_row(
        rng,
        eligible[row],
        validity[row],
        positions[row],
        block_key[row],
        segment_ids[row],
        is_seed[row],
        is_first_block[row],
        config,
    )

  inputs = np.where(corrupted, tokens.dtype.type(config.mask_token_id), tokens)
  if config.loss_weighting == "elbo":
    weights = np.where(loss, 1.0 / np.maximum(rate, config.min_noise), 0.0)
    weights = np.where(loss & is_seed, 1.0, weights)
  else:
    weights = loss.astype(np.float32)
  return CorruptionResult(
      inputs=inputs,
      corruption_mask=corrupted,
      loss_mask=loss,
      loss_weights=weights.astype(np.float32),
      noise_rate=rate,
  )


class TwoStreamInputs(NamedTuple):
  """Model inputs for the two-stream objective: `[x0 | xt]`, all [B, 2L].

  Attributes:
    tokens: int, clean tokens then corrupted tokens.
    positions: int, logical positions (the same for both halves).
    segment_ids: int, document ids (the same for both halves).
    validity: bool, real slots (the same for both halves).
    is_noised: bool, True on the xt half.
    targets: int, clean tokens on both halves.
    loss_weights: float32, 0 on the clean half, the corruption's weights on
      the noised half.
  """

  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  validity: np.ndarray
  is_noised: np.ndarray
  targets: np.ndarray
  loss_weights: np.ndarray


def build_two_stream_inputs(
    clean_tokens,
    corruption: CorruptionResult,
    validity,
    *,
    positions=None,
    segment_ids=None,
) -> TwoStreamInputs:
  """Concatenates the clean and corrupted streams (BD3-LM).

  Use with `masks.two_stream_mask(positions[:, :L], ...)`; loss lives on the
  noised half only.

  Args:
    clean_tokens: int [B, L] x0.
    corruption: The `CorruptionResult` of `corrupt` on the same batch.
    validity: bool [B, L].
    positions: Optional int [B, L] (default `arange(L)`).
    segment_ids: Optional int [B, L] (default zeros).

  Returns:
    `TwoStreamInputs` with arrays of shape [B, 2L].
  """
  clean_tokens = _as_2d("clean_tokens", clean_tokens)
  shape = clean_tokens.shape
  validity = _as_2d("validity", validity, shape, bool)
  if corruption.inputs.shape != shape:
    raise ValueError(
        f"corruption arrays must have the shape of clean_tokens {shape}, got"
        f" {corruption.inputs.shape}"
    )
  if positions is None:
    positions = np.broadcast_to(np.arange(shape[1]), shape)
  positions = _as_2d("positions", positions, shape)
  if segment_ids is None:
    segment_ids = np.zeros(shape, np.int32)
  segment_ids = _as_2d("segment_ids", segment_ids, shape)
  twice = lambda x: np.concatenate([x, x], axis=1)
  return TwoStreamInputs(
      tokens=np.concatenate([clean_tokens, corruption.inputs], axis=1),
      positions=twice(positions),
      segment_ids=twice(segment_ids),
      validity=twice(validity),
      is_noised=np.concatenate(
          [np.zeros(shape, bool), np.ones(shape, bool)], axis=1
      ),
      targets=twice(clean_tokens),
      loss_weights=np.concatenate(
          [np.zeros(shape, np.float32), corruption.loss_weights], axis=1
      ),
  )
