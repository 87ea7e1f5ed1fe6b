"""DiffusionGemma against the reference implementation (golden files).

The goldens come from `tools/diffusion_gemma_goldens.py` (transformers +
torch, float32, CPU): two tiny MoE checkpoints with every weight drawn,
sliding and full layers, `k = v` full layers with their own head size and
kv heads, two soft caps. Tolerance: 5e-5 absolute (measured max 2e-5 on
logits of magnitude up to 6.6, 4e-6 on hidden states).
"""

import json
import pathlib
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_blockdiff.models import diffusion_gemma as dg
from tunix_blockdiff.models.diffusion_gemma import layers

DATA = pathlib.Path(__file__).resolve().parents[1] / "data/diffusion_gemma"
NAMES = ("moe_sliding", "moe_wide")
TOL = 5e-5

# One compiled program per method and shape. Called eagerly, the MoE model
# compiles op by op, which took most of this module's time.
_encode = nnx.jit(lambda model, *args: model.encode(*args))
_decode = nnx.jit(lambda model, *args: model.decode(*args))
_train_logits = nnx.jit(lambda model, *args: model.train_logits(*args))


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
  model, sampler, skipped = dg.load(DATA / request.param)
  return model, sampler, skipped, np.load(DATA / request.param / "reference.npz")


def _prefill(model, ref, tokens="prompt", valid=None, encode=_encode):
  b, t = ref[tokens].shape
  c = model.config.canvas_length
  cache = model.init_cache(b, t + 2 * c)
  valid = jnp.ones((b, t), bool) if valid is None else jnp.asarray(valid)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  return encode(model, jnp.asarray(ref[tokens]), positions, valid, cache)


def _canvas_positions(model, ref, start):
  b = ref["prompt"].shape[0]
  c = model.config.canvas_length
  return jnp.broadcast_to(jnp.arange(start, start + c), (b, c))


def test_encoder_hidden_states_and_cache(loaded):
  model, _, _, ref = loaded
  hidden, cache = _prefill(model, ref)
  t = ref["prompt"].shape[1]
  np.testing.assert_allclose(hidden, ref["enc_hidden"], atol=TOL)
  for i in range(model.config.num_layers):
    kept = ref[f"cache_k{i}"].shape[1]  # sliding layers keep W - 1
    np.testing.assert_allclose(cache.k[i][:, t - kept:t], ref[f"cache_k{i}"],
                               atol=TOL)
    np.testing.assert_allclose(cache.v[i][:, t - kept:t], ref[f"cache_v{i}"],
                               atol=TOL)


def test_decoder_logits_with_and_without_self_conditioning(loaded):
  model, _, _, ref = loaded
  _, cache = _prefill(model, ref)
  t = ref["prompt"].shape[1]
  pos = _canvas_positions(model, ref, t)
  canvas = jnp.asarray(ref["canvas1"])
  plain = _decode(model, canvas, pos, cache)
  np.testing.assert_allclose(plain, ref["logits_plain"], atol=TOL)
  sc = _decode(model, canvas, pos, cache, jnp.asarray(ref["sc_logits"]),
                    jnp.asarray(ref["sc_mask"]))
  np.testing.assert_allclose(sc, ref["logits_sc"], atol=TOL)
  sc_all = _decode(model, canvas, pos, cache, jnp.asarray(ref["sc_logits"]))
  np.testing.assert_allclose(sc_all, ref["logits_sc_all"], atol=TOL)
  # The mask's False row is exactly the unconditioned decoder.
  np.testing.assert_array_equal(np.asarray(sc)[1], np.asarray(plain)[1])
  assert np.abs(np.asarray(sc_all) - np.asarray(plain)).max() > 1e-2


def test_second_canvas_after_encoding_the_first(loaded):
  model, _, _, ref = loaded
  _, cache = _prefill(model, ref)
  t = ref["prompt"].shape[1]
  c = model.config.canvas_length
  pos = _canvas_positions(model, ref, t)
  hidden, cache = _encode(model, jnp.asarray(ref["canvas1"]), pos,
                               jnp.ones(pos.shape, bool), cache)
  np.testing.assert_allclose(hidden, ref["enc2_hidden"], atol=TOL)
  logits = _decode(model, jnp.asarray(ref["canvas2"]), pos + c, cache)
  np.testing.assert_allclose(logits, ref["logits_second"], atol=TOL)


def test_left_padded_prompts(loaded):
  model, _, _, ref = loaded
  valid = ref["pad_valid"]
  hidden, cache = _prefill(model, ref, "pad_prompt", valid)
  diff = np.where(valid[..., None], np.asarray(hidden) - ref["pad_enc_hidden"],
                  0)
  assert np.abs(diff).max() < TOL
  pos = _canvas_positions(model, ref, ref["prompt"].shape[1])
  logits = _decode(model, jnp.asarray(ref["canvas1"]), pos, cache)
  np.testing.assert_allclose(logits, ref["pad_logits"], atol=TOL)


