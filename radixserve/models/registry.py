"""Which model class runs which architecture family (ModelConfig.architecture)."""
from __future__ import annotations

import torch

from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.model_config import ModelConfig

_MODELS: dict[str, type[torch.nn.Module]] = {
    family: LlamaForCausalLM for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "glm", "glm4", "glm4_moe",
                                             "glm4_moe_lite", "glm_moe_dsa",
                                             "deepseek_v32")}


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The nn.Module class for `config`; raises ValueError for an unsupported family."""
    try:
        return _MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"no model implementation for architecture {config.architecture!r} "
                         f"(supported: {', '.join(sorted(_MODELS))})") from None
