"""A small, independent pure-NumPy reference of DESIGN.md 5.3 for the tests.

Written from the design text, slot by slot and row by row with Python loops,
sharing no code with `tunix_blockdiff.rollout`. It computes in float64 and
records the smallest *decision margin* it met (argmax gaps, threshold gaps,
ranking gaps at the commit boundary, top-k/top-p cut gaps), so a test can
skip the rare inputs where float32 and float64 may legitimately disagree.

Also here: a canvas-dependent logits function (`context_logits`), so the
order of commits changes later proposals.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# ----------------------------------------------------------------------------
# A canvas-dependent logits function (NumPy twin of the JAX one in the tests).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContextLogitsParams:
  """Random parameters of `context_logits`."""

  embed: np.ndarray  # [V, D]
  unembed: np.ndarray  # [D, V]
  freqs: np.ndarray  # [D]
  phase: np.ndarray  # [D]
  scale: float


def make_params(seed: int, vocab: int, dim: int = 8, scale: float = 4.0):
  rs = np.random.RandomState(seed)
  return ContextLogitsParams(
      embed=rs.normal(size=(vocab, dim)).astype(np.float32),
      unembed=rs.normal(size=(dim, vocab)).astype(np.float32) / math.sqrt(dim),
      freqs=rs.uniform(0.1, 1.5, size=(dim,)).astype(np.float32),
      phase=rs.uniform(0, 2 * np.pi, size=(dim,)).astype(np.float32),
      scale=float(scale),
  )


def context_logits(params, tokens, positions, validity):
  """float64 [B, L, V]: slot i mixes all valid tokens by logical distance.

  h_i = sin(pos_i * freqs + phase) + sum_j valid_j cos(0.5 (pos_i - pos_j))
  embed[tok_j] / L; logits_i = scale * tanh(h_i) @ unembed. Depends on logical
  positions only, so it is equivariant under any physical permutation.
  """
  tokens = np.asarray(tokens)
  pos = np.asarray(positions, np.float64)
  valid = np.asarray(validity, np.float64)
  length = tokens.shape[1]
  emb = params.embed.astype(np.float64)[tokens]  # [B, L, D]
  weights = (
      np.cos(0.5 * (pos[:, :, None] - pos[:, None, :])) * valid[:, None, :]
  )
  mixed = np.einsum("bij,bjd->bid", weights, emb) / length
  base = np.sin(pos[:, :, None] * params.freqs + params.phase)
  hidden = np.tanh(base + mixed)
  return params.scale * hidden @ params.unembed.astype(np.float64)


# ----------------------------------------------------------------------------
# The reference denoiser.
# ----------------------------------------------------------------------------


def _log_softmax(x):
  finite = x[np.isfinite(x)]
  top = finite.max()
  return x - (top + np.log(np.sum(np.exp(finite - top))))


def _gap(values):
  """Difference between the largest and second largest finite values."""
  finite = np.sort(values[np.isfinite(values)])[::-1]
  return finite[0] - finite[1] if finite.size > 1 else np.inf


def proposal_distribution(logits, config):
  """Proposal log-probs of one slot, and the smallest margin of the filters."""
  logits = logits.astype(np.float64).copy()
  logits[config.mask_token_id] = -np.inf
  margin = np.inf
  if config.temperature == 0:
    return _log_softmax(logits), margin
  scaled = logits / config.temperature
  if config.top_k is not None and config.top_k < np.isfinite(scaled).sum():
    desc = np.sort(scaled[np.isfinite(scaled)])[::-1]
    kth = desc[config.top_k - 1]
    margin = min(margin, kth - desc[config.top_k])
    scaled = np.where(scaled >= kth, scaled, -np.inf)
  if config.top_p is not None:
    probs = np.exp(_log_softmax(scaled))
    order = np.argsort(-probs, kind="stable")
    kept = np.zeros_like(probs, bool)
    mass = 0.0
    for token in order:
      if not np.isfinite(scaled[token]):
        break
      margin = min(margin, abs(mass - config.top_p))
      if mass < config.top_p:
        kept[token] = True
      mass += probs[token]
    scaled = np.where(kept, scaled, -np.inf)
  return _log_softmax(scaled), margin


def reference_denoise(
    logits_of, canvas, positions, completion, validity, config, noise_of=None
):
  """DESIGN.md 5.3 by direct transcription.

  Args:
    logits_of: tokens [B, L] -> float [B, L, V] target-aligned logits.
    canvas, positions, completion, validity: [B, L] NumPy arrays.
    config: a DenoiseConfig (read as plain attributes).
    noise_of: step -> float [B, block_size, V] Gumbel noise, indexed by the
      slot's in-block offset (pos % block_size); required when sampling.

  Returns:
    dict with tokens, commit_step, logprobs (all [B, L]), num_steps, margin.
  """
  canvas = np.asarray(canvas)
  positions = np.asarray(positions)
  completion = np.asarray(completion, bool)
  validity = np.asarray(validity, bool)
  batch, length = canvas.shape
  bs = config.block_size
  tokens = np.where(completion, config.mask_token_id, canvas).astype(np.int64)
  commit = np.full((batch, length), -1, np.int64)
  logprobs = np.zeros((batch, length), np.float64)
  block_steps = np.zeros(batch, np.int64)
  last_block = np.full(batch, -1, np.int64)
  margin = np.inf
  step = 0

  def first_eos(b):
    if config.eos_token_id is None:
      return None
    hits = [
        positions[b, i]
        for i in range(length)
        if completion[b, i]
        and commit[b, i] >= 0
        and tokens[b, i] == config.eos_token_id
    ]
    return min(hits) if hits else None

  def is_live(b):
    masked = [i for i in range(length) if completion[b, i] and commit[b, i] < 0]
    if not masked:
      return False
    eos = first_eos(b)
    if eos is not None and all(positions[b, i] > eos for i in masked):
      return False
    return True

  while True:
    live = [b for b in range(batch) if is_live(b)]
    if not live:
      break
    logits = np.asarray(logits_of(tokens), np.float64)
    noise = None if config.temperature == 0 else np.asarray(noise_of(step))
    for b in live:
      masked = [
          i for i in range(length) if completion[b, i] and commit[b, i] < 0
      ]
      active = min(positions[b, i] // bs for i in masked)
      eligible = [i for i in masked if positions[b, i] // bs == active]
      if active != last_block[b]:
        block_steps[b] = 0
      proposal, logp = {}, {}
      for i in eligible:
        dist, filter_margin = proposal_distribution(logits[b, i], config)
        margin = min(margin, filter_margin)
        scores = (
            dist if noise is None else dist + noise[b, positions[b, i] % bs]
        )
        margin = min(margin, _gap(scores))
        proposal[i] = int(np.argmax(scores))
        logp[i] = dist[proposal[i]]
      conf = {i: math.exp(logp[i]) for i in eligible}
      ranked = sorted(eligible, key=lambda i: (-conf[i], positions[b, i]))
      if config.steps_per_block is not None:
        steps_left = config.steps_per_block - block_steps[b]
        assert steps_left >= 1, "a block took more than steps_per_block steps"
        count = -(-len(eligible) // steps_left)
        chosen = ranked[:count]
        if count < len(ranked):
          margin = min(margin, conf[ranked[count - 1]] - conf[ranked[count]])
      else:
        if config.threshold < 1.0:
          margin = min(
              margin, min(abs(c - config.threshold) for c in conf.values())
          )
        chosen = [i for i in eligible if conf[i] > config.threshold]
        if not chosen:
          chosen = ranked[:1]
          if len(ranked) > 1:
            margin = min(margin, conf[ranked[0]] - conf[ranked[1]])
      for i in chosen:
        tokens[b, i] = proposal[i]
        commit[b, i] = step
        logprobs[b, i] = logp[i]
      block_steps[b] += 1
      last_block[b] = active
    step += 1

  for b in range(batch):
    eos = first_eos(b)
    if eos is None:
      continue
    for i in range(length):
      if completion[b, i] and positions[b, i] > eos:
        tokens[b, i] = config.pad_token_id
        commit[b, i] = -1
        logprobs[b, i] = 0.0
  return dict(
      tokens=tokens,
      commit_step=commit,
      logprobs=logprobs,
      num_steps=step,
      margin=margin,
  )
