"""The Tunix causal LM families this package supports, and `model.kind`.

| kind          | model                                                    |
|---------------|----------------------------------------------------------|
| `tiny_<fam>`  | a randomly initialised `tiny_models.tiny_<fam>`          |
| `<fam>_hf`    | a Hugging Face safetensors directory (`checkpoints`)     |

for `<fam>` in `qwen3`, `qwen2`, `llama3`, `gemma3`. Every family is called
as `model(tokens [B, L], positions [B, L], cache, attention_mask [B, L, L'])`
and returns `(logits [B, L, V], cache)`, which is all `models.logits` and
`rollout` need. Gemma3's sliding-window layers apply their window by
*physical* slot inside each call (`sliding_window`); the callers that lay
tokens out other than in logical order check it (`check_window`).
"""

from __future__ import annotations

import numbers

from flax import nnx
import jax

FAMILIES = ("qwen3", "qwen2", "llama3", "gemma3")
KINDS = tuple(f"tiny_{f}" for f in FAMILIES) + tuple(
    f"{f}_hf" for f in FAMILIES
)

# Recipe keys of a `tiny_<family>` model (all families share them).
_TINY_KEYS = (
    "num_layers",
    "embed_dim",
    "hidden_dim",
    "num_heads",
    "head_dim",
    "num_kv_heads",
)


def build_model(model_cfg, *, seed: int, mesh: jax.sharding.Mesh | None = None):
  """The model a recipe's `model` section names.

  Args:
    model_cfg: The `model` section: `kind` (one of `KINDS`); for `tiny_*`
      `vocab_size` and the sizes in `_TINY_KEYS`, optionally `random_mlp`
      (`tiny_models.random_mlps`: Tunix starts feed-forward kernels at zero,
      where they never train) with `mlp_out_scale` (the down projection's
      draw scale, default 1.0; 0 starts each block as the identity) and,
      for `tiny_gemma3`, `sliding_window_size`; for `*_hf` `path`, `dtype`
      and optionally `param_dtype`.
    seed: Initialisation seed of a `tiny_*` model.
    mesh: Mesh a `*_hf` checkpoint is loaded onto (Tunix's sharding rules).

  Returns:
    The Tunix model.
  """
  kind = model_cfg.kind
  if kind not in KINDS:
    raise ValueError(f"model.kind must be one of {list(KINDS)}, got {kind!r}")
  if kind.startswith("tiny_"):
    from tunix_blockdiff.models import tiny as tiny_models  # pylint: disable=g-import-not-at-top

    family = kind.removeprefix("tiny_")
    sizes = {key: int(model_cfg[key]) for key in _TINY_KEYS}
    window = model_cfg.get("sliding_window_size")
    if family == "gemma3" and window is not None:
      sizes["sliding_window_size"] = int(window)
    builder = getattr(tiny_models, kind)
    out_scale = float(model_cfg.get("mlp_out_scale", 1.0))
    if out_scale < 0:
      raise ValueError(f"model.mlp_out_scale must be >= 0, got {out_scale}")
    return builder(
        int(model_cfg.vocab_size),
        seed=seed,
        random_mlp=bool(model_cfg.get("random_mlp", False)),
        mlp_out_scale=out_scale,
        **sizes,
    )
  from tunix_blockdiff.models import checkpoints  # pylint: disable=g-import-not-at-top

  if not model_cfg.get("path"):
    raise ValueError(f"model.kind={kind} needs model.path (an HF model dir)")
  return checkpoints.load_hf(
      model_cfg.path,
      family=kind.removesuffix("_hf"),
      dtype=model_cfg.dtype,
      param_dtype=model_cfg.get("param_dtype"),
      mesh=mesh,
  )


def model_vocab_size(model) -> int:
  """The logits width V of a Tunix model.

  Read from the config (`vocab_size`, or Gemma3's `num_embed`), else from the
  first embedding parameter's rows, never by tracing the model: a nested trace
  inside a jitted program breaks models that mutate themselves when called
  (qwix LoRA records state on its modules).

  Raises:
    ValueError: the model has neither.
  """
  config = getattr(model, "config", None)
  for name in ("vocab_size", "num_embed"):
    value = getattr(config, name, None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
      return int(value)
  if isinstance(model, nnx.Module):
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      if any("embed" in str(p) for p in path) and leaf.get_value().ndim == 2:
        return int(leaf.get_value().shape[0])
  raise ValueError(
      f"cannot tell the vocabulary size of {type(model).__name__}: it has no"
      " config.vocab_size / config.num_embed and no embedding parameter"
  )


def sliding_window(model) -> int | None:
  """The sliding-window width of a model's local layers (Gemma3), or None."""
  window = getattr(getattr(model, "config", None), "sliding_window_size", None)
  return None if window is None else int(window)


def check_window(model, call_length: int, *, what: str, fix: str) -> None:
  """Raises unless a model call of `call_length` slots is window-exact.

  Tunix's Gemma3 masks its sliding-window layers by *physical* slot
  distance inside a call (`|i - j| < window` over the call's
  `[L, L']` mask). A call whose slots are not in logical order gets the
  window right only when it cuts nothing, i.e. `call_length <= window`; then
  the logical window (the cacheless reference) cuts nothing either.

  Args:
    model: The model.
    call_length: The longest distance, in slots, the call can span + 1.
    what: The calling path, for the message.
    fix: What the user can change, for the message.
  """
  window = sliding_window(model)
  if window is not None and call_length > window:
    raise ValueError(
        f"{what} spans {call_length} slots, more than the model's sliding"
        f" window ({window}); Tunix's Gemma3 applies that window by physical"
        " slot, which differs from the logical window there, so the result"
        f" would be silently wrong. {fix}"
    )
