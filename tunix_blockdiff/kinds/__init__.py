"""Model kinds: each kind of model the package post-trains, in one package.

`kinds/diffusion_gemma/` holds everything DiffusionGemma-specific beyond its
model code (which is in `models/diffusion_gemma/`, with the other families):
its objective and batches, trainer, sampler and entropy-bounded likelihood,
Tunix rollout engine and GRPO pieces, and its jobs (`sft`, `rl`, `opd`,
`generate`). The converted Tunix causal LMs are the default kind, served by
the shared packages (`objective`, `rollout`, `rl`, `trainer`) and the jobs'
own code.

Jobs reach a kind only through `runs.kinds`, the registry that says which
kind a recipe, policy or directory is and where each of its verbs lives.
"""
