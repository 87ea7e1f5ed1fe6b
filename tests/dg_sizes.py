"""Overrides that shrink `diffusion_gemma_tiny.yaml` for the job tests.

Two layers (one sliding, one full, with MoE), width 32, 256 training rows;
imported by the DiffusionGemma sft, rl and opd job tests.
"""

SMALL = [
    "task.num_train=256", "task.num_eval=8", "model.hidden_size=32",
    "model.layer_types=[sliding_attention,full_attention]",
    "model.intermediate_size=48", "model.head_dim=8", "model.global_head_dim=8",
    "model.moe_intermediate_size=16", "data.batch_size=8", "eval.batch_size=8",
    "sampler.max_denoising_steps=4", "training.warmup_steps=1",
]
# A 2-step sft run with its checkpoint (the rl and opd tests' policy).
TWO_STEPS = [*SMALL, "training.max_steps=2",
             "training.checkpoint_every_n_steps=2"]
# The xdist group of the tests using conftest's `dg_two_step_sft` (a run
# with TWO_STEPS): one worker runs them all, so the run is made once.
SFT_GROUP = "dg_two_step_sft"
