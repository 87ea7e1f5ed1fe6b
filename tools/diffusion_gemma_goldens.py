"""Writes the DiffusionGemma parity goldens under tests/data/diffusion_gemma/.

The tests compare `tunix_blockdiff.models.diffusion_gemma` against these
files, so the test install never needs torch. Each config gets a directory
with the checkpoint exactly as `save_pretrained` writes it (config.json,
generation_config.json, model.safetensors) and `reference.npz`, the
reference implementation's outputs on fixed inputs:

- the encoder's last hidden states and KV cache after a prompt;
- the decoder's logits on a canvas, without and with self-conditioning
  (per-example mask [True, False]);
- a second canvas after the first is encoded;
- left-padded prompts (attention masks), encoder and decoder;

plus `sampler.npz`: the reference sampler's acceptance, renoising, stopping
and temperature functions on fixed inputs.

Run it in its own venv (torch from the registry is several GB, so it stays
out of the test install):

  python -m venv /tmp/goldvenv
  /tmp/goldvenv/bin/pip install "transformers>=5.13" torch safetensors
  /tmp/goldvenv/bin/python tools/diffusion_gemma_goldens.py

Rerunning rewrites the files bit for bit (fixed seeds, float32, CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import DiffusionGemmaConfig
from transformers import DiffusionGemmaForBlockDiffusion
from transformers import DynamicCache
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/data/diffusion_gemma"

_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    position_embedding_size=16,
)

# Small enough for a test to run in milliseconds; each exercises something.
CONFIGS = {
    # Window 6 < prompt 9: the sliding layers cut the cache; 2 kv groups;
    # k = v global layer with its own head dim and one kv head.
    "moe_sliding": dict(
        text=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            sliding_window=6,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=24,
            final_logit_softcapping=30.0,
            max_position_embeddings=256,
        ),
        canvas_length=4,
    ),
    # A full layer first, a window wider than the whole run, top-1 routing,
    # a strong soft cap and other RoPE bases.
    "moe_wide": dict(
        text=dict(
            vocab_size=64,
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=12,
            global_head_dim=8,
            num_global_key_value_heads=2,
            sliding_window=64,
            layer_types=[
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_experts=3,
            top_k_experts=1,
            moe_intermediate_size=16,
            final_logit_softcapping=5.0,
            max_position_embeddings=256,
            rope_parameters={
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 500.0,
                },
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 20000.0,
                },
            },
        ),
        canvas_length=5,
    ),
}

GENERATION = dict(
    max_denoising_steps=6,
    t_min=0.3,
    t_max=0.9,
    stability_threshold=1,
    confidence_threshold=0.05,
    eos_token_id=3,
    pad_token_id=0,
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
  """Draws every weight, norm scale and layer scalar (defaults hide bugs)."""
  gen_ = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      if "vision" in name:
        continue
      if name.endswith("norm.weight") or name.endswith("scale"):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen_))
      elif "embed_tokens" in name:
        p.copy_(0.3 * torch.randn(p.shape, generator=gen_))
      else:
        p.copy_(0.25 * torch.randn(p.shape, generator=gen_))
    for name, b in sorted(model.named_buffers()):
      if name.endswith("layer_scalar"):
        b.copy_(0.5 + torch.rand(b.shape, generator=gen_))


def _cache_arrays(cache, prefix: str) -> dict[str, np.ndarray]:
  out = {}
  for i, layer in enumerate(cache.layers):
    # [B, K, S, H] -> [B, S, K, H]; sliding layers keep their last W-1 only.
    out[f"{prefix}_k{i}"] = layer.keys.transpose(1, 2).numpy()
    out[f"{prefix}_v{i}"] = layer.values.transpose(1, 2).numpy()
  return out


def write_config(name: str, spec: dict, seed: int) -> None:
  """Writes one checkpoint directory and its reference outputs."""
  torch.manual_seed(seed)
  config = DiffusionGemmaConfig(
      text_config=dict(spec["text"]),
      vision_config=dict(_VISION),
      canvas_length=spec["canvas_length"],
  )
  model = DiffusionGemmaForBlockDiffusion(config).eval()
  _randomise(model, seed)
  model.generation_config = gen.DiffusionGemmaGenerationConfig(
      sampler_config=gen.EntropyBoundSamplerConfig(entropy_bound=0.2),
      **GENERATION,
  )
  directory = OUT / name
  directory.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(directory)
  # The file must be the model: reload and compare one forward pass.
  reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(directory).eval()

  text = config.text_config
  vocab, canvas = text.vocab_size, spec["canvas_length"]
  rng = np.random.default_rng(seed)
  prompt = torch.tensor(rng.integers(0, vocab, (2, 9)))
  canvas1 = torch.tensor(rng.integers(0, vocab, (2, canvas)))
  canvas2 = torch.tensor(rng.integers(0, vocab, (2, canvas)))
  sc_logits = torch.tensor(3.0 * rng.standard_normal((2, canvas, vocab)),
                           dtype=torch.float32)
  sc_mask = torch.tensor([True, False])
  ref = {
      "prompt": prompt.numpy(),
      "canvas1": canvas1.numpy(),
      "canvas2": canvas2.numpy(),
      "sc_logits": sc_logits.numpy(),
      "sc_mask": sc_mask.numpy(),
  }
  with torch.no_grad():
    encoder = model.model.encoder
    cache = DynamicCache(config=text)
    enc = encoder(input_ids=prompt, cache=cache)
    ref["enc_hidden"] = enc.last_hidden_state.numpy()
    ref.update(_cache_arrays(cache, "cache"))
    ref["logits_plain"] = model(cache=cache,
                                decoder_input_ids=canvas1).logits.numpy()
    again = reloaded(input_ids=prompt, decoder_input_ids=canvas1).logits
    np.testing.assert_allclose(again.numpy(), ref["logits_plain"], atol=1e-5)
    ref["logits_sc"] = model(
        cache=cache,
        decoder_input_ids=canvas1,
        self_conditioning_logits=sc_logits,
        self_conditioning_mask=sc_mask,
    ).logits.numpy()
    ref["logits_sc_all"] = model(
        cache=cache, decoder_input_ids=canvas1,
        self_conditioning_logits=sc_logits).logits.numpy()
    # The finished canvas is encoded; the next canvas reads it from cache.
    enc2 = encoder(input_ids=canvas1, cache=cache,
                   position_ids=torch.arange(9, 9 + canvas)[None])
    ref["enc2_hidden"] = enc2.last_hidden_state.numpy()
    ref["logits_second"] = model(cache=cache,
                                 decoder_input_ids=canvas2).logits.numpy()

    # Left padding: row 1 has a 5-token prompt. Positions are the physical
    # index, as the reference's generate uses them.
    lengths = np.array([9, 5])
    valid = np.arange(9)[None, :] >= (9 - lengths)[:, None]
    padded = torch.where(torch.tensor(valid), prompt, 0)
    attention = torch.tensor(valid)
    cache = DynamicCache(config=text)
    enc = encoder(input_ids=padded, attention_mask=attention, cache=cache,
                  position_ids=torch.arange(9)[None])
    ref["pad_prompt"] = padded.numpy()
    ref["pad_valid"] = valid
    ref["pad_enc_hidden"] = enc.last_hidden_state.numpy()
    decoder_mask = torch.nn.functional.pad(attention, (0, canvas), value=True)
    ref["pad_logits"] = model(
        cache=cache,
        decoder_input_ids=canvas1,
        decoder_attention_mask=decoder_mask,
        decoder_position_ids=torch.arange(9, 9 + canvas)[None],
    ).logits.numpy()
  np.savez(directory / "reference.npz", **ref)


def write_sampler(seed: int) -> None:
  """The reference sampler's step functions on fixed inputs."""
  rng = np.random.default_rng(seed)
  batch, length, vocab = 3, 8, 11
  out = {}
  # Mixed sharpness per row, so the bound cuts at different ranks.
  scale = np.array([0.5, 3.0, 12.0])[:, None, None]
  logits = torch.tensor(scale * rng.standard_normal((batch, length, vocab)),
                        dtype=torch.float32)
  current = torch.tensor(rng.integers(0, vocab, (batch, length)))
  denoiser = torch.tensor(rng.integers(0, vocab, (batch, length)))
  noise = torch.tensor(rng.integers(0, vocab, (batch, length)))
  out.update(accept_logits=logits.numpy(), accept_current=current.numpy(),
             accept_denoiser=denoiser.numpy(), renoise_noise=noise.numpy())
  for bound in (0.05, 0.3, 1.5):
    sampler = gen.EntropyBoundSampler(
        gen.EntropyBoundSamplerConfig(entropy_bound=bound), length, vocab, 4)
    accepted = sampler.accept_canvas(current, denoiser, logits, 1)
    sampler.initialize_canvas = lambda batch_size, device: noise
    renoised = sampler.renoise_canvas(accepted, 1)
    out[f"accepted_{bound}"] = accepted.numpy()
    out[f"accepted_mask_{bound}"] = sampler.accepted_token_mask.numpy()
    out[f"renoised_{bound}"] = renoised.numpy()

  # Stopping: a scripted run of argmax canvases and logit sharpness.
  steps = 7
  argmax = rng.integers(0, vocab, (steps, batch, length))
  argmax[3] = argmax[2]            # all rows stable from step 3 ...
  argmax[4] = argmax[3]
  argmax[5, 1] = argmax[4, 1]      # ... row 1 stays stable at step 5
  argmax[6] = argmax[5]
  sharp = np.array([[1.0, 20.0, 20.0]] * steps)
  sharp[4, 2] = 0.2                # row 2 unconfident once
  stop_logits = sharp[:, :, None, None] * rng.standard_normal(
      (steps, batch, length, vocab))
  out.update(stop_argmax=argmax, stop_logits=stop_logits.astype(np.float32))
  for stability in (0, 1, 2):
    stopper = gen.StableAndConfidentStoppingCriteria(stability, 0.5)
    flags = [
        stopper(torch.tensor(argmax[s]),
                torch.tensor(stop_logits[s], dtype=torch.float32)).numpy()
        for s in range(steps)
    ]
    out[f"stop_{stability}"] = np.stack(flags)

  # The temperature at each of N steps (the reference counts steps down).
  processor = gen.LinearTemperatureScheduleLogitsProcessor(0.3, 0.9, 5)
  ones = torch.ones(1, 1, 1)
  out["temperatures"] = np.array([
      1.0 / float(processor(None, ones, cur_step=c)) for c in range(5, 0, -1)
  ])
  np.savez(OUT / "sampler.npz", **out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  torch.set_default_dtype(torch.float32)
  OUT.mkdir(parents=True, exist_ok=True)
  for i, (name, spec) in enumerate(CONFIGS.items()):
    write_config(name, spec, args.seed + i)
  write_sampler(args.seed)
  (OUT / "VERSIONS.json").write_text(json.dumps({
      "transformers": transformers.__version__,
      "torch": torch.__version__,
  }, indent=1) + "\n")
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
