"""DiffusionGemma's text-model and sampler configs, and their HF mapping.

`DiffusionGemmaConfig` is the text stack (Gemma 4 layers: sliding and full
attention with their own head sizes, `k = v` full layers, a dense MLP plus a
routed MoE in every layer, tied embeddings, final soft-capping).
`SamplerConfig` is the entropy-bound sampler's settings, read from an HF
`generation_config.json` or given directly.

`from_hf(config_json)` maps a `transformers` `DiffusionGemmaConfig` dict and
refuses, by name, every field whose value would load as a different model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
  """The text stack of a DiffusionGemma model.

  Attributes:
    vocab_size: V.
    hidden_size: D.
    intermediate_size: Hidden size of each layer's dense MLP and of the
      self-conditioning MLP.
    layer_types: One of `LAYER_TYPES` per layer.
    num_heads: Query heads N (all layers).
    num_kv_heads: KV heads of sliding layers.
    head_dim: Head size of sliding layers.
    global_num_kv_heads: KV heads of full layers.
    global_head_dim: Head size of full layers.
    sliding_window: W. A causal (encoder) query sees the W keys ending at
      itself; a canvas (decoder) query sees the last W - 1 cached keys and
      the whole canvas.
    local_rope_theta: RoPE base of sliding layers (full rotary).
    global_rope_theta: RoPE base of full layers.
    global_rope_fraction: Rotated fraction of a full layer's head
      ("proportional" RoPE: the frequencies are those of the full head).
    num_experts: E routed experts per layer, or None for dense-only layers
      (a from-scratch option; released checkpoints are MoE).
    top_k_experts: Experts per token.
    moe_intermediate_size: Hidden size of each expert.
    final_logit_softcap: c in `c * tanh(logits / c)`.
    rms_norm_eps: RMSNorm epsilon.
    canvas_length: C, tokens denoised together.
    pad_token_id, eos_token_id, bos_token_id: Special ids.
    image_token_id: The checkpoint's image placeholder id (prompts holding
      it are refused: text only), or None.
    dtype: Activation dtype name; `param_dtype` the parameters'.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  layer_types: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  global_num_kv_heads: int
  global_head_dim: int
  sliding_window: int = 512
  local_rope_theta: float = 10_000.0
  global_rope_theta: float = 1_000_000.0
  global_rope_fraction: float = 0.25
  num_experts: int | None = None
  top_k_experts: int | None = None
  moe_intermediate_size: int | None = None
  final_logit_softcap: float = 30.0
  rms_norm_eps: float = 1e-6
  canvas_length: int = 256
  pad_token_id: int = 0
  eos_token_id: int = 1
  bos_token_id: int = 2
  image_token_id: int | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size",
                 "num_heads", "num_kv_heads", "head_dim",
                 "global_num_kv_heads", "global_head_dim", "sliding_window",
                 "canvas_length"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not self.layer_types:
      raise ValueError("layer_types must name at least one layer")
    bad = [t for t in self.layer_types if t not in LAYER_TYPES]
    if bad:
      raise ValueError(f"layer_types must be in {LAYER_TYPES}, got {bad}")
    for heads, kv in ((self.num_heads, self.num_kv_heads),
                      (self.num_heads, self.global_num_kv_heads)):
      if heads % kv:
        raise ValueError(
            f"num_heads ({heads}) must be a multiple of every kv head count"
            f" ({kv})"
        )
    for name in ("head_dim", "global_head_dim"):
      if getattr(self, name) % 2:
        raise ValueError(f"{name} must be even (RoPE pairs), got "
                         f"{getattr(self, name)}")
    if not 0.0 < self.global_rope_fraction <= 1.0:
      raise ValueError("global_rope_fraction must be in (0, 1], got "
                       f"{self.global_rope_fraction}")
    moe = (self.num_experts, self.top_k_experts, self.moe_intermediate_size)
    if any(v is not None for v in moe):
      if any(v is None for v in moe):
        raise ValueError(
            "num_experts, top_k_experts and moe_intermediate_size are set"
            f" together or not at all, got {moe}"
        )
      if not 1 <= self.top_k_experts <= self.num_experts:
        raise ValueError(
            f"top_k_experts must be in [1, num_experts={self.num_experts}],"
            f" got {self.top_k_experts}"
        )
    if self.final_logit_softcap <= 0:
      raise ValueError("final_logit_softcap must be > 0, got "
                       f"{self.final_logit_softcap}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got"
                         f" {getattr(self, name)!r}")

  @property
  def num_layers(self) -> int:
    return len(self.layer_types)

  @property
  def is_moe(self) -> bool:
    return self.num_experts is not None

  def layer(self, i: int) -> tuple[bool, int, int]:
    """(is_sliding, kv heads, head dim) of layer i."""
    sliding = self.layer_types[i] == "sliding_attention"
    if sliding:
      return True, self.num_kv_heads, self.head_dim
    return False, self.global_num_kv_heads, self.global_head_dim


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """The entropy-bound sampler (the reference's generation defaults).

  Attributes:
    max_denoising_steps: N, the step limit per canvas.
    entropy_bound: gamma. A step accepts the k lowest-entropy positions
      with `sum of the first k entropies - the k-th <= gamma`.
    t_min, t_max: Linear temperature schedule: the step that has n steps
      left (n = N .. 1) runs at `t_min + (t_max - t_min) * n / N`.
    stability_threshold: S. A canvas stops once its argmax canvas equals
      each of the previous S steps' and ...
    confidence_threshold: ... its mean entropy is below c.
    eos_token_id: Row stop token (None: rows stop at max_new_tokens).
    pad_token_id: Written after a row's first EOS and for finished rows.
    greedy: Each step's denoiser canvas is the argmax of its scaled logits
      instead of a draw (acceptance, renoising and stopping unchanged): the
      revising sampler's analogue of greedy decoding, for evaluation. Its
      trajectories have no likelihood, so RL rollouts and the scorer refuse
      it.
  """

  max_denoising_steps: int = 48
  entropy_bound: float = 0.1
  t_min: float = 0.4
  t_max: float = 0.8
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  eos_token_id: int | None = 1
  pad_token_id: int = 0
  greedy: bool = False

  def __post_init__(self):
    if (not isinstance(self.max_denoising_steps, int)
        or self.max_denoising_steps < 1):
      raise ValueError("max_denoising_steps must be a positive int, got "
                       f"{self.max_denoising_steps!r}")
    if not self.entropy_bound > 0:
      raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound}")
    if not 0 < self.t_min < self.t_max:
      raise ValueError(
          f"need 0 < t_min < t_max, got t_min={self.t_min} t_max={self.t_max}"
      )
    if not isinstance(self.stability_threshold, int) or (
        self.stability_threshold < 0):
      raise ValueError("stability_threshold must be an int >= 0, got "
                       f"{self.stability_threshold!r}")
    if not self.confidence_threshold > 0:
      raise ValueError("confidence_threshold must be > 0, got "
                       f"{self.confidence_threshold}")
    if not isinstance(self.greedy, bool):
      raise TypeError(f"greedy must be a bool, got {self.greedy!r}")


