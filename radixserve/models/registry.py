"""Which model class runs which architecture family (ModelConfig.architecture)."""
from __future__ import annotations

import torch

from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.model_config import ModelConfig

# Qwen2 is the Llama decoder with a q/k/v bias (a ModelConfig flag); Qwen3 / GLM-4 join as
# flags or small subclasses of LlamaForCausalLM.
_MODELS: dict[str, type[torch.nn.Module]] = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The nn.Module class for `config`; raises ValueError for an unsupported family."""
    try:
        return _MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"no model implementation for architecture {config.architecture!r} "
                         f"(supported: {', '.join(sorted(_MODELS))})") from None
