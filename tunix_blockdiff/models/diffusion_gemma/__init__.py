"""DiffusionGemma (Google's block-diffusion Gemma 4) in JAX: model, config, loading.

See `docs/diffusion_gemma.md`. The sampler lives in
`tunix_blockdiff.kinds.diffusion_gemma.sampler`, the objective in
`tunix_blockdiff.kinds.diffusion_gemma.objective`.
"""

from tunix_blockdiff.models.diffusion_gemma.config import DiffusionGemmaConfig
from tunix_blockdiff.models.diffusion_gemma.config import from_hf
from tunix_blockdiff.models.diffusion_gemma.config import SamplerConfig
from tunix_blockdiff.models.diffusion_gemma.config import sampler_from_generation_config
from tunix_blockdiff.models.diffusion_gemma.loading import load
from tunix_blockdiff.models.diffusion_gemma.loading import read_config
from tunix_blockdiff.models.diffusion_gemma.model import Cache
from tunix_blockdiff.models.diffusion_gemma.model import DiffusionGemma
