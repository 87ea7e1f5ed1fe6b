"""DiffusionGemma as a kind: objective, trainer, sampler, RL and jobs.

* `objective`, `data`, `trainer`: the training objective (canvas
  corruption, self-conditioning), its batches and `DiffusionGemmaTrainer`.
* `sampler`, `entropy_bound`, `output`: the sampler, its entropy-bounded
  commits and the trajectories it records.
* `engine`, `scoring`, `likelihood`, `cluster`, `grpo`, `learner`: the Tunix
  rollout engine, the exact trajectory likelihood, and GRPO/OPD on them.
* `sft`, `rl`, `opd`, `generate`: the jobs (`runs.kinds` dispatches to
  them); `evaluation`: the rl job's held-out rewards and their gain.

The model itself is `models.diffusion_gemma`.
"""
