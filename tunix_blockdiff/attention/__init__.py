"""Block-causal attention: dense masks, context parallelism, kernels."""