def test_sampler_defaults_and_skipped_vision(loaded):
  _, sampler, skipped, _ = loaded
  assert sampler == dg.SamplerConfig(
      max_denoising_steps=6, entropy_bound=0.2, t_min=0.3, t_max=0.9,
      stability_threshold=1, confidence_threshold=0.05, eos_token_id=3,
      pad_token_id=0)
  assert skipped > 0  # the vision tower's tensors, not loaded


def test_train_logits_equal_encode_then_decode():
  """Whole-row training logits = encoding each prefix, decoding its canvas."""
  model, _, _ = dg.load(DATA / "moe_sliding")
  c = model.config.canvas_length
  rng = np.random.default_rng(0)
  prompt, canvases = 7, 3
  length = prompt + canvases * c
  clean = rng.integers(0, 64, (2, length))
  noisy = clean.copy()
  noisy[:, prompt:] = rng.integers(0, 64, (2, length - prompt))
  idx = np.arange(length)
  canvas_id = np.where(idx >= prompt, (idx - prompt) // c, -1)[None].repeat(2, 0)
  start = np.where(canvas_id >= 0, prompt + canvas_id * c, 0)
  sc = jnp.asarray(rng.standard_normal((2, length, 64)), jnp.float32)
  mask = jnp.array([True, False])
  positions = jnp.broadcast_to(jnp.arange(length), (2, length))
  got = _train_logits(model, jnp.asarray(clean), jnp.asarray(noisy), positions,
                           jnp.ones((2, length), bool), jnp.asarray(canvas_id),
                           jnp.asarray(start), sc, mask)
  cache = model.init_cache(2, length)
  _, cache = _encode(model, jnp.asarray(clean[:, :prompt]), positions[:, :prompt],
                          jnp.ones((2, prompt), bool), cache)
  for j in range(canvases):
    s = slice(prompt + j * c, prompt + (j + 1) * c)
    want = _decode(model, jnp.asarray(noisy[:, s]), positions[:, s], cache,
                        sc[:, s], mask)
    np.testing.assert_allclose(got[:, s], want, atol=TOL)
    _, cache = _encode(model, jnp.asarray(clean[:, s]), positions[:, s],
                            jnp.ones((2, c), bool), cache)


def test_splash_attention_gives_the_dense_training_logits():
  """Under `splash_scope` (Pallas interpret mode), canvas rows as dense.

  The decoder's prompt rows see no key (the guard sends them to key 0) and
  are meaningless in both; the padding rows likewise.
  """
  model, _, _ = dg.load(DATA / "moe_sliding")
  c = model.config.canvas_length
  length = 128
  canvases = (length - 8) // c
  prompt = length - canvases * c
  rng = np.random.default_rng(1)
  clean = rng.integers(0, 64, (2, length))
  noisy = clean.copy()
  noisy[:, prompt:] = rng.integers(0, 64, (2, length - prompt))
  idx = np.arange(length)
  canvas_id = np.where(idx >= prompt, (idx - prompt) // c, -1)[None].repeat(2, 0)
  valid = np.ones((2, length), bool)
  valid[1, -c:] = False  # row 1 ends in padding
  canvas_id[1, -c:] = -1
  start = np.where(canvas_id >= 0, prompt + canvas_id * c, 0)
  positions = jnp.broadcast_to(jnp.arange(length), (2, length))
  args = (jnp.asarray(clean), jnp.asarray(noisy), positions,
          jnp.asarray(valid), jnp.asarray(canvas_id), jnp.asarray(start))
  want = _train_logits(model, *args)

  @nnx.jit
  def splash_logits(model, *args):
    with layers.splash_scope(128, interpret=True):
      return model.train_logits(*args)

  got = splash_logits(model, *args)
  rows = canvas_id >= 0
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows],
                             atol=TOL)


def _copy(tmp_path, edit=None, name="moe_sliding"):
  target = tmp_path / "ckpt"
  shutil.copytree(DATA / name, target)
  if edit:
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
  return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["text_config"].update(use_bidirectional_attention="all"),
         "use_bidirectional_attention"),
        (lambda c: c["text_config"].update(attention_bias=True),
         "attention_bias"),
        (lambda c: c["text_config"].update(hidden_activation="silu"),
         "hidden_activation"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(
            rope_type="yarn"), "rope_type"),
        (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(
            factor=8.0), "factor"),
        (lambda c: c.update(model_type="gemma4"), "model_type"),
        (lambda c: c.update(audio_config={"hidden_size": 8}), "audio"),
        (lambda c: c.update(tie_word_embeddings=False), "tie_word_embeddings"),
        (lambda c: c["text_config"].update(final_logit_softcapping=None),
         "final_logit_softcapping"),
    ],
)
def test_loading_refuses_unsupported_fields(tmp_path, edit, message):
  with pytest.raises(ValueError, match=message) as info:
    dg.load(_copy(tmp_path, edit))
  assert "\n" not in str(info.value)


