"""Block-diffusion generation: the denoiser, the cached driver, the engine."""
