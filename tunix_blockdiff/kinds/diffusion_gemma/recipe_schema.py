"""The DiffusionGemma sft recipe's schema (`runs.schema`).

Its `model`, `objective`, `sampler`, `data` and `eval` sections differ from
a converted causal LM's; the rest (`task`, `dataset`, `tokenizer`, `lora`,
`training`, `mesh`, `distributed`) are the shared `runs.sections`. The
rules build `DiffusionGemmaConfig`, `DiffusionGemmaObjective` and
`SamplerConfig`, so their own checks stay the one place those rules live.
"""

from __future__ import annotations

from tunix_blockdiff.kinds.diffusion_gemma import objective as dg_objective
from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models.diffusion_gemma import config as dg_config
from tunix_blockdiff.runs import recipe_paths
from tunix_blockdiff.runs import schema as s
from tunix_blockdiff.runs import sections

TINY_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
               "num_kv_heads", "head_dim", "global_num_kv_heads",
               "global_head_dim", "sliding_window", "canvas_length")
SAMPLER_KEYS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max",
                "stability_threshold", "confidence_threshold")


def _model(value, key):
  if value["kind"] == "diffusion_gemma_hf":
    if value.get("path") is None:
      raise s.refuse(f"{key}.path", None, "must be set for"
                     f" {key}.kind=diffusion_gemma_hf (an HF directory)")
    recipe_paths.check_hf_dir(f"{key}.path", value["path"])
    return
  missing = [k for k in (*TINY_SIZES, "layer_types", "final_logit_softcap")
             if value.get(k) is None]
  if missing:
    raise s.refuse(f"{key}.{missing[0]}", None,
                   f"must be set for {key}.kind=tiny_diffusion_gemma")
  moe = value.get("num_experts")
  s.wrap(key, lambda: dg.DiffusionGemmaConfig(
      layer_types=tuple(value["layer_types"]),
      num_experts=moe,
      top_k_experts=None if moe is None else value.get("top_k_experts"),
      moe_intermediate_size=(None if moe is None
                             else value.get("moe_intermediate_size")),
      final_logit_softcap=float(value["final_logit_softcap"]),
      dtype=value.get("dtype", "float32"),
      **{k: value[k] for k in TINY_SIZES}))


MODEL = s.section({
    "kind": s.choice("tiny_diffusion_gemma", "diffusion_gemma_hf",
                     required=True),
    "path": s.text(null=True),
    "dtype": s.choice(*sections.DTYPES),
    "param_dtype": s.choice(*sections.DTYPES, null=True),
    **{k: s.integer(1) for k in TINY_SIZES},
    "layer_types": s.sequence(s.choice(*dg_config.LAYER_TYPES), low=1),
    "num_experts": s.integer(1, null=True),
    "top_k_experts": s.integer(1, null=True),
    "moe_intermediate_size": s.integer(1, null=True),
    "final_logit_softcap": s.number(0, low_open=True, null=True),
    **sections.MODEL_ATTENTION,
}, sections.attention_keys, _model, required=True)


def _objective(value, key):
  s.wrap(key, lambda: dg_objective.DiffusionGemmaObjective(
      canvas_length=1, vocab_size=2, **value))


OBJECTIVE = s.section({
    "min_noise": s.number(0, 1, low_open=True),
    "self_conditioning_prob": s.probability(),
}, _objective, required=True)


def _sampler(value, key):
  given = {k: value[k] for k in SAMPLER_KEYS if value.get(k) is not None}
  s.wrap(key or "sampler", lambda: dg.SamplerConfig(**given))


SAMPLER = s.section({
    "max_denoising_steps": s.integer(1, null=True),
    "entropy_bound": s.number(0, null=True),
    "t_min": s.number(0, null=True),
    "t_max": s.number(0, null=True),
    "stability_threshold": s.integer(1, null=True),
    "confidence_threshold": s.number(0, null=True),
}, _sampler, null=True)

DATA = s.section({
    "seq_len": s.integer(1, required=True),
    "batch_size": s.integer(1, required=True),
}, required=True)

EVAL = s.section({"batch_size": s.integer(1, required=True)}, required=True)

SFT = s.section(
    {**sections.BASE, **sections.SFT_DATA, "model": MODEL,
     "objective": OBJECTIVE, "sampler": SAMPLER, "data": DATA,
     "eval": EVAL},
    *sections.SFT_RULES)

__all__ = ["MODEL", "OBJECTIVE", "SAMPLER", "SAMPLER_KEYS", "SFT", "TINY_SIZES"]
