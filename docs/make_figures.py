"""Draws docs/block_diffusion.png: block diffusion in one picture.

Run: python docs/make_figures.py  (a few seconds on CPU; no model needed)

Left: the block-causal mask (block 4, length 12) that `block_causal_mask`
builds. Middle: the two-stream mask for [x0 | xt]. Right: a toy denoising
trajectory from `denoise` with a logits function that knows the answer but
is unsure of it, so several steps per block are needed.
"""

import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

import tunix_blockdiff as tbd

OUT = pathlib.Path(__file__).resolve().parent / "block_diffusion.png"


def toy_trajectory():
  """A 3-block completion denoised by an oracle with position-dependent doubt."""
  length, prompt, vocab, mask = 16, 4, 12, 11
  answer = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6])
  confidence = 2.0 + 4.0 * np.random.default_rng(0).random(length)

  def logits_fn(tokens, positions):
    del tokens
    onehot = jax.nn.one_hot(jnp.asarray(answer), vocab)
    return (onehot * jnp.asarray(confidence)[:, None])[None] + 0.0 * positions[..., None]

  canvas = jnp.asarray(answer)[None]
  positions = jnp.arange(length)[None]
  completion = positions >= prompt
  result = tbd.denoise(
      logits_fn, canvas, positions, completion, jnp.ones_like(completion),
      tbd.DenoiseConfig(block_size=4, mask_token_id=mask, threshold=0.7),
  )
  return np.asarray(result.commit_step)[0], prompt


def main():
  fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
  pos = jnp.arange(12)
  block = np.asarray(tbd.block_causal_mask(pos, pos, 4)[0])
  axes[0].imshow(block, cmap="Blues")
  axes[0].set_title("block-causal mask (block 4)\nquery sees its block and earlier blocks")
  axes[0].set_xlabel("key position"); axes[0].set_ylabel("query position")

  two = np.asarray(tbd.two_stream_mask(jnp.arange(8), 4)[0])
  axes[1].imshow(two, cmap="Greens")
  axes[1].axhline(7.5, color="k"); axes[1].axvline(7.5, color="k")
  axes[1].set_title("two-stream mask [x0 | xt]\nnoised block: clean past + itself")
  axes[1].set_xticks([3.5, 11.5], ["clean x0", "noised xt"])
  axes[1].set_yticks([3.5, 11.5], ["x0", "xt"])

  steps, prompt = toy_trajectory()
  grid = np.where(steps < 0, np.nan, steps).astype(float)[None]
  axes[2].imshow(grid, cmap="viridis", aspect="auto")
  for i, s in enumerate(steps):
    axes[2].text(i, 0, "P" if i < prompt else str(s), ha="center", va="center",
                 color="white" if i >= prompt else "black")
  for b in range(4, 16, 4):
    axes[2].axvline(b - 0.5, color="red", linewidth=2)
  axes[2].set_yticks([])
  axes[2].set_title("denoising: step that committed each slot\n(P = prompt; red = block boundary)")
  axes[2].set_xlabel("logical position")
  fig.tight_layout()
  fig.savefig(OUT, dpi=110)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
