"""The block-diffusion training objective: corruption, alignment, loss."""