_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")


def _refuse(config: Mapping[str, Any], key: str, allowed, why: str) -> None:
  value = config.get(key)
  if value not in allowed:
    raise ValueError(
        f"config.json text_config.{key}={value!r} is not supported: {why}"
        f" (allowed: {list(allowed)})"
    )


def _rope(text: Mapping[str, Any]) -> dict[str, float]:
  rope = text.get("rope_parameters") or {}
  local = rope.get("sliding_attention", {"rope_type": "default",
                                         "rope_theta": 10_000.0})
  full = rope.get("full_attention", {"rope_type": "proportional",
                                     "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0})
  if local.get("rope_type", "default") != "default" or local.get(
      "partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(
        "config.json rope_parameters.sliding_attention must be plain"
        f" (rope_type 'default', full rotary), got {local}"
    )
  if full.get("rope_type") not in ("proportional", "default"):
    raise ValueError(
        "config.json rope_parameters.full_attention.rope_type must be"
        f" 'proportional' or 'default', got {full.get('rope_type')!r}"
    )
  for part in (local, full):
    if part.get("factor", 1.0) != 1.0:
      raise ValueError(
          f"config.json rope_parameters factor={part['factor']} (scaled"
          " RoPE) is not supported"
      )
  fraction = full.get("partial_rotary_factor", 1.0)
  return dict(
      local_rope_theta=float(local.get("rope_theta", 10_000.0)),
      global_rope_theta=float(full.get("rope_theta", 1_000_000.0)),
      global_rope_fraction=float(fraction),
  )


def from_hf(config_json: Mapping[str, Any], *, dtype: str = "float32",
            param_dtype: str | None = None) -> DiffusionGemmaConfig:
  """A `DiffusionGemmaConfig` from an HF `config.json` dict.

  Args:
    config_json: The parsed `config.json` of a `transformers`
      `DiffusionGemmaForBlockDiffusion` checkpoint (`model_type:
      diffusion_gemma`, with `text_config`).
    dtype: Activation dtype name.
    param_dtype: Parameter dtype name (default: `dtype`).

  Returns:
    The text-stack config.

  Raises:
    ValueError: naming the first field this implementation would load as a
      different model, or a missing field.
  """
  if config_json.get("model_type") != "diffusion_gemma":
    raise ValueError(
        "config.json model_type must be 'diffusion_gemma', got"
        f" {config_json.get('model_type')!r}"
    )
  text = config_json.get("text_config")
  if not isinstance(text, Mapping):
    raise ValueError("config.json has no text_config")
  missing = [k for k in _TEXT_KEYS if k not in text]
  if missing:
    raise ValueError(f"config.json text_config is missing {missing}")
  _refuse(text, "use_bidirectional_attention", (None,),
          "the encoder pass is causal in this implementation")
  _refuse(text, "attention_bias", (None, False),
          "the Gemma 4 projections have no bias")
  _refuse(text, "hidden_activation", (None, "gelu_pytorch_tanh"),
          "the feed-forward uses tanh-approximated GELU")
  _refuse(text, "use_clipped_linears", (None, False),
          "clipped linears are a vision-tower feature")
  _refuse(text, "enable_moe_block", (None, True),
          "DiffusionGemma layers always carry the MoE block")
  _refuse(text, "num_kv_shared_layers", (None, 0), "no KV sharing")
  _refuse(text, "hidden_size_per_layer_input", (None, 0),
          "no per-layer embeddings")
  for key in ("audio_config",):
    if config_json.get(key) is not None:
      raise ValueError(
          f"config.json {key} is set: audio inputs are not supported (text"
          " only)"
      )
  layer_types = tuple(text.get("layer_types") or ())
  num_layers = int(text["num_hidden_layers"])
  if len(layer_types) != num_layers:
    raise ValueError(
        f"config.json layer_types has {len(layer_types)} entries for"
        f" num_hidden_layers={num_layers}"
    )
  heads = int(text["num_attention_heads"])
  local_kv = int(text["num_key_value_heads"])
  local_dim = int(text["head_dim"])
  overrides = text.get("per_layer_config") or {}
  global_kv, global_dim = None, None
  for i, kind in enumerate(layer_types):
    o = overrides.get(str(i), overrides.get(i, {})) or {}
    unknown = sorted(set(o) - {"head_dim", "num_key_value_heads"})
    if unknown:
      raise ValueError(
          f"config.json per_layer_config[{i}] sets {unknown}: not supported"
      )
    if kind == "sliding_attention":
      if o.get("head_dim", local_dim) != local_dim or o.get(
          "num_key_value_heads", local_kv) != local_kv:
        raise ValueError(
            f"config.json per_layer_config[{i}] changes a sliding layer's"
            " heads: not supported (sliding layers share one shape)"
        )
      continue
    shape = (int(o.get("head_dim", local_dim)),
             int(o.get("num_key_value_heads", local_kv)))
    if global_dim is None:
      global_dim, global_kv = shape
    elif shape != (global_dim, global_kv):
      raise ValueError(
          f"config.json per_layer_config[{i}]: full layers of different"
          " shapes are not supported"
      )
  if global_dim is None:
    global_dim, global_kv = local_dim, local_kv
  softcap = text.get("final_logit_softcapping", 30.0)
  if softcap is None:
    raise ValueError(
        "config.json final_logit_softcapping=None is not supported"
    )
  eos = text.get("eos_token_id", 1)
  if isinstance(eos, (list, tuple)):
    eos = eos[0]
  return DiffusionGemmaConfig(
      vocab_size=int(text["vocab_size"]),
      hidden_size=int(text["hidden_size"]),
      intermediate_size=int(text["intermediate_size"]),
      layer_types=layer_types,
      num_heads=heads,
      num_kv_heads=local_kv,
      head_dim=local_dim,
      global_num_kv_heads=int(global_kv),
      global_head_dim=int(global_dim),
      sliding_window=int(text.get("sliding_window", 512)),
      num_experts=text.get("num_experts"),
      top_k_experts=text.get("top_k_experts"),
      moe_intermediate_size=text.get("moe_intermediate_size"),
      final_logit_softcap=float(softcap),
      rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
      canvas_length=int(config_json.get("canvas_length") or 256),
      pad_token_id=int(text.get("pad_token_id") or 0),
      eos_token_id=int(eos),
      bos_token_id=int(text.get("bos_token_id") or 2),
      image_token_id=config_json.get("image_token_id"),
      dtype=dtype,
      param_dtype=param_dtype or dtype,
      **_rope(text),
  )


def sampler_from_generation_config(
    generation_json: Mapping[str, Any] | None,
    model_config: DiffusionGemmaConfig,
) -> SamplerConfig:
  """Sampler defaults from `generation_config.json` (unset: the reference's).

  Args:
    generation_json: The parsed `generation_config.json`, or None.
    model_config: Supplies the EOS and pad ids when the file has none.

  Returns:
    The sampler config.
  """
  g = dict(generation_json or {})
  defaults = SamplerConfig()
  bound = (g.get("sampler_config") or {}).get("entropy_bound")
  eos = g.get("eos_token_id", model_config.eos_token_id)
  if isinstance(eos, (list, tuple)):
    if len(eos) != 1:
      raise ValueError(
          "generation_config.json eos_token_id lists several ids: one is"
          f" supported, got {eos}"
      )
    eos = eos[0]

  def pick(key, default):
    value = g.get(key)
    return default if value is None else value

  return SamplerConfig(
      max_denoising_steps=int(pick("max_denoising_steps",
                                   defaults.max_denoising_steps)),
      entropy_bound=float(bound if bound is not None
                          else defaults.entropy_bound),
      t_min=float(pick("t_min", defaults.t_min)),
      t_max=float(pick("t_max", defaults.t_max)),
      stability_threshold=int(pick("stability_threshold",
                                   defaults.stability_threshold)),
      confidence_threshold=float(pick("confidence_threshold",
                                      defaults.confidence_threshold)),
      eos_token_id=None if eos is None else int(eos),
      pad_token_id=int(pick("pad_token_id", model_config.pad_token_id)),
  )