def test_loading_refuses_audio_and_unknown_tensors(tmp_path):
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  target = _copy(tmp_path)
  tensors = safetensors.numpy.load_file(str(target / "model.safetensors"))
  for extra, message in (("model.encoder.audio_tower.w", "audio"),
                         ("model.decoder.layers.0.mystery", "mystery")):
    safetensors.numpy.save_file(
        {**tensors, extra: np.zeros((2,), np.float32)},
        str(target / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
      dg.load(target)


def test_sharded_safetensors_and_bfloat16(tmp_path):
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  target = _copy(tmp_path)
  tensors = safetensors.numpy.load_file(str(target / "model.safetensors"))
  keys = sorted(tensors)
  half = len(keys) // 2
  weight_map = {}
  for i, part in enumerate((keys[:half], keys[half:])):
    name = f"model-{i + 1:05d}-of-00002.safetensors"
    safetensors.numpy.save_file({k: tensors[k] for k in part},
                                str(target / name))
    weight_map.update({k: name for k in part})
  (target / "model.safetensors").unlink()
  (target / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": weight_map}))
  model, _, _ = dg.load(target)
  ref = np.load(DATA / "moe_sliding/reference.npz")
  hidden, _ = _prefill(model, ref)
  np.testing.assert_allclose(hidden, ref["enc_hidden"], atol=TOL)
  bf16, _, _ = dg.load(target, dtype="bfloat16")
  assert bf16.embedding[...].dtype == jnp.bfloat16
  # Eager: jitted, XLA rounds bfloat16 differently, and layer 0's top-2
  # routing of one token, a near-tie (router probabilities 0.2422 and
  # 0.2423), flips: that token ends 1.8 off and its row's later tokens
  # follow; the other row stays within 0.1.
  hidden16, _ = _prefill(bf16, ref, encode=lambda m, *args: m.encode(*args))
  assert np.abs(np.asarray(hidden16, np.float32) - ref["enc_hidden"]).max() < 0.2


def test_config_validation():
  base = dict(vocab_size=8, hidden_size=8, intermediate_size=8,
              layer_types=("full_attention",), num_heads=2, num_kv_heads=1,
              head_dim=4, global_num_kv_heads=1, global_head_dim=4)
  dg.DiffusionGemmaConfig(**base)
  for change, message in (
      (dict(num_kv_heads=3), "multiple"),
      (dict(layer_types=("local",)), "layer_types"),
      (dict(num_experts=4), "together"),
      (dict(num_experts=2, top_k_experts=3, moe_intermediate_size=4),
       "top_k_experts"),
      (dict(head_dim=3), "even"),
  ):
    with pytest.raises(ValueError, match=message):
      dg.DiffusionGemmaConfig(**{**base, **change})
  with pytest.raises(ValueError, match="t_min"):
    dg.SamplerConfig(t_min=0.9, t_max=0.5)
  with pytest.raises(ValueError, match="entropy_bound"):
    dg.SamplerConfig(entropy_bound=0.0)


def test_dense_variant_runs_and_jits():
  """num_experts=None: dense-only layers (a from-scratch option)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  config = dg.DiffusionGemmaConfig(
      vocab_size=16, hidden_size=16, intermediate_size=24,
      layer_types=("sliding_attention", "full_attention"), num_heads=2,
      num_kv_heads=1, head_dim=8, global_num_kv_heads=1, global_head_dim=8,
      sliding_window=4, canvas_length=4)
  model = dg.DiffusionGemma(config, rngs=nnx.Rngs(0))
  assert model.layers[0].moe is None
  cache = model.init_cache(1, 12)
  pos = jnp.arange(8)[None]
  _, cache = jax.jit(model.encode)(jnp.zeros((1, 8), jnp.int32), pos,
                                   jnp.ones((1, 8), bool), cache)
  logits = model.decode(jnp.zeros((1, 4), jnp.int32), pos[:, :4] + 8, cache)
  assert logits.shape == (1, 4, 16) and bool(jnp.all(jnp.isfinite(logits)))


def test_public_names():
  import tunix_blockdiff as tbd  # pylint: disable=g-import-not-at-top

  assert tbd.DiffusionGemma is dg.DiffusionGemma
  assert tbd.load_diffusion_gemma is dg.load
  assert tbd.DiffusionGemmaTrainer.__name__ == "DiffusionGemmaTrainer"
  assert tbd.DiffusionGemmaSampler.__name__ == "DiffusionGemmaSampler"
