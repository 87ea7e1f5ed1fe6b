"""The output head of a Tunix causal LM, apart from the rest of the model.

At a real vocabulary the logits dominate a training step's memory: Qwen3's
151,936 entries are 1.2 GB of float32 per 2,048 tokens, and the loss keeps
several such buffers for the backward pass. Splitting the model at its head
lets the loss run the head on a chunk of tokens at a time
(`objective.loss.chunked_diffusion_loss`), so the logits of a whole batch
never exist.

`headless(model)` is a view of the model (same arrays) that returns its
final hidden states `final_norm(x)` where the model returns logits;
`output_head(model)` is the head that turns those states into the logits
the model itself would return. Tunix's Qwen2, Qwen3, Llama3 and Gemma3 all
end in `embedder.decode(x)` (tied) or `lm_head(x)`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from tunix_blockdiff.models import logits as logits_lib

Head = Callable[[jax.Array], jax.Array]


def _tied(model) -> bool:
  """Whether `model` decodes with its input embedding (`embedder.decode`)."""
  config = getattr(model, "config", None)
  for key in ("use_tied_embedding", "weight_tying"):  # Qwen2/3; Llama3
    if hasattr(config, key):
      return bool(getattr(config, key))
  return getattr(model, "lm_head", None) is None  # Gemma3: always tied


def check_splittable(model) -> None:
  """Raises ValueError unless `model` ends in a head `output_head` knows."""
  if _tied(model):
    embedder = getattr(model, "embedder", None)
    if not callable(getattr(embedder, "decode", None)):
      raise ValueError(
          f"head_chunk: {type(model).__name__} has no `embedder.decode`, so"
          " its output head cannot be run apart (Tunix Qwen2, Qwen3, Llama3"
          " and Gemma3 can); leave head_chunk unset")
  elif not callable(getattr(model, "lm_head", None)):
    raise ValueError(
        f"head_chunk: {type(model).__name__} has no callable `lm_head`;"
        " leave head_chunk unset")


def output_head(model) -> Head:
  """hidden [..., D] (the model's dtype) -> float32 logits [..., V]."""
  check_splittable(model)
  decode = model.embedder.decode if _tied(model) else model.lm_head
  return lambda hidden: decode(hidden).astype(jnp.float32)


class HeadlessView:
  """A model view whose call returns final hidden states, not logits.

  Attributes:
    model: The view: call it as the model; where the model would return
      logits [B, L, V] it returns `final_norm(x)` [B, L, D] (cast to float32
      by the families that cast their logits).
    dtype: The hidden states' own dtype, known once the view has been
      called (the head takes its input in this dtype).
    head: The view's own output head: hidden [..., D] in `dtype` -> logits
      [..., V] in the head's dtype, before the float32 cast that Qwen2 and
      Qwen3 apply to their logits (the same values: that cast is exact).
      The view's, so that a LoRA'd head is intercepted inside a trace.
  """

  def __init__(self, model):
    check_splittable(model)
    self.model = logits_lib.fresh_view(model)
    self.dtype = None

    def identity(hidden):
      self.dtype = hidden.dtype
      return hidden

    # The view is this trace's own copy: replacing its head on the instance
    # leaves `model` untouched. `object.__setattr__` keeps nnx from taking
    # the function for a submodule.
    if _tied(model):
      self.head: Head = self.model.embedder.decode  # bound before replacing
      object.__setattr__(self.model.embedder, "decode", identity)
    else:
      self.head = self.model.lm_head
      object.__setattr__(self.model, "lm_head", identity)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """The view's head on final hidden states [..., D] (cast to `dtype`)."""
    return self.head(hidden.astype(self.dtype))


def head_weight(view: HeadlessView) -> tuple[jax.Array, bool]:
  """The view's head as a plain matrix: (weight, vocab_major).

  A tied head decodes with the input embedding, [V, D] (`vocab_major`); a
  linear head (`lm_head`, Tunix's `Einsum` 'BTD,DV->BTV') holds [D, V].
  For a kernel that runs the head's product itself
  (`rollout.head_kernel`). Raises ValueError for a head with LoRA weights
  (its product is not the matrix's alone) or one of another form.
  """
  tied = _tied(view.model)
  # The view's head: the embedder's bound `decode`, or the `lm_head` module
  # (the view's own attributes are replaced by identities).
  if tied:
    module, name = getattr(view.head, "__self__", None), "input_embedding"
  else:
    module, name = view.head, "w"
    if getattr(module, "einsum_str", "BTD,DV->BTV") != "BTD,DV->BTV":
      raise ValueError(f"the output head's einsum {module.einsum_str!r} is"
                       " not 'BTD,DV->BTV'")
  if any(hasattr(module, name + suffix) for suffix in ("_lora_a", "_lora_b")):
    raise ValueError("the output head has LoRA weights; a kernel over its"
                     " plain matrix would leave them out")
  param = getattr(module, name, None)
  if param is None:
    raise ValueError(f"{type(module).__name__} has no `{name}` matrix")
  weight = getattr(param, "value", param)
  if weight.ndim != 2:
    raise ValueError(f"the output head's matrix must be 2-D, got"
                     f" {weight.shape}")
  return weight, tied


def headless(model) -> HeadlessView:
  """`HeadlessView(model)`: the model returning hidden states, not logits."""
  return HeadlessView(model)


__all__ = ["Head", "HeadlessView", "check_splittable", "head_weight",
           "headless", "output_head"]
