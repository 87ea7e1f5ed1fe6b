"""What every run of a job needs, shared by the jobs and the model kinds.

Recipes, output directories and summaries (`common`, `outputs`), models,
LoRA and meshes (`model_setup`), evaluation (`evaluation`), SFT and RL data
(`sft_data`, `rl_data`, `rl_reward`), checkpoints of rl/opd runs
(`rl_checkpoints`, `rl_common`), teachers (`ar_teacher`, `hf_teacher`) and
exported directories (`exported`). The verbs themselves live in `jobs/`.
"""
