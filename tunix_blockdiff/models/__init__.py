"""Model families: build, HF config mapping, load, export, LoRA merge, tiny builders.

| module          | what                                                       |
|-----------------|------------------------------------------------------------|
| `registry`      | `model.kind` -> a Tunix model (`build_model`), vocab/window |
| `hf_configs`    | HF `config.json` -> Tunix `ModelConfig`, refusals by name   |
| `checkpoints`   | `load_hf` (safetensors), `HFTokenizer`, `merge_lora`        |
| `hf_export`     | any family -> an HF directory (`save_hf`, sharded; the inverse) |
| `tiny`          | small randomly initialised models of every family           |
| `logits`        | target-aligned block-diffusion logits of any family (was `modeling`) |
| `flash`         | a model's flash attention through block-causal Splash/Tokamax kernels (was `attention.shim`) |
| `diffusion_gemma` | Google's DiffusionGemma (Gemma 4 stack, encoder/decoder)  |

The registry's names are re-exported here, so `models.build_model` works.

Arrows: `logits` and `flash` read `attention/` (masks, kernels) and
`objective/`; neither of those imports anything from here.
"""

from tunix_blockdiff.models.registry import build_model
from tunix_blockdiff.models.registry import check_window
from tunix_blockdiff.models.registry import FAMILIES
from tunix_blockdiff.models.registry import KINDS
from tunix_blockdiff.models.registry import model_vocab_size
from tunix_blockdiff.models.registry import sliding_window
