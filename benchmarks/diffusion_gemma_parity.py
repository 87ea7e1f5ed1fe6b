"""DiffusionGemma parity table: this package vs the `transformers` reference.

Loads each golden checkpoint under tests/data/diffusion_gemma/ (written by
tools/diffusion_gemma_goldens.py with transformers + torch, float32, CPU)
through `models.diffusion_gemma.load`, runs the same inputs and prints the
max absolute difference of every compared tensor, and the largest
magnitude of the reference tensor for scale.

    python benchmarks/diffusion_gemma_parity.py
    tunix-blockdiff bench diffusion_gemma_parity
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np

from tunix_blockdiff.models import diffusion_gemma as dg

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests/data/diffusion_gemma"


def compare(name: str) -> list[tuple[str, float, float]]:
  """(tensor, max |ours - reference|, max |reference|) rows of one config."""
  model, _, _ = dg.load(DATA / name)
  ref = np.load(DATA / name / "reference.npz")
  cfg = model.config
  b, t = ref["prompt"].shape
  c = cfg.canvas_length
  rows = []

  def add(label, ours, theirs, where=None):
    diff = np.abs(np.asarray(ours, np.float64) - theirs)
    if where is not None:
      diff = np.where(where, diff, 0.0)
    rows.append((label, float(diff.max()), float(np.abs(theirs).max())))

  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  canvas_pos = jnp.broadcast_to(jnp.arange(t, t + c), (b, c))
  cache = model.init_cache(b, t + 2 * c)
  hidden, cache = model.encode(jnp.asarray(ref["prompt"]), positions,
                               jnp.ones((b, t), bool), cache)
  add("encoder hidden states", hidden, ref["enc_hidden"])
  k_diff = v_diff = 0.0
  for i in range(cfg.num_layers):
    kept = ref[f"cache_k{i}"].shape[1]
    k_diff = max(k_diff, float(np.abs(
        np.asarray(cache.k[i][:, t - kept:t]) - ref[f"cache_k{i}"]).max()))
    v_diff = max(v_diff, float(np.abs(
        np.asarray(cache.v[i][:, t - kept:t]) - ref[f"cache_v{i}"]).max()))
  rows.append(("encoder cache keys (all layers)", k_diff,
               max(float(np.abs(ref[f"cache_k{i}"]).max())
                   for i in range(cfg.num_layers))))
  rows.append(("encoder cache values (all layers)", v_diff,
               max(float(np.abs(ref[f"cache_v{i}"]).max())
                   for i in range(cfg.num_layers))))
  canvas = jnp.asarray(ref["canvas1"])
  add("decoder logits", model.decode(canvas, canvas_pos, cache),
      ref["logits_plain"])
  add("decoder logits, self-conditioning mask [on, off]",
      model.decode(canvas, canvas_pos, cache, jnp.asarray(ref["sc_logits"]),
                   jnp.asarray(ref["sc_mask"])), ref["logits_sc"])
  add("decoder logits, self-conditioning on",
      model.decode(canvas, canvas_pos, cache, jnp.asarray(ref["sc_logits"])),
      ref["logits_sc_all"])
  hidden2, cache = model.encode(canvas, canvas_pos, jnp.ones((b, c), bool),
                                cache)
  add("encoder hidden states, first canvas", hidden2, ref["enc2_hidden"])
  add("decoder logits, second canvas",
      model.decode(jnp.asarray(ref["canvas2"]), canvas_pos + c, cache),
      ref["logits_second"])
  valid = ref["pad_valid"]
  cache = model.init_cache(b, t + c)
  hidden, cache = model.encode(jnp.asarray(ref["pad_prompt"]), positions,
                               jnp.asarray(valid), cache)
  add("left-padded: encoder hidden (valid slots)", hidden,
      ref["pad_enc_hidden"], valid[..., None])
  add("left-padded: decoder logits", model.decode(canvas, canvas_pos, cache),
      ref["pad_logits"])
  return rows


def main() -> None:
  names = sorted(p.name for p in DATA.iterdir() if p.is_dir())
  print("| config | tensor | max abs diff | max abs reference |")
  print("|---|---|---|---|")
  for name in names:
    for label, diff, scale in compare(name):
      print(f"| {name} | {label} | {diff:.1e} | {scale:.2f} |")


if __name__ == "__main__":
  main()
