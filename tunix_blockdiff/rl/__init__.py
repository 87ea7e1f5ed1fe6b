"""RL and on-policy distillation with trajectory-exact diffusion log-probs."""
