"""FLOP and memory accounting of one training step (`sft_step.py`'s columns).

`model_gflops` counts what MFU conventionally counts (6 per matmul
parameter per token plus the attention mask's own pairs); `loss_gflops` is
XLA's count of a lowered program; `peak_gib` the device's peak memory.
"""

from __future__ import annotations

from flax import nnx
import jax


def loss_gflops(loss_fn, model, batch) -> float:
  """XLA's FLOP count (GFLOP) of `grad(loss_fn)` on `batch`.

  Counted on the lowered program (no compile: at real sizes on a TPU each
  compile costs tens of seconds); a Pallas kernel counts as its own cost
  estimate, or nothing where it has none, so this column compares programs
  of one attention kind. The MFU column uses `model_gflops` instead. NaN
  (printed `n/a`) where the backend gives no count before compiling (TPU).
  """
  graphdef, state = nnx.split(model)

  def grad(state, batch):
    return jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), batch))(state)

  cost = jax.jit(grad).lower(state, batch).cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  if not cost or "flops" not in cost:  # a TPU's lowered programs have none
    return float("nan")
  return float(cost["flops"]) / 1e9


def attended_pairs(stream: str | None, length: int, block: int) -> int:
  """(query, key) pairs one row's attention mask allows.

  Args:
    stream: None for the causal step, else a block-diffusion stream.
    length: L, the row's tokens.
    block: The block size.

  Returns:
    Causal: L(L+1)/2. Single and clean-prefix (block-causal over L):
    b^2 n(n+1)/2 with n = L/b blocks. Two-stream: the clean stream's
    block-causal pairs plus each noised block's clean prefix and itself,
    b^2 n(n+1).
  """
  if stream is None:
    return length * (length + 1) // 2
  n = length // block
  pairs = block * block * n * (n + 1) // 2
  return 2 * pairs if stream == "two_stream" else pairs


def model_gflops(model, args, stream: str | None) -> float:
  """Model FLOPs (GFLOP) of one step's forward and backward pass.

  6 per matmul parameter per token (the embedding lookup is free), the
  output head (tied or not) on the L tokens that have logits (the
  two-stream step runs the rest of the model on 2L but its head only on
  the L noised slots), plus 12 per attended (query, key) pair per head
  dimension per layer (QK^T and PV, forward and backward), the mask's own
  pairs (`attended_pairs`): the work a kernel that skips masked tiles must
  do, the usual MFU convention.
  """
  config = model.config
  params = sum(
      x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  head = config.vocab_size * config.embed_dim
  body = params - (head if config.use_tied_embedding else 2 * head)
  tokens = args.batch * args.length
  body_tokens = tokens * (2 if stream == "two_stream" else 1)
  attention = (12 * config.num_layers * config.num_heads * config.head_dim
               * args.batch * attended_pairs(stream, args.length, args.block))
  return (6 * (body * body_tokens + head * tokens) + attention) / 1e9


def peak_gib() -> float:
  """The device's peak bytes in use so far (GiB), NaN where not reported."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", float("nan")) / 2**30
